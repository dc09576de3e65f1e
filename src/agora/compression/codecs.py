"""Full all-reduce codecs: which dtype a dense gradient all-reduce puts on the wire (fp64, fp32, fp16, bf16).

Why a choice at all: hivemind's butterfly all-reduce returns each peer a delta and applies ``local += delta``; only
a return path more precise than fp32 keeps the float32 result bit-identical on every replica. A cheaper wire dtype
saves bytes but costs bit-identity (replicas drift from ~1 ulp (fp32) to ~1e-3 relative (fp16, bf16) apart per
round): ulps stay within ``averaging.agreement_tolerance``, 1e-3 per round is a divergence the repair would see. ``FP64`` is therefore the default and today's
only bit-identical choice; the codecs are not wired into ``agora.server.averaging`` yet.

Details (the per-codec table, how to wire a codec in, what the repair would need, bytes per round):
docs/COMPRESSION.md.
"""

from __future__ import annotations

import enum
from typing import List, Sequence

import torch

__all__ = ["Codec", "encode", "decode", "quantize", "wire_bytes", "cast_all"]

FP16_MAX = float(torch.finfo(torch.float16).max)


class Codec(str, enum.Enum):
    FP64 = "fp64"
    FP32 = "fp32"
    FP16 = "fp16"
    BF16 = "bf16"

    @property
    def wire_dtype(self) -> torch.dtype:
        """The dtype whose bytes actually cross the network."""
        return {"fp64": torch.float64, "fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[self.value]

    @property
    def buffer_dtype(self) -> torch.dtype:
        """Dtype of the averager's buffers (FP16 is cast on the wire by hivemind, so its buffers stay fp32)."""
        return torch.float32 if self is Codec.FP16 else self.wire_dtype

    @property
    def bytes_per_element(self) -> int:
        return torch.empty((), dtype=self.wire_dtype).element_size()

    @property
    def bit_identical(self) -> bool:
        """Whether replicas stay bit-identical in fp32 under hivemind's delta-returning all-reduce."""
        return self is Codec.FP64

    def hivemind_compression(self):
        """The ``compression=`` argument for ``hivemind.averaging.DecentralizedAverager``."""
        from hivemind.compression import Float16Compression, NoCompression

        return Float16Compression() if self is Codec.FP16 else NoCompression()


def encode(tensor: torch.Tensor, codec: Codec) -> torch.Tensor:
    """Cast to the codec's buffer dtype; FP16 and BF16 clamp to the finite range first (no inf on the wire)."""
    if codec is Codec.FP16:
        tensor = tensor.clamp(-FP16_MAX, FP16_MAX)
    elif codec is Codec.BF16:
        big = float(torch.finfo(torch.bfloat16).max)
        tensor = tensor.clamp(-big, big)
    return tensor.to(codec.buffer_dtype)


def decode(tensor: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return tensor.to(dtype)


def quantize(tensor: torch.Tensor, codec: Codec) -> torch.Tensor:
    """What ``tensor`` looks like after a trip through the wire (for simulations and error budgets)."""
    return encode(tensor, codec).to(codec.wire_dtype).to(tensor.dtype)


def wire_bytes(tensors: Sequence[torch.Tensor], codec: Codec) -> int:
    """Payload bytes one peer sends for ``tensors`` in one all-reduce direction (excluding framing)."""
    return sum(t.numel() for t in tensors) * codec.bytes_per_element


def cast_all(tensors: Sequence[torch.Tensor], codec: Codec) -> List[torch.Tensor]:
    return [encode(t, codec) for t in tensors]
