"""What an attacker costs the model, with and without SENTINEL: train two stages with one corrupting replica.

The offline evaluation (``agora.bench.sentinel_eval``) counts flags and bans; the question a run's owner asks is
different: *does the model end up as good as without the attacker?* Here the two stages around a boundary of a
preset train for real (the manifest's optimizer, schedule and clipping, as a stage node runs them), each step on
one microbatch per replica seat; the last seat is an attacker that corrupts what it sends once the attack starts
(its forward activations for ``fwd``, the activation gradients it returns for ``bwd``). Every message crosses the
boundary through a ``SentinelMonitor`` at its receiver, set up as a node's next to the first or last stage
(``node_config``: every flagged message and ``AUDIT_RATE`` of the others are audited, i.e. recomputed by honest
replicas):

* a flagged message is dropped and the receiver retries the microbatch on another replica of the sender's stage,
  which computes the honest message (replicas share the step's weights); that is what the swarm does;
* a banned attacker gets no more work: its seat's microbatches are served by honest replicas;
* an unflagged corrupted message is used: it reaches the optimizer, which is the damage being measured.

``defend=False`` is the same run without a monitor (every corrupted message used), and ``kind=None`` the clean
run. The three share the data order and initial weights (same seed), so their validation losses at equal tokens
compare directly.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, replace
from typing import NamedTuple, Optional

import torch
from torch import Tensor

from agora.config import Manifest, load_manifest
from agora.optim import build_optimizer, set_lr
from agora.lab.attacks import AttackState, apply_attack
from agora.bench.sentinel_eval import _two_stages, simulated_audit, synthetic_batch
from agora.sentinel import AUDIT_RATE, SentinelConfig, SentinelMonitor, node_config
from agora.wire import Boundary, decompress


@dataclass(frozen=True)
class AttackRunOptions:
    """How ``train_under_attack`` trains."""

    steps: int = 120  # optimizer steps
    senders: int = 3  # replica seats, one microbatch each per step; the last seat is the attacker's
    seed: int = 0  # weights, data order, the attack's noise, the audits' draws (shared by the variants compared)
    defend: bool = True  # False: no monitor, every corrupted message is used
    attack_start: Optional[int] = None  # the first step the attacker corrupts in; None: a third of the way in
    val_batches: int = 4  # validation microbatches, drawn from their own stream before training
    config: Optional[SentinelConfig] = None  # the monitor's settings (default: a node's, seeded by the manifest)


class _Seat(NamedTuple):
    """Who serves one seat's microbatch this step, and whether it corrupts it."""

    who: str
    attacker: bool  # the attacker serves it (in an attacked run)
    attacking: bool  # ... and the attack has started


