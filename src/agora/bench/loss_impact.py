"""What an attacker costs the model, with and without SENTINEL: train two stages with one corrupting replica.

The offline evaluations count flags and bans; the question a run's owner asks is different: *does the model end
up as good as without the attacker?* Here the two stages of a two-stage preset (``tiny``) train for real on the
preset's corpus (``sotu``) with the manifest's optimizer, schedule and clipping, as stage nodes run them, each
step on one microbatch per replica seat; the last seat is an attacker that corrupts what it sends once the attack
starts (its forward activations for ``fwd``, the activation gradients it returns for ``bwd``). Every message of
the attacked direction reaches its receiver through a ``SentinelMonitor`` set up as a node's (``node_config``):

* with audits (a receiver next to the first or last stage): every flagged message and ``AUDIT_RATE`` of the
  others are recomputed by the other replicas, asked as a node asks them (``ask_auditors``); a replica may not
  answer (``ReplicaModel.absent``) and the attacker lies about honest messages. Replicas step in lockstep here,
  so an honest recomputation is the honest message itself;
* on statistics alone (``audits=False``: a middle stage's messages).

A flagged message is dropped and its microbatch retried on another replica, which computes the honest message (the
swarm's retry); a banned attacker gets no more work; an unflagged corrupted message is used: it reaches the
optimizer (``corrupt_used``), and that is the damage measured.

A defended run that used no corrupted message trains exactly as the clean run does (same data, same honest
messages): its validation loss *is* the clean run's, by construction. So the defended variants first ride along
the clean run, each with its own monitor, and only those that let a corrupted message through are trained again
on their own (``same_as_clean`` says which is which). ``defend=False`` uses every corrupted message.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field, replace
from typing import Iterator, Optional, Sequence

import torch
from torch import Tensor

from agora.bench.sentinel_audits import ReplicaModel, ask_auditors, falsified
from agora.config import Manifest, load_manifest
from agora.data import build_datasets
from agora.lab.attacks import AttackState, apply_attack
from agora.model import Stage
from agora.optim import build_optimizer, set_lr
from agora.sentinel import AUDIT_RATE, SentinelConfig, SentinelMonitor, node_config
from agora.wire import Boundary, decompress


@dataclass(frozen=True)
class AttackRunOptions:
    """How ``train_under_attack`` trains."""

    steps: int = 120  # optimizer steps
    senders: int = 3  # replica seats, one microbatch each per step; the last seat is the attacker's
    seed: int = 0  # weights, data order, the attack's noise, the audits' draws (shared by the variants compared)
    defend: bool = True  # False: no monitor, every corrupted message is used
    audits: bool = True  # the receiver audits (next to the first or last stage); False: statistics only
    attack_start: Optional[int] = None  # the first step the attacker corrupts in; None: a third of the way in
    val_batches: int = 4  # validation microbatches (the corpus' validation split)
    config: Optional[SentinelConfig] = None  # the monitor's settings (default: a node's, seeded by the manifest)
    # Replicas in lockstep (one version); a share of them does not answer an audit in time.
    replicas: ReplicaModel = field(default_factory=lambda: ReplicaModel(behind=0.0, ahead=0.0))


class _Defence:
    """One attacked variant: the attack's state and the receiver of the attacked direction, with what it did."""

    def __init__(self, m: Manifest, kind: Optional[str], strength: float, direction: str, opts: AttackRunOptions):
        self.kind, self.strength, self.direction, self.opts = kind, strength, direction, opts
        audited = ("fwd", "bwd") if opts.audits else ()
        self.monitor = (SentinelMonitor(node_config(opts.config or SentinelConfig(seed=m.seed), audited))
                        if opts.defend else None)
        self.audit_rng = random.Random(opts.seed + 2)
        self.names = [f"honest-{i}" for i in range(opts.senders - 1)] + ["attacker"]
        self.start = opts.steps // 3 if opts.attack_start is None else opts.attack_start
        self.rng, self.state = torch.Generator().manual_seed(opts.seed + 1), AttackState()
        self.corrupt_used = self.corrupt_dropped = self.honest_dropped = 0
        self.banned_at: Optional[int] = None
        self.diverged_at: Optional[int] = None  # the step it first used a corrupted message (riding along)

    def serving(self, slot: int) -> str:
        """Who serves seat ``slot``'s microbatch: a banned seat's work goes to an honest replica."""
        who = self.names[slot]
        if self.monitor is not None and self.monitor.banned(who):
            return self.names[slot % (self.opts.senders - 1)]
        return who

    def received(self, slot: int, step: int, msg: Tensor, tokens: Tensor, paired: Optional[Tensor]) -> Tensor:
        """What the receiver uses for seat ``slot``'s message ``msg`` (the honest one): the attacker's corruption
        unless it is dropped (then the retry on an honest replica computes ``msg``)."""
        who = self.serving(slot)
        attacker = who == "attacker" and self.kind is not None
        if attacker and step >= self.start:
            bad = apply_attack(self.kind, self.strength, msg, self.rng, self.state)
            if self._dropped(who, bad, step, tokens, paired, honest=msg):
                self.corrupt_dropped += 1
                return msg
            self.corrupt_used += 1
            return bad
        if attacker:
            self.state.remember(msg)  # replay and evade draw on what it sent while behaving
        if self._dropped(who, msg, step, tokens, paired, honest=msg):
            self.honest_dropped += 1  # retried on another replica, which computes the same message
        return msg

    def _dropped(self, who: str, msg: Tensor, step: int, tokens: Tensor, paired: Optional[Tensor],
                 honest: Tensor) -> bool:
        """True when the receiver drops ``msg``; audits it as a node does (``honest``: what replicas recompute)."""
        if self.monitor is None:
            return False
        version = [step, 0.0]  # replicas in lockstep: one version per step
        v = self.monitor.observe(who, 0, self.direction, msg, step=step, tokens=tokens, paired=paired,
                                 version=version)
        if self.opts.audits and (v.flagged or self.audit_rng.random() < AUDIT_RATE):
            def answer(auditor: str):
                if auditor == "attacker" and self.kind is not None and step >= self.start:
                    return auditor, falsified(honest, self.opts.seed, step, who), version  # it lies
                present = self.opts.replicas.present(self.opts.seed, step, self.names.index(auditor))
                return (auditor, honest.clone(), version) if present else None

            results = ask_auditors(self.monitor, who, msg, version, [(n, step) for n in self.names], 0, answer,
                                   self.audit_rng)
            if results:
                self.monitor.recomputed(who, 0, self.direction, msg, version, results, v.flagged)
        return v.flagged

    def bank_spares(self, spares: Sequence[Tensor]) -> None:
        """A stale attacker's own microbatches, computed and never sent, the step before it attacks."""
        if self.kind == "stale":
            for spare in spares[:int(self.strength)]:
                self.state.spare(spare)

    def report(self) -> dict:
        # In the clean run the attacker's seat is honest too.
        honest = self.names if self.kind is None else self.names[:-1]
        honest_banned = sum(self.monitor.banned(n) for n in honest) if self.monitor is not None else 0
        return {"kind": self.kind or "clean", "strength": self.strength, "direction": self.direction,
                "defended": self.opts.defend, "audits": self.opts.defend and self.opts.audits,
                "steps": self.opts.steps, "attacker_banned_at_step": self.banned_at,
                "corrupt_used": self.corrupt_used, "corrupt_dropped": self.corrupt_dropped,
                "honest_dropped": self.honest_dropped, "honest_banned": int(honest_banned)}


