"""Sparse asynchronous parameter averaging (SPARTA with the delta rule, METHODS §3).

Why: instead of an all-reduce of every gradient every step, replicas of a stage train locally and, every ``H``
steps, average a seeded 1/N slice (N = ceil(1/rho)) of their parameters and Adam moments in the background:
``3 * rho`` of the state once per ``H`` steps, never blocking training. The partition is identical on every replica
without communication, N consecutive rounds cover every element once, and the delta rule applies an average ``k``
steps after its snapshot while keeping the local progress made meanwhile (moments corrected by ``beta^k``).

``agora.server.averaging.sparse`` runs it. The partition, the delta rule's formulas, the payload layout, how to
call ``snapshot`` / ``apply`` and the constraints (when ``apply`` may run, memory): docs/COMPRESSION.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from agora.compression.seeding import generator

__all__ = ["partition_classes", "SparsePartition", "SparseSnapshot", "SparseAverager", "parts_for_rho"]


def parts_for_rho(rho: float) -> int:
    """N = ceil(1/rho), robust to float noise (``1/0.05`` is 20.000000000000004)."""
    if not 0 < rho <= 1:
        raise ValueError(f"rho must be in (0, 1], got {rho}")
    return max(1, math.ceil(1.0 / rho - 1e-9))


def partition_classes(numel: int, n_parts: int, *seed: object) -> torch.Tensor:
    """Class id (0..n_parts-1) of every element: a seeded permutation, so class sizes differ by at most one."""
    dtype = torch.uint8 if n_parts <= 256 else torch.int32
    perm = torch.randperm(numel, generator=generator("sparta", *seed))
    ids = torch.empty(numel, dtype=dtype)
    ids[perm] = (torch.arange(numel) % n_parts).to(dtype)
    return ids


class SparsePartition:
    """The seeded partition of a set of named tensors; identical for every replica that uses the same seed."""

    def __init__(self, named_shapes: Sequence[Tuple[str, Sequence[int]]], n_parts: int, seed: object,
                 device: Optional[torch.device] = None):
        if n_parts < 1:
            raise ValueError(f"n_parts must be >= 1, got {n_parts}")
        self.n_parts = n_parts
        self.names = [name for name, _ in named_shapes]
        if len(set(self.names)) != len(self.names):
            raise ValueError("tensor names must be unique: they seed the partition")
        self.numel = {name: math.prod(shape) for name, shape in named_shapes}
        self.class_ids: Dict[str, torch.Tensor] = {
            name: partition_classes(self.numel[name], n_parts, seed, name).to(device) for name in self.names
        }

    def part_of_round(self, round_index: int) -> int:
        return round_index % self.n_parts

    def indices(self, name: str, part: int) -> torch.Tensor:
        """Sorted flat indices of ``name``'s elements in class ``part``."""
        return torch.nonzero(self.class_ids[name] == part).squeeze(1)

    def slot(self, name: str) -> int:
        """Padded slice length: the largest class size of ``name``."""
        return -(-self.numel[name] // self.n_parts)


@dataclass
class SparseSnapshot:
    """One round in flight: what was sent (``payload``, kept private) and where it came from."""

    round_index: int
    step: int
    part: int
    indices: List[torch.Tensor]
    payload: torch.Tensor  # the values sent; do not hand this very tensor to an averager that writes in place


class SparseAverager:
    """SPARTA rounds over a module's parameters and (optionally) their Adam moments.

    :param named_params: ``module.named_parameters()`` as a list; names seed the partition
    :param optimizer: the optimizer holding ``exp_avg``/``exp_avg_sq`` (AdamW, DelayedNAdam); None = params only
    :param seed: shared by every replica of the stage (e.g. the run id)
    :param rho: fraction of each tensor per round (N = ceil(1/rho) classes)
    :param every: H, optimizer steps between rounds
    :param average_moments: also average m and v (Agora does, node0 did not)
    :param dtype: payload dtype (float64 keeps hivemind's delta-returning all-reduce bit-identical, see codecs)
    """

    def __init__(
        self,
        named_params: Sequence[Tuple[str, torch.Tensor]],
        optimizer: Optional[torch.optim.Optimizer] = None,
        *,
        seed: object,
        rho: float = 0.05,
        every: int = 20,
        average_moments: bool = True,
        dtype: torch.dtype = torch.float64,
    ):
        if every < 1:
            raise ValueError(f"every must be >= 1, got {every}")
        self.named_params = list(named_params)
        self.optimizer = optimizer
        self.every = every
        self.average_moments = average_moments and optimizer is not None
        self.dtype = dtype
        self.device = self.named_params[0][1].device if self.named_params else None
        self.partition = SparsePartition([(n, p.shape) for n, p in self.named_params], parts_for_rho(rho), seed,
                                         self.device)
        # Per parameter: the optimizer state averaged with it and the decay rate of each (for the delta rule).
        # Adam-style groups keep two moments; Muon's matrix groups (``kind: matrix``) keep one momentum buffer.
        self._moments: Dict[int, Tuple[Tuple[str, float], ...]] = {}
        if optimizer is not None:
            for group in optimizer.param_groups:
                for p in group["params"]:
                    if group.get("kind") == "matrix":
                        self._moments[id(p)] = (("momentum_buffer", float(group["momentum"])),)
                    else:
                        beta1, beta2 = group["betas"]
                        self._moments[id(p)] = (("exp_avg", float(beta1)), ("exp_avg_sq", float(beta2)))

    @property
    def n_parts(self) -> int:
        return self.partition.n_parts

    def payload_numel(self) -> int:
        return sum(self.partition.slot(name) * (1 + len(self._moments_of(p))) for name, p in self.named_params)

    def _moments_of(self, p: torch.Tensor) -> Tuple[Tuple[str, float], ...]:
        if not self.average_moments:
            return ()
        return self._moments.get(id(p), (("exp_avg", 1.0), ("exp_avg_sq", 1.0)))

    def due(self, step: int) -> bool:
        """Whether a round starts after optimizer step ``step`` (every ``H`` steps, never at step 0)."""
        return step > 0 and step % self.every == 0

    def _tensors(self, p: torch.Tensor, name: str) -> List[torch.Tensor]:
        if not p.is_contiguous():
            raise ValueError(f"parameter {name} is not contiguous")
        out = [p.detach()]
        moments = self._moments_of(p)
        if moments:
            state = self.optimizer.state.get(p, {})  # type: ignore[union-attr]
            missing = [key for key, _ in moments if key not in state]
            if missing:
                raise RuntimeError(f"parameter {name} has no {'/'.join(missing)} yet: start rounds after the first "
                                   f"step")
            out += [state[key] for key, _ in moments]
        return out

    @torch.no_grad()
    def snapshot(self, step: int) -> SparseSnapshot:
        """Gather this round's slice of every tensor into a fresh flat payload."""
        round_index = step // self.every
        part = self.partition.part_of_round(round_index)
        payload = torch.zeros(self.payload_numel(), dtype=self.dtype, device=self.device)
        indices, offset = [], 0
        for name, p in self.named_params:
            idx = self.partition.indices(name, part)
            slot = self.partition.slot(name)
            for t in self._tensors(p, name):
                payload[offset: offset + idx.numel()] = t.reshape(-1)[idx].to(self.dtype)
                offset += slot
            indices.append(idx)
        return SparseSnapshot(round_index, step, part, indices, payload)

    @torch.no_grad()
    def apply(self, snapshot: SparseSnapshot, averaged: torch.Tensor, step: int) -> int:
        """Apply the delta rule with ``k = step - snapshot.step`` and return k.

        :param averaged: the all-reduced payload (same layout as ``snapshot.payload``)
        """
        if averaged.shape != snapshot.payload.shape:
            raise ValueError(f"averaged payload has shape {tuple(averaged.shape)}, expected "
                             f"{tuple(snapshot.payload.shape)}")
        k = step - snapshot.step
        if k < 0:
            raise ValueError(f"cannot apply a round snapshotted at step {snapshot.step} at earlier step {step}")
        averaged = averaged.to(self.dtype)
        offset = 0
        for (name, p), idx in zip(self.named_params, snapshot.indices):
            slot = self.partition.slot(name)
            keys = [("param", 1.0)] + list(self._moments_of(p))
            for (key, beta), t in zip(keys, self._tensors(p, name)):
                decay = beta**k
                old = snapshot.payload[offset: offset + idx.numel()]
                avg = averaged[offset: offset + idx.numel()]
                flat = t.view(-1)
                current = flat[idx].to(self.dtype)
                new = avg * decay + (current - old * decay)  # exact avg when k = 0 and nothing moved
                if key == "exp_avg_sq":
                    new.clamp_(min=0.0)
                flat[idx] = new.to(t.dtype)
                offset += slot
        return k
