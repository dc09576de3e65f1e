"""Sparse asynchronous parameter averaging (SPARTA with the delta rule, METHODS §3).

Why: instead of an all-reduce of every gradient every step, replicas of a stage train locally and, every ``H``
steps, average a fixed 1/N slice (N = ceil(1/rho)) of their parameters and Adam moments in the background. A
round therefore moves ``3 * rho`` of the state (params + m + v) once per ``H`` steps, and never blocks training.

* **Partition.** Each tensor's elements are split into N balanced classes by a random permutation from a CPU
  generator seeded by (seed, tensor name): identical on every replica, independent of device RNG (node0's
  ``manual_seed(1337)`` + device ``rand`` was not). Round ``r`` averages class ``r mod N``, so N consecutive rounds
  cover every element exactly once. Moments reuse their parameter's partition.
* **Delta rule.** A round snapshots ``old = (theta, m, v)[S]`` at step ``s``, all-reduces it, and applies the
  average ``k`` steps later, keeping the local progress made meanwhile::

      theta[S] = avg_theta + (theta[S] - old_theta)
      m[S]     = beta1^k * avg_m + (m[S] - beta1^k * old_m)          (= m[S] + beta1^k (avg_m - old_m))
      v[S]     = max(0, beta2^k * avg_v + (v[S] - beta2^k * old_v))

  ``beta^k`` is how much the EMA has decayed the snapshot since. Written this way, ``k = 0`` with no local change
  yields exactly ``avg`` on every replica (no rounding residue), so replicas are bit-identical on ``S``.

Payload: one flat 1-d tensor of fixed length :meth:`SparseAverager.payload_numel` (each slice padded to
``ceil(numel / N)``), so a ``DecentralizedAverager`` can be built once with one buffer.

Integration (lead, a new background task next to ``ReplicaSync``; the per-step gradient all-reduce goes away for
stages that use it, each replica steps on its own gradients)::

    sparse = SparseAverager(list(stage.named_parameters()), node.optimizer, seed=manifest.run_id,
                            rho=0.05, every=20)                       # METHODS defaults: rho 0.05, H 20 (or 5)
    buffer = torch.zeros(sparse.payload_numel(), dtype=torch.float64)
    averager = DecentralizedAverager([buffer], dht, prefix=f"{run_id}_s{stage}_sparse", ...)
    # compute thread, right after optimizer.step() when sparse.due(node.step):
    snap = sparse.snapshot(node.step)
    # io: copy snap.payload into the averager buffer, averager.step(weight=samples since last round) in the
    # background; when it returns, on the compute thread (between two optimizer steps):
    sparse.apply(snap, averaged_buffer, node.step)                     # k = node.step - snap.step
    # a failed round: just drop ``snap``; that class is averaged again N rounds later.

``apply`` writes the parameters in place, which invalidates autograd graphs of microbatches in flight: call it
right after an ``optimizer.step()`` (same compute-thread task, before ``node.step`` is announced), so the node's
"recompute if the step changed" rule already covers those microbatches.

Start rounds only after the first optimizer step (moments must exist). Gradient clipping, lr schedule and
checkpointing are unaffected. The stage's parameters must be contiguous (they are for nn.Linear/Embedding).
Memory: a class-id map of 1 byte per parameter element (N <= 255); building it allocates a transient int64
permutation of the largest tensor.
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
        self._betas: Dict[int, Tuple[float, float]] = {}
        if optimizer is not None:
            for group in optimizer.param_groups:
                for p in group["params"]:
                    self._betas[id(p)] = tuple(group["betas"])

    @property
    def n_parts(self) -> int:
        return self.partition.n_parts

    def payload_numel(self) -> int:
        per = 3 if self.average_moments else 1
        return per * sum(self.partition.slot(name) for name, _ in self.named_params)

    def due(self, step: int) -> bool:
        """Whether a round starts after optimizer step ``step`` (every ``H`` steps, never at step 0)."""
        return step > 0 and step % self.every == 0

    def _tensors(self, p: torch.Tensor, name: str) -> List[torch.Tensor]:
        if not p.is_contiguous():
            raise ValueError(f"parameter {name} is not contiguous")
        out = [p.detach()]
        if self.average_moments:
            state = self.optimizer.state.get(p, {})  # type: ignore[union-attr]
            if "exp_avg" not in state or "exp_avg_sq" not in state:
                raise RuntimeError(f"parameter {name} has no Adam moments yet: start rounds after the first step")
            out += [state["exp_avg"], state["exp_avg_sq"]]
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
            beta1, beta2 = self._betas.get(id(p), (1.0, 1.0))
            for kind, t in enumerate(self._tensors(p, name)):
                decay = (1.0, beta1**k, beta2**k)[kind]
                old = snapshot.payload[offset: offset + idx.numel()]
                avg = averaged[offset: offset + idx.numel()]
                flat = t.view(-1)
                current = flat[idx].to(self.dtype)
                new = avg * decay + (current - old * decay)  # exact avg when k = 0 and nothing moved
                if kind == 2:
                    new.clamp_(min=0.0)
                flat[idx] = new.to(t.dtype)
                offset += slot
        return k