class _Training:
    """The two stages training on the trajectory of ``leader`` (None: the clean run), with ``riders`` screening
    the same messages on the side; a rider that would use a corrupted message leaves the trajectory."""

    def __init__(self, m: Manifest, opts: AttackRunOptions):
        self.m, self.opts = m, opts
        torch.manual_seed(opts.seed)
        self.head, self.tail = Stage(m, 0), Stage(m, 1)
        if not self.tail.spec.is_tail:
            raise ValueError("the loss-impact benchmark needs a two-stage manifest")
        self.optimizers = [build_optimizer(self.head, m.optimizer), build_optimizer(self.tail, m.optimizer)]
        train, val, _ = build_datasets(m)
        B = m.batch.microbatch_size
        # Disjoint data: the seats' training batches, and spare microbatches nobody sends (stale attackers').
        self.batches = train.shard(opts.seed, 0, 2).batches(opts.senders * B, opts.seed)
        self.spare_batches: Iterator[Tensor] = train.shard(opts.seed, 1, 2).batches(B, opts.seed + 1)
        self.val = val.fixed_batches(B, opts.val_batches)

    def run(self, leader: Optional[_Defence], riders: Sequence[_Defence] = ()) -> float:
        """Train ``opts.steps`` steps; returns the final validation loss."""
        m, opts, S = self.m, self.opts, self.opts.senders
        start = opts.steps // 3 if opts.attack_start is None else opts.attack_start
        for step in range(opts.steps):
            rows = next(self.batches)
            tokens, targets = rows[:, :-1], rows[:, 1:]
            tok = tokens.int()
            active = [d for d in ([leader] if leader else []) + list(riders) if d.diverged_at is None]
            if step == start - 1:
                self._bank_spares(active)
            coords = self.head(tokens) @ self.head.basis  # every seat's microbatch at once: sequences are independent
            sent = self._screen(active, leader, "fwd", step, coords.detach(), tok, None)
            leaf = sent.clone().requires_grad_(True)
            x = decompress(Boundary(leaf, tok, "subspace"), self.tail.basis, self.tail.frozen_embed)
            self.tail.loss(self.tail(x), targets).backward()  # the batch mean: what averaging makes of the seats'
            grad = leaf.grad * S  # per seat: what a tail returns for one microbatch's mean loss
            grad = self._screen(active, leader, "bwd", step, grad, tok, sent)
            coords.backward(grad / S)
            for d in active:
                if d.banned_at is None and d.monitor is not None and d.monitor.banned("attacker"):
                    d.banned_at = step
            for stage, opt in zip((self.head, self.tail), self.optimizers):
                torch.nn.utils.clip_grad_norm_(list(stage.parameters()), m.optimizer.grad_clip)
                set_lr(opt, m.optimizer, step)
                opt.step()
                opt.zero_grad(set_to_none=True)
        return self.validation_loss()

    def _screen(self, active: Sequence[_Defence], leader: Optional[_Defence], direction: str, step: int,
                msgs: Tensor, tok: Tensor, paired: Optional[Tensor]) -> Tensor:
        """Each seat's message through every active defence of ``direction``; the leader's choice is used."""
        B = self.m.batch.microbatch_size
        out = msgs.clone()
        for d in (d for d in active if d.direction == direction):
            for slot in range(self.opts.senders):
                part = slice(slot * B, (slot + 1) * B)
                used = d.received(slot, step, msgs[part], tok[part], None if paired is None else paired[part])
                if d is leader:
                    out[part] = used
                elif not torch.equal(used, msgs[part]):
                    d.diverged_at = step  # it let a corrupted message through: off the clean trajectory
                    break
        return out

    def _bank_spares(self, defences: Sequence[_Defence]) -> None:
        stale = [d for d in defences if d.kind == "stale"]
        if not stale:
            return
        need = max(int(d.strength) for d in stale)
        fwd, bwd = [], []
        for _ in range(need):
            rows = next(self.spare_batches)
            tokens, targets = rows[:, :-1], rows[:, 1:]
            with torch.enable_grad():
                coords = (self.head(tokens) @ self.head.basis).detach()
                leaf = coords.clone().requires_grad_(True)
                x = decompress(Boundary(leaf, tokens.int(), "subspace"), self.tail.basis, self.tail.frozen_embed)
                (grad,) = torch.autograd.grad(self.tail.loss(self.tail(x), targets), leaf)
            fwd.append(coords)
            bwd.append(grad * tokens.shape[0])  # a tail's reply: the gradient of the microbatch's B x mean loss
        for d in stale:
            d.bank_spares(fwd if d.direction == "fwd" else bwd)

    def validation_loss(self) -> float:
        with torch.no_grad():
            losses = []
            for rows in self.val:
                tok, tgt = rows[:, :-1], rows[:, 1:]
                coords = self.head(tok) @ self.head.basis
                x = decompress(Boundary(coords, tok.int(), "subspace"), self.tail.basis, self.tail.frozen_embed)
                losses.append(float(self.tail.loss(self.tail(x), tgt)))
        return sum(losses) / len(losses)


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
    defence = _Defence(m, kind, strength, direction, opts)
    val_loss = _Training(m, opts).run(defence)
    return dict(defence.report(), val_loss=val_loss, same_as_clean=False)


