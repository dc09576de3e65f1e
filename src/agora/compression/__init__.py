"""The math of the averaging schemes for the replicas of one stage: what crosses the network, and how much.

* :mod:`agora.compression.codecs`   -- dense all-reduce wire dtype (fp64 today / fp32 / fp16 / bf16) + casts.
* :mod:`agora.compression.powersgd` -- rank-r PowerSGD gradient averaging with error feedback, as steps that
  fit around two all-reduces (P, then Q); seeded Q so every replica starts from the same one.
* :mod:`agora.compression.sparse`   -- SPARTA: every H steps average a seeded 1/N slice of parameters and Adam
  moments in the background, applied with the delta rule and the beta^k moment correction (METHODS §3).
* :mod:`agora.compression.seeding`  -- communication-free shared randomness (BLAKE2b -> CPU generator).

Everything here is pure tensor code: no networking, no hivemind import at module load. The all-reduce is the
caller's (``agora.server.averaging``: ``PowerSGDSync``, ``SparseSync``); ``docs/COMPRESSION.md`` explains each
module. Bytes per replica per round, for a stage with ``E`` parameter elements:
dense fp64 ``8E`` (today), fp32 ``4E``, fp16 ``2E``; PowerSGD ``8 * PowerSGD.numel_sent()`` (float64 P/Q);
sparse ``8 * 3E/N`` once every H steps.
"""

from agora.compression.codecs import Codec, decode, encode, quantize, wire_bytes
from agora.compression.powersgd import PowerSGD, orthogonalize
from agora.compression.seeding import generator, stable_seed
from agora.compression.sparse import SparseAverager, SparsePartition, SparseSnapshot, parts_for_rho, partition_classes

__all__ = [
    "Codec", "encode", "decode", "quantize", "wire_bytes",
    "PowerSGD", "orthogonalize",
    "SparseAverager", "SparsePartition", "SparseSnapshot", "parts_for_rho", "partition_classes",
    "stable_seed", "generator",
]
