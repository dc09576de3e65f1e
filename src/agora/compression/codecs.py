"""Full all-reduce codecs: which dtype a dense gradient all-reduce puts on the wire.

Why a choice at all: ``agora.server.averaging.sync`` averages in float64 (8 bytes per element, twice fp32) because
hivemind's butterfly all-reduce returns each peer ``average - own_part`` (a *delta*, compressed like the input) and
applies ``local += delta``: only a return path more precise than fp32 makes ``float32(local + delta)`` bit-identical
on every replica. A cheaper wire dtype therefore costs bit-identity, not just precision:

* ``FP64``  8 B/elem. Bit-identical fp32 results (today's behaviour). Buffers float64, ``NoCompression``.
* ``FP32``  4 B/elem. Buffers float32, ``NoCompression``. Replicas end up to 1 ulp apart per round.
* ``FP16``  2 B/elem. Buffers float32/64 + ``hivemind.compression.Float16Compression`` (clamps to +-65504).
  The delta is rounded to fp16 too: replicas end up ~1e-3 relative apart per round.
* ``BF16``  2 B/elem. Buffers bfloat16, ``NoCompression``; same caveat, coarser (8-bit mantissa).

Integration (lead, ``ReplicaSync.__init__``)::

    codec = Codec(manifest.averaging.codec)                      # e.g. "fp64" (default) | "fp32" | "fp16" | "bf16"
    self.buffers = [torch.zeros_like(p, dtype=codec.buffer_dtype) for p in params]
    DecentralizedAverager(self.buffers, ..., compression=codec.hivemind_compression())

and in ``round``: ``b.copy_(encode(g, codec))`` (a plain ``copy_`` does the cast) and ``decode(b)`` before
``apply_step``. With any codec other than ``FP64`` the fingerprint repair in ``ReplicaSync._tick`` will see
"diverged" replicas after every round: either round-trip parameters through a canonical all-gather (every peer
receives the *same* averaged bytes, METHODS §4) or compare fingerprints with a tolerance. Until then FP64 is the
only codec that keeps replicas bit-identical; PowerSGD and sparse averaging (this package) cut far more bytes
and their small payloads can stay float64.
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
