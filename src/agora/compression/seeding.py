"""Seeds that every replica derives identically, without communication.

Python's ``hash()`` is salted per process and ``torch.manual_seed`` touches global (and device) RNG state, so both
are unusable for "the same random object on every peer". We hash the parts with BLAKE2b and seed a private CPU
``torch.Generator``: identical on every machine, independent of CUDA and of any other RNG use.
"""

from __future__ import annotations

import hashlib

import torch

__all__ = ["stable_seed", "generator"]


def stable_seed(*parts: object) -> int:
    """A 63-bit seed from ``parts`` (converted with ``repr``, so ``1`` and ``"1"`` differ)."""
    digest = hashlib.blake2b("\x1f".join(repr(p) for p in parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def generator(*parts: object) -> torch.Generator:
    """A CPU generator seeded with ``stable_seed(*parts)``."""
    return torch.Generator(device="cpu").manual_seed(stable_seed(*parts))
