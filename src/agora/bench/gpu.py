"""``agora bench gpu``: what one stage of a real-size model costs on this machine's accelerator.

Per stage kind (head, body, tail) of the manifest, through the same ``StageRuntime`` a node runs: forward +
backward seconds per microbatch, tokens/s, MFU against the card's peak, and the measured peak memory next to what
``agora plan`` predicts, for each backward mode (stash, recompute) at the chosen precision. It runs on the CPU too
(``--device cpu``, small manifests), which is how the test suite keeps it working on machines without a GPU.
"""

from __future__ import annotations

import gc
import time
from pathlib import Path
from typing import Optional

import psutil
import torch

from agora.bench.common import markdown_table, write_result
from agora.config import Manifest, load_manifest
from agora.model import flops_per_token
from agora.server.observers import Observers
from agora.server.runtime import Counters, RuntimeOptions, StageRuntime, resolve_device

# Dense bf16 peak of the cards this is run on (vendor datasheets); unknown cards report MFU as None.
PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "RTX 4090": 165.0}


def _peak_tflops(device: torch.device) -> Optional[float]:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_TFLOPS.items() if k in name), None)


def _peak_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(psutil.Process().memory_info().rss)


def _reset_peak(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_stage(manifest: Manifest, stage: int, options: RuntimeOptions, microbatch: int, repeats: int) -> dict:
    """Median forward+backward seconds of one microbatch through ``stage`` (the tail's forward holds its backward;
    other stages get a random output gradient), after one warm-up; peak memory over the whole measurement."""
    device = resolve_device(options.device)
    _reset_peak(device)
    before = _peak_bytes(device)
    rt = StageRuntime(manifest, stage, Counters(), Observers(), options=options)
    shape = manifest.model
    gen = torch.Generator().manual_seed(stage)
    tokens = torch.randint(0, shape.vocab_size, (microbatch, shape.seq_len), generator=gen, dtype=torch.int32)
    last = torch.randint(0, shape.vocab_size, (microbatch,), generator=gen, dtype=torch.int32)
    width = shape.d_model if manifest.residual.mode == "dense" else manifest.residual.k
    coords = torch.randn(microbatch, shape.seq_len, width, generator=gen)
    inputs = [tokens, last] if rt.is_head else [coords, tokens, last]
    times = []
    for i in range(repeats + 1):
        _sync(device)
        t0 = time.perf_counter()
        pending, _ = rt.forward(inputs, True, rt.generation)
        if rt.is_tail:
            rt.finish_tail(pending)
        else:
            out = rt.boundary(pending).coords
            rt.backward(pending, torch.randn(out.shape, generator=gen))
        _sync(device)
        if i:  # the first one pays for allocation and kernel selection
            times.append(time.perf_counter() - t0)
    peak = _peak_bytes(device) - (0 if device.type == "cuda" else before)
    seconds = sorted(times)[len(times) // 2]
    n_tokens = microbatch * shape.seq_len
    flops = flops_per_token(manifest, stage) * n_tokens
    peak_tflops = _peak_tflops(device)
    del rt
    _reset_peak(device)
    return {
        "stage": stage, "layers": manifest.stages[stage], "backward": options.backward,
        "checkpoint_blocks": options.checkpoint_blocks,
        "precision": options.precision, "seconds": seconds, "tokens_per_s": n_tokens / seconds,
        "tflops": flops / seconds / 1e12, "mfu": flops / seconds / 1e12 / peak_tflops if peak_tflops else None,
        "peak_bytes": peak, "peak_kind": "device allocated" if device.type == "cuda" else "process RSS growth",
        "predicted_bytes": _predicted(manifest, stage, options, microbatch),
    }


def _predicted(manifest: Manifest, stage: int, options: RuntimeOptions, microbatch: int) -> int:
    """The planner's device bytes for this setting (``agora plan``)."""
    from agora.plan import predict_stage_bytes

    # One microbatch in flight and no optimizer step: what this measurement runs.
    return int(predict_stage_bytes(manifest, stage, precision=options.precision, backward=options.backward,
                                   microbatch=microbatch, in_flight=1, offload_optimizer=options.offload_optimizer,
                                   checkpointing=options.checkpoint_blocks, stepped=False))


def run(manifest_spec: str, out: Path, device: str = "auto", precision: str = "bf16", microbatch: int = 1,
        repeats: int = 3, stages: Optional[list[int]] = None) -> dict:
    """Head, one body stage and the tail of ``manifest_spec`` (or ``stages``), in both backward modes, and stashed
    with per-block checkpointing."""
    manifest = load_manifest(manifest_spec)
    dev = resolve_device(device)
    n = manifest.n_stages
    chosen = stages if stages is not None else sorted({0, n // 2, n - 1})
    rows = []
    for stage in chosen:
        for backward, checkpoint_blocks in (("stash", False), ("recompute", False), ("stash", True)):
            options = RuntimeOptions(device=str(dev), precision=precision, backward=backward,
                                     checkpoint_blocks=checkpoint_blocks)
            rows.append(measure_stage(manifest, stage, options, microbatch, repeats))
    card = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    result = {"manifest": manifest_spec, "manifest_hash": manifest.hash, "device": str(dev), "card": card,
              "cuda": torch.version.cuda, "microbatch": microbatch, "seq_len": manifest.model.seq_len,
              "rows": rows}
    table = markdown_table(
        ["stage", "layers", "backward", "blocks checkpointed", "precision", "s / microbatch", "tokens/s", "TFLOP/s",
         "MFU", "peak GB", "planned GB"],
        [[r["stage"], r["layers"], r["backward"], "yes" if r["checkpoint_blocks"] else "no", r["precision"],
          r["seconds"], r["tokens_per_s"], r["tflops"],
          r["mfu"] if r["mfu"] is not None else "-", r["peak_bytes"] / 1e9,
          r["predicted_bytes"] / 1e9 if r["predicted_bytes"] else "-"] for r in rows])
    md = (f"{manifest_spec} ({manifest.hash}) on {card}, microbatch {microbatch} x {manifest.model.seq_len} "
          f"tokens; peak = {rows[0]['peak_kind']}. TFLOP/s and MFU count the model's FLOPs only, not what "
          f"recompute or checkpointing computes again.\n\n{table}\n")
    write_result(out, "gpu", result, md)
    return result