class _AttackedTraining:
    """Two stages training with one attacking seat; the receiver of the attacked direction screens every message."""

    def __init__(self, m: Manifest, kind: Optional[str], strength: float, direction: str, opts: AttackRunOptions):
        self.m, self.kind, self.strength, self.direction, self.opts = m, kind, strength, direction, opts
        self.head, self.tail, self.gen, self.probs, self.table = _two_stages(m, 0, opts.seed, "train_under_attack")
        V, T, B = m.model.vocab_size, m.model.seq_len, m.batch.microbatch_size
        # Validation data from its own stream, drawn before training so every variant sees the same batches.
        val_gen = torch.Generator().manual_seed(opts.seed + 10_007)
        self.val = [synthetic_batch(val_gen, V, B, T, self.table, self.probs) for _ in range(opts.val_batches)]
        self.optimizers = [build_optimizer(self.head, m.optimizer), build_optimizer(self.tail, m.optimizer)]
        self.monitor = (SentinelMonitor(node_config(opts.config or SentinelConfig(seed=m.seed))) if opts.defend
                        else None)
        self.audit_rng = random.Random(opts.seed + 2)
        self.names = [f"honest-{i}" for i in range(opts.senders - 1)] + ["attacker"]
        self.start = opts.steps // 3 if opts.attack_start is None else opts.attack_start
        self.rng, self.state = torch.Generator().manual_seed(opts.seed + 1), AttackState()
        self.corrupt_used = self.corrupt_dropped = self.honest_dropped = 0
        self.banned_at: Optional[int] = None

    def train(self) -> None:
        m, opts = self.m, self.opts
        V, T, B = m.model.vocab_size, m.model.seq_len, m.batch.microbatch_size
        for step in range(opts.steps):
            tokens, targets = synthetic_batch(self.gen, V, opts.senders * B, T, self.table, self.probs)
            for slot, who in enumerate(self.names):
                if self.monitor is not None and self.monitor.banned(who):
                    who = self.names[slot % (opts.senders - 1)]  # a banned seat's work goes to an honest replica
                attacker = who == "attacker" and self.kind is not None
                seat = _Seat(who, attacker, attacker and step >= self.start)
                self._microbatch(seat, step, tokens[slot * B:(slot + 1) * B], targets[slot * B:(slot + 1) * B])
            if self.monitor is not None and self.banned_at is None and self.monitor.banned("attacker"):
                self.banned_at = step
            for stage, opt in zip((self.head, self.tail), self.optimizers):
                torch.nn.utils.clip_grad_norm_(list(stage.parameters()), m.optimizer.grad_clip)
                set_lr(opt, m.optimizer, step)
                opt.step()
                opt.zero_grad(set_to_none=True)

    def _microbatch(self, seat: _Seat, step: int, tok: Tensor, tgt: Tensor) -> None:
        """Forward and backward of one seat's microbatch, the attacked direction through the receiver."""
        senders = self.opts.senders
        coords = self.head(tok) @ self.head.basis
        sent = coords.detach()
        if self.direction == "fwd":
            sent = self._received(seat, sent, step, tok.int())
        leaf = sent.clone().requires_grad_(True)
        x = decompress(Boundary(leaf, tok.int(), "subspace"), self.tail.basis, self.tail.frozen_embed)
        # Each microbatch's mean loss / senders: the step's gradient is the batch mean, as averaging makes it.
        (self.tail.loss(self.tail(x), tgt) / senders).backward()
        grad = leaf.grad * senders  # what a tail returns for one microbatch's mean loss
        if self.direction == "bwd":
            grad = self._received(seat, grad, step, tok.int(), paired=sent)
        coords.backward(grad / senders)

    def _received(self, seat: _Seat, msg: Tensor, step: int, tokens: Tensor, paired: Optional[Tensor] = None
                  ) -> Tensor:
        """What the receiver uses of ``msg``, the honest message of ``seat``: the attacker's corruption unless it
        is dropped (the microbatch is then retried on an honest replica, which computes ``msg``)."""
        if seat.attacking:
            bad = apply_attack(self.kind, self.strength, msg, self.rng, self.state)
            if self._dropped(seat.who, bad, step, tokens, paired, honest=msg):
                self.corrupt_dropped += 1
                return msg
            self.corrupt_used += 1
            return bad
        if seat.attacker:
            self.state.remember(msg)  # replay and stale attacks draw on what it sent while behaving
        if self._dropped(seat.who, msg, step, tokens, paired, honest=msg):
            self.honest_dropped += 1  # retried on another replica, which computes the same message
        return msg

    def _dropped(self, who: str, msg: Tensor, step: int, tokens: Tensor, paired: Optional[Tensor],
                 honest: Tensor) -> bool:
        """True when the receiver drops ``msg`` (and retries the microbatch elsewhere). ``honest``: what another
        replica recomputes when the message is audited."""
        if self.monitor is None:
            return False
        version = (step, 0.0)
        v = self.monitor.observe(who, 0, self.direction, msg, step=step, tokens=tokens, paired=paired,
                                 version=version)
        if v.flagged or self.audit_rng.random() < AUDIT_RATE:
            simulated_audit(self.monitor, who, self.direction, msg, honest, version)
        return v.flagged

    def validation_loss(self) -> float:
        with torch.no_grad():
            losses = []
            for tok, tgt in self.val:
                coords = self.head(tok) @ self.head.basis
                x = decompress(Boundary(coords, tok.int(), "subspace"), self.tail.basis, self.tail.frozen_embed)
                losses.append(float(self.tail.loss(self.tail(x), tgt)))
        return sum(losses) / len(losses)

    def report(self) -> dict:
        # In the clean run the attacker's seat is honest too.
        honest = self.names if self.kind is None else self.names[:-1]
        honest_banned = sum(self.monitor.banned(n) for n in honest) if self.monitor is not None else 0
        return {"kind": self.kind or "clean", "strength": self.strength, "direction": self.direction,
                "defended": self.opts.defend, "steps": self.opts.steps, "val_loss": self.validation_loss(),
                "attacker_banned_at_step": self.banned_at, "corrupt_used": self.corrupt_used,
                "corrupt_dropped": self.corrupt_dropped, "honest_dropped": self.honest_dropped,
                "honest_banned": int(honest_banned)}


def train_under_attack(manifest: "Manifest | str" = "tiny", kind: Optional[str] = None, strength: float = 0.0,
                       direction: str = "fwd", options: Optional[AttackRunOptions] = None, **overrides) -> dict:
    """Train ``steps`` optimizer steps of ``senders`` microbatches each; the last seat attacks with ``kind`` at
    ``strength`` (``apply_attack``; None: the clean run) in ``direction`` from ``attack_start``. ``options``: see
    ``AttackRunOptions``; keyword ``overrides`` replace its fields. Returns the final validation loss and what the
    monitor did."""
    if direction not in ("fwd", "bwd"):
        raise ValueError(f"direction must be 'fwd' or 'bwd', got {direction!r}")
    opts = replace(options or AttackRunOptions(), **overrides)
    m = load_manifest(manifest) if isinstance(manifest, str) else manifest
    run = _AttackedTraining(m, kind, strength, direction, opts)
    run.train()
    return run.report()


def loss_impact(manifest: "Manifest | str" = "tiny", strengths: Optional[dict] = None, steps: int = 120,
                seed: int = 0, directions: tuple = ("fwd", "bwd"), undefended: bool = True) -> dict:
    """The clean run, then per (kind, strength) and direction the defended run (and the undefended one): final
    validation losses and their ratio to the clean run's."""
    from agora.bench.sentinel_eval import EVAL_STRENGTHS

    strengths = strengths or {k: (v[1],) for k, v in EVAL_STRENGTHS.items()}
    clean = train_under_attack(manifest, None, steps=steps, seed=seed, direction="fwd")
    rows = []
    for kind, values in strengths.items():
        for strength in values:
            for direction in directions:
                row = train_under_attack(manifest, kind, strength, direction, steps=steps, seed=seed)
                row["ratio"] = row["val_loss"] / clean["val_loss"]
                if undefended:
                    bare = train_under_attack(manifest, kind, strength, direction, steps=steps, seed=seed,
                                              defend=False)
                    row["undefended_val_loss"] = bare["val_loss"]
                    row["undefended_ratio"] = (bare["val_loss"] / clean["val_loss"]
                                               if math.isfinite(bare["val_loss"]) else None)
                rows.append(row)
    return {"steps": steps, "clean": clean, "rows": rows,
            "worst_ratio": max((r["ratio"] for r in rows), default=None)}