def loss_impact(manifest: "Manifest | str" = "tiny", strengths: Optional[dict] = None, steps: int = 120,
                seed: int = 0, directions: tuple = ("fwd", "bwd"), undefended: bool = True,
                settings: tuple[bool, ...] = (True, False)) -> dict:
    """The clean run, then per (kind, strength), direction and setting (``settings``: with audits, statistics
    only) the defended run, and the undefended one: final validation losses and their ratio to the clean run's.
    Default kinds: the evaluation's moderate strengths and the held-out kinds."""
    from agora.bench.sentinel_eval import EVAL_STRENGTHS

    m = load_manifest(manifest) if isinstance(manifest, str) else manifest
    strengths = strengths or {**{k: (v[1],) for k, v in EVAL_STRENGTHS.items()},
                              "rotate": (0.1,), "evade": (0.8,), "sub_tolerance": (0.9,)}
    attacks = [(k, s, d) for k, values in strengths.items() for s in values for d in directions]
    base = AttackRunOptions(steps=steps, seed=seed)
    clean_defence = _Defence(m, None, 0.0, "fwd", base)
    riders = [_Defence(m, k, s, d, replace(base, audits=audits)) for audits in settings for k, s, d in attacks]
    clean_loss = _Training(m, base).run(clean_defence, riders)
    clean = dict(clean_defence.report(), val_loss=clean_loss, same_as_clean=True)
    rows = []
    for rider in riders:
        if rider.diverged_at is None:
            row = dict(rider.report(), val_loss=clean_loss, same_as_clean=True)
        else:  # it let corruption through: train it on its own
            row = train_under_attack(m, rider.kind, rider.strength, rider.direction, rider.opts)
        row["ratio"] = row["val_loss"] / clean_loss
        rows.append(row)
    bare: dict = {}
    if undefended:
        for k, s, d in attacks:
            run = train_under_attack(m, k, s, d, base, defend=False)
            bare[(k, s, d)] = run["val_loss"], (run["val_loss"] / clean_loss if math.isfinite(run["val_loss"])
                                               else None)
    for row in rows:
        row["undefended_val_loss"], row["undefended_ratio"] = bare.get(
            (row["kind"], row["strength"], row["direction"]), (None, None))
    return {"steps": steps, "clean": clean, "rows": rows,
            "worst_ratio": {("audits" if a else "statistics only"):
                            max((r["ratio"] for r in rows if r["audits"] == a), default=None) for a in settings}}
