"""Where and in which precision a peer computes, and how much memory it used: shared by nodes and ``train-local``.

A peer's device and precision are its own business, not the manifest's. bf16 means ``torch.autocast`` over fp32
weights, so master weights, gradients and optimizer moments stay fp32 whatever the device.
"""

from __future__ import annotations

import contextlib
import resource
import sys
from pathlib import Path
from typing import Optional

import torch

PRECISIONS = ("fp32", "bf16")


def resolve_device(spec: str) -> torch.device:
    """``auto`` (CUDA when available, else CPU), ``cpu``, ``cuda`` or ``cuda:N``; a clear error for anything else
    or for a CUDA device this machine does not have."""
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(spec)
    except (RuntimeError, TypeError):
        raise ValueError(f"--device {spec!r}: use auto, cpu, cuda or cuda:N") from None
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"--device {spec!r}: only cpu and cuda devices are supported")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"--device {spec}: this machine has no CUDA device torch can use")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(f"--device {spec}: there are only {torch.cuda.device_count()} CUDA devices")
    return device


def check_precision(device: torch.device, precision: str) -> None:
    """A clear error for an unknown precision, or for bf16 on a CUDA card without native bf16."""
    if precision not in PRECISIONS:
        raise ValueError(f"--precision {precision!r}: use one of {', '.join(PRECISIONS)}")
    if precision == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise ValueError(f"--precision bf16: {torch.cuda.get_device_name(device)} has no native bf16; "
                         f"use --precision fp32")


def autocast(device: torch.device, precision: str):
    """The context a forward (and the backward it records) runs in: bf16 autocast, or nothing for fp32."""
    if precision == "bf16":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def _status_bytes(*keys: str) -> dict[str, int]:
    """Sizes from one read of ``/proc/self/status`` (Linux), in bytes: {key: bytes} for the keys found."""
    found = {}
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            key, _, rest = line.partition(":")
            if key in keys:
                found[key] = int(rest.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        return {}
    return found


def memory_report(device: torch.device) -> dict:
    """This process's memory: the device's peak of allocated tensors (CUDA's allocator statistics; None on a CPU,
    where the tensors are host memory and count in the resident set), and the host resident set now and at its
    peak (read together, so the peak is never below the current value). Cheap: no synchronisation, no
    allocation."""
    status = _status_bytes("VmRSS", "VmHWM")
    peak_rss = status.get("VmHWM")
    if peak_rss is None:  # not Linux: ru_maxrss is KiB on Linux and BSDs, bytes on macOS
        scale = 1 if sys.platform == "darwin" else 1024
        peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale
    device_peak = device_now = None
    if device.type == "cuda":
        device_peak = int(torch.cuda.max_memory_allocated(device))
        device_now = int(torch.cuda.memory_allocated(device))
    return {"device": str(device), "device_peak_bytes": device_peak, "device_allocated_bytes": device_now,
            "host_rss_bytes": status.get("VmRSS"), "host_peak_rss_bytes": int(peak_rss)}
