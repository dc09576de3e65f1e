"""SENTINEL's design-set harness: the tests' streams of ``tiny`` traffic on synthetic text.

The benchmark (``agora bench sentinel``) does not use this module's streams: their audits are an oracle (every
audit gets two present, honest recomputations at the sender's version, i.e. the exact honest message) and the
attack kinds are the ones the detector has features for. ``agora.bench.sentinel_audits`` evaluates without an
oracle, on real training traffic of ``small``, with held-out attacks.

Honest traffic is exact, not simulated: the preset's head and tail ``Stage`` run forward and backward on token
batches of a synthetic language (Zipf unigrams mixed with a sparse random bigram table, closer to text than
uniform tokens), and we keep, per *sequence*, the boundary coordinates [T, k] and the gradient of the microbatch's
mean loss with respect to them. Sequences do not interact in a decoder, so any 8 pool sequences stacked together
are exactly the messages that microbatch would produce: a pool of a few hundred sequences yields unlimited,
distinct, honest microbatches for a few seconds of compute.

A stream interleaves three senders serving the same stage (two honest replicas, one attacker; each draws from its
own disjoint share of the pool, i.e. its own data), in random order each round, into one ``SentinelMonitor`` as the
receiver would see them: ``fwd`` = boundary coordinates arriving at the next stage, ``bwd`` = gradients arriving
back (with ``paired`` = the coordinates the receiver had sent). The attacker behaves until ``attack_start`` rounds
have passed, then corrupts every message with ``apply_attack``; once banned it is routed no more work.

Reported per attack kind and strength: message-level precision / recall / F1 of flags, whether the attacker was
banned and after how many corrupted messages (detection delay), honest senders banned, and the honest flag rate;
plus a clean stream's false-positive rate.
"""

from __future__ import annotations

import random
import time
from dataclasses import asdict, dataclass, replace
from typing import Optional, Sequence

import torch
from torch import Tensor

from agora.config import Manifest, load_manifest
from agora.model import Stage
from agora.lab.attacks import AttackState, apply_attack
from agora.sentinel import AUDIT_RATE, SentinelConfig, SentinelMonitor, node_config
from agora.wire import Boundary, decompress

# (weak, moderate) strengths per kind; the tests use the moderate ones.
EVAL_STRENGTHS: dict[str, tuple[float, float]] = {
    "gaussian": (0.25, 1.0),
    "sign_flip": (0.5, 1.0),
    "scale": (1.3, 4.0),
    "zero": (0.1, 1.0),
    "bias": (0.2, 0.5),
    "replay": (4.0, 1.0),
    "stale": (1.0, 4.0),
    "nan": (0.001, 1.0),
}


@dataclass
class HonestPool:
    """Per-sequence boundary traffic of one model: ``fwd``/``bwd`` [S, T, k], ``tokens`` [S, T] int32."""

    fwd: Tensor
    bwd: Tensor
    tokens: Tensor
    microbatch: int
    loss: float  # mean training loss of the pool's batches (how trained the model is)


def synthetic_batch(gen: torch.Generator, vocab: int, batch: int, seq_len: int,
                    table: Tensor, probs: Tensor) -> tuple[Tensor, Tensor]:
    """(tokens, next tokens), each [batch, seq_len]: 70 % bigram successor, 30 % Zipf unigram draw."""
    tok = torch.empty(batch, seq_len + 1, dtype=torch.long)
    tok[:, 0] = torch.multinomial(probs, batch, replacement=True, generator=gen)
    for i in range(1, seq_len + 1):
        succ = table[tok[:, i - 1], torch.randint(0, table.shape[1], (batch,), generator=gen)]
        uni = torch.multinomial(probs, batch, replacement=True, generator=gen)
        tok[:, i] = torch.where(torch.rand(batch, generator=gen) < 0.7, succ, uni)
    return tok[:, :-1], tok[:, 1:]


def _two_stages(m: Manifest, boundary: int, seed: int, caller: str):
    """The head and tail stages around ``boundary`` (seeded), plus the synthetic text's generator, Zipf token
    probabilities and bigram table, in the order both recorders draw them (so a seed gives the same data)."""
    torch.manual_seed(seed)
    head, tail = Stage(m, boundary), Stage(m, boundary + 1)
    if not (head.spec.is_head and tail.spec.is_tail):
        raise ValueError(f"{caller} needs a two-stage manifest (head and tail around the boundary)")
    gen = torch.Generator().manual_seed(seed)
    V = m.model.vocab_size
    probs = 1.0 / torch.arange(1, V + 1, dtype=torch.float64) ** 1.1
    table = torch.randint(0, V, (V, 4), generator=gen)
    return head, tail, gen, probs, table


def make_pool(manifest: "Manifest | str" = "tiny", n_sequences: int = 240, seed: int = 0,
              train_steps: int = 0, boundary: int = 0) -> HonestPool:
    """Run stage ``boundary`` and ``boundary + 1`` of the preset (stages in between are not supported: the pool is
    for two-stage boundary traffic) and collect per-sequence messages. ``train_steps`` of Adam first make the
    model less trivial (trained statistics are more structured, which helps odd features such as sign flips)."""
    m = load_manifest(manifest) if isinstance(manifest, str) else manifest
    if m.residual.mode != "subspace":
        raise ValueError("the offline SENTINEL evaluation expects a subspace-mode manifest")
    head, tail, gen, probs, table = _two_stages(m, boundary, seed, "make_pool")
    V, T, B = m.model.vocab_size, m.model.seq_len, m.batch.microbatch_size

    def run(tokens: Tensor, targets: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        out = head(tokens)
        coords = out @ head.basis
        leaf = coords.detach().clone().requires_grad_(True)
        x = decompress(Boundary(leaf, tokens.int(), "subspace"), tail.basis, tail.frozen_embed)
        loss = tail.loss(tail(x), targets)
        loss.backward()
        return coords, leaf.grad, loss, out

    if train_steps:
        opt = torch.optim.Adam([*head.parameters(), *tail.parameters()], lr=m.optimizer.lr)
        for _ in range(train_steps):
            coords, grad, _, _ = run(*synthetic_batch(gen, V, B, T, table, probs))
            coords.backward(grad)
            opt.step()
            opt.zero_grad()
    fwd, bwd, toks, losses = [], [], [], []
    for _ in range((n_sequences + B - 1) // B):
        tokens, targets = synthetic_batch(gen, V, B, T, table, probs)
        coords, grad, loss, _ = run(tokens, targets)
        head.zero_grad(set_to_none=True)
        tail.zero_grad(set_to_none=True)
        fwd.append(coords.detach())
        bwd.append(grad.detach().clone())
        toks.append(tokens.int())
        losses.append(float(loss.detach()))
    return HonestPool(torch.cat(fwd)[:n_sequences], torch.cat(bwd)[:n_sequences], torch.cat(toks)[:n_sequences],
                      B, sum(losses) / len(losses))


@dataclass
class DriftTrace:
    """Honest traffic of a model *while it trains*: per optimizer step, one microbatch message per sender.

    ``fwd``/``bwd`` are [steps, senders, B, T, k], ``tokens`` [steps, senders, B, T], ``losses`` [steps]. Every
    sender of a step shares that step's weights (replicas average) but draws its own data, exactly like honest
    replicas of one stage; across steps the statistics drift as the model learns, which is what a live monitor has
    to tolerate (a static pool cannot show it).
    """

    fwd: Tensor
    bwd: Tensor
    tokens: Tensor
    losses: list

    @property
    def steps(self) -> int:
        return self.fwd.shape[0]


def make_drift_trace(manifest: "Manifest | str" = "tiny", steps: int = 240, senders: int = 3, seed: int = 0,
                     boundary: int = 0) -> DriftTrace:
    """Train the two stages around ``boundary`` for ``steps`` optimizer steps with the manifest's optimizer and
    schedule (``build_optimizer``, ``lr_at``, per-stage gradient clipping, as a stage node does) on a batch of
    ``senders`` microbatches per step, and record every microbatch's boundary coordinates and coordinate gradient
    *before* that step's update. The gradient is scaled to what a tail computing the mean loss of one microbatch
    returns (the whole batch's mean loss divides it by ``senders``)."""
    from agora.optim import build_optimizer, set_lr

    m = load_manifest(manifest) if isinstance(manifest, str) else manifest
    head, tail, gen, probs, table = _two_stages(m, boundary, seed, "make_drift_trace")
    V, T, B = m.model.vocab_size, m.model.seq_len, m.batch.microbatch_size
    opts = [build_optimizer(head, m.optimizer), build_optimizer(tail, m.optimizer)]
    fwd, bwd, toks, losses = [], [], [], []
    for step in range(steps):
        tokens, targets = synthetic_batch(gen, V, senders * B, T, table, probs)
        coords = head(tokens) @ head.basis
        leaf = coords.detach().clone().requires_grad_(True)
        x = decompress(Boundary(leaf, tokens.int(), "subspace"), tail.basis, tail.frozen_embed)
        loss = tail.loss(tail(x), targets)
        loss.backward()
        coords.backward(leaf.grad)
        for stage, opt in zip((head, tail), opts):
            torch.nn.utils.clip_grad_norm_(list(stage.parameters()), m.optimizer.grad_clip)
            set_lr(opt, m.optimizer, step)
            opt.step()
            opt.zero_grad(set_to_none=True)
        fwd.append(coords.detach().reshape(senders, B, T, -1))
        bwd.append((leaf.grad * senders).reshape(senders, B, T, -1))
        toks.append(tokens.int().reshape(senders, B, T))
        losses.append(float(loss.detach()))
    return DriftTrace(torch.stack(fwd), torch.stack(bwd), torch.stack(toks), losses)


@dataclass
class StreamResult:
    kind: str
    strength: float
    direction: str
    attacker_banned: bool
    delay: Optional[int]  # corrupted attacker messages up to and including the one that got it banned
    honest_banned: int
    tp: int
    fp: int
    fn: int
    tn: int
    honest_flag_rate: float
    first_reasons: list

    @property
    def precision(self) -> float:
        return self.tp / (self.tp + self.fp) if self.tp + self.fp else 1.0

    @property
    def recall(self) -> float:
        return self.tp / (self.tp + self.fn) if self.tp + self.fn else 1.0

    @property
    def f1(self) -> float:
        p, r = self.precision, self.recall
        return 2 * p * r / (p + r) if p + r else 0.0


def simulated_audit(monitor: SentinelMonitor, sender: str, direction: str, msg: Tensor, honest: Tensor,
                    version: tuple) -> None:
    """An oracle audit: two honest replicas holding the sender's weights always answer with the exact honest
    message (one recomputes, a second one too when the first disagrees). For the design-set tests only."""
    again = [("auditor-1", honest, version)]
    if not monitor.same_message(msg, honest):
        again.append(("auditor-2", honest.clone(), version))
    monitor.recomputed(sender, 0, direction, msg, version, again)


class _StreamTally:
    """What one evaluated stream counts, message by message: corrupt messages sent, flags on corrupt (tp/fn) and
    clean (fp/tn) ones, the attacker's detection delay, honest flag rate, the first reasons given."""

    def __init__(self, monitor: SentinelMonitor, kind: Optional[str], direction: str, strength: float = 0.0,
                 seed: int = 0, clean_reasons: bool = False, audit_rate: float = AUDIT_RATE):
        self.monitor, self.kind, self.direction, self.clean_reasons = monitor, kind, direction, clean_reasons
        self.strength = strength
        self.gen = torch.Generator().manual_seed(seed)
        self.audit_rate, self.audit_rng = audit_rate, random.Random(seed + 7)
        self.audits = 0
        self.honest: Optional[Tensor] = None  # the honest content of the message being sent (what a replica recomputes)
        self.state = AttackState()
        self.tp = self.fp = self.fn = self.tn = 0
        self.honest_flags = self.honest_msgs = 0
        self.delay: Optional[int] = None
        self.corrupted = 0
        self.first_reasons: list = []

    def outgoing(self, who: str, msg: Tensor, attacking: bool) -> tuple[Tensor, bool]:
        """(what ``who`` sends, whether it is corrupted): the attacker corrupts ``msg`` once ``attacking``; before,
        it remembers it (replay and stale attacks draw on what it sent while behaving)."""
        self.honest = msg
        if who != "attacker" or self.kind is None:
            return msg, False
        if attacking:
            return apply_attack(self.kind, self.strength, msg, self.gen, self.state), True
        self.state.remember(msg)
        return msg, False

    def send(self, who: str, msg: Tensor, bad: bool, step: int, tokens: Tensor, coords: Tensor) -> None:
        """``who`` sends ``msg`` (``bad``: corrupted by the attack) and the monitor judges it."""
        self.corrupted += bad
        # Every sender of a round/step holds that step's weights (replicas average), so all claim one version.
        v = self.monitor.observe(who, 0, self.direction, msg, step=step, tokens=tokens,
                                 paired=coords if self.direction == "bwd" else None, version=(step, 0.0))
        if self.audit_rate and (v.flagged or self.audit_rng.random() < self.audit_rate):
            # As a node next to the first or last stage does (``Screening.start_audit``): another replica with the
            # same weights recomputes every flagged message and ``audit_rate`` of the accepted ones.
            self.audits += 1
            simulated_audit(self.monitor, who, self.direction, msg, self.honest, (step, 0.0))
        if self.delay is None and self.corrupted and self.monitor.banned("attacker"):
            self.delay = self.corrupted  # possibly banned while re-scoring warm-up, on another sender's message
        if bad:
            self.tp += v.flagged
            self.fn += not v.flagged
            if v.flagged and not self.first_reasons:
                self.first_reasons = v.reasons[:3]
            return
        self.fp += v.flagged
        self.tn += not v.flagged
        if who != "attacker":
            self.honest_msgs += 1
            self.honest_flags += v.flagged
            if self.clean_reasons and v.flagged and self.kind is None and not self.first_reasons:
                self.first_reasons = v.reasons[:3]

    def result(self, strength: float, senders: Sequence[str]) -> "StreamResult":
        # In a clean stream the attacker's seat is honest too: its ban is a false one.
        honest_banned = sum(self.monitor.banned(s) for s in senders if s != "attacker" or self.kind is None)
        return StreamResult(self.kind or "clean", strength, self.direction,
                            self.monitor.banned("attacker") if self.kind else False, self.delay, honest_banned,
                            self.tp, self.fp, self.fn, self.tn, self.honest_flags / max(self.honest_msgs, 1),
                            self.first_reasons)


def _receiver(config: Optional[SentinelConfig], audit_rate: float) -> SentinelMonitor:
    """A fresh monitor set up as a node's: auditing both directions when ``audit_rate`` > 0 (next to the first or
    last stage), else on statistics alone (a middle stage's messages)."""
    return SentinelMonitor(node_config(config, ("fwd", "bwd") if audit_rate > 0 else ()))


@dataclass(frozen=True)
class StreamOptions:
    """How ``run_stream`` runs a stream on a static pool."""

    rounds: int = 60  # each round, every sender sends one message, in a random order
    attack_start: int = 20  # the first round in which the attacker corrupts
    seed: int = 0  # the senders' data shares and order, the attack's noise, the audits' draws
    n_honest: int = 2  # honest senders besides the attacker's seat
    audit_rate: float = AUDIT_RATE  # accepted messages audited, as a node next to the first or last stage does
    # (0: statistics only, as for a middle stage's messages)


def run_stream(pool: HonestPool, direction: str, kind: Optional[str] = None, strength: float = 0.0,
               config: Optional[SentinelConfig] = None, options: Optional[StreamOptions] = None,
               **overrides) -> StreamResult:
    """One interleaved stream through a fresh monitor. ``kind=None``: a clean stream of ``n_honest + 1`` honest
    senders (the third plays the attacker's seat but behaves). ``strength``: the attack's (``apply_attack``).
    ``config``: the monitor's settings. ``options``: see ``StreamOptions``; keyword ``overrides`` replace its
    fields (``run_stream(pool, "fwd", rounds=100, seed=1)``)."""
    opts = replace(options or StreamOptions(), **overrides)
    rng = random.Random(opts.seed)
    monitor = _receiver(config, opts.audit_rate)
    senders = [f"honest-{i}" for i in range(opts.n_honest)] + ["attacker"]
    S = pool.fwd.shape[0]
    order = list(range(S))
    rng.shuffle(order)
    shares = {s: order[i::len(senders)] for i, s in enumerate(senders)}
    tally = _StreamTally(monitor, kind, direction, strength, opts.seed, audit_rate=opts.audit_rate)
    for r in range(opts.rounds):
        rng.shuffle(senders)
        for who in senders:
            if monitor.banned(who) and who == "attacker":
                continue  # a banned peer is routed no more work
            idx = torch.tensor(rng.sample(shares[who], pool.microbatch))
            coords, grad, tokens = pool.fwd[idx], pool.bwd[idx], pool.tokens[idx]
            msg, bad = tally.outgoing(who, coords if direction == "fwd" else grad, r >= opts.attack_start)
            tally.send(who, msg, bad, r, tokens, coords)
    return tally.result(strength, senders)


@dataclass(frozen=True)
class DriftOptions:
    """How ``run_drift_stream`` runs a stream on traffic recorded while the model trains."""

    attack_start: Optional[int] = None  # the first step in which the attacker corrupts; None: a third of the way in
    seed: int = 0  # the senders' turns, the attack's noise, the audits' draws
    senders: int = 3  # senders, the attacker's seat (the last) included; at most the trace's
    messages_per_step: int = 1  # messages the receiver gets per optimizer step
    audit_rate: float = AUDIT_RATE  # as in ``StreamOptions``


def run_drift_stream(trace: DriftTrace, direction: str, kind: Optional[str] = None, strength: float = 0.0,
                     config: Optional[SentinelConfig] = None, options: Optional[DriftOptions] = None,
                     **overrides) -> StreamResult:
    """A stream through a fresh monitor while the model trains: at each optimizer step of ``trace``,
    ``messages_per_step`` of the ``senders`` (taken in turns, shuffled per cycle) each send their message of that
    step. On ``tiny`` a swarm step is two microbatches, so a receiver sees about one message per step: every
    message comes from a slightly newer model (the hardest case for a reference built from earlier messages).
    The last sender is the attacker's seat (corrupting from step ``attack_start`` on when ``kind`` is given); a
    banned attacker gets no more work. ``options``: see ``DriftOptions``; keyword ``overrides`` replace its
    fields."""
    opts = replace(options or DriftOptions(), **overrides)
    if opts.senders > trace.fwd.shape[1]:
        raise ValueError(f"the trace has {trace.fwd.shape[1]} senders, {opts.senders} requested")
    rng = random.Random(opts.seed)
    monitor = _receiver(config, opts.audit_rate)
    names = [f"honest-{i}" for i in range(opts.senders - 1)] + ["attacker"]
    start = trace.steps // 3 if opts.attack_start is None else opts.attack_start
    tally = _StreamTally(monitor, kind, direction, strength, opts.seed, clean_reasons=True,
                         audit_rate=opts.audit_rate)
    turn: list[int] = []
    for step in range(trace.steps):
        for _ in range(opts.messages_per_step):
            if not turn:
                turn = list(range(opts.senders))
                rng.shuffle(turn)
            slot = turn.pop()
            who = names[slot]
            if who == "attacker" and monitor.banned(who):
                continue
            coords, grad, tokens = trace.fwd[step, slot], trace.bwd[step, slot], trace.tokens[step, slot]
            msg, bad = tally.outgoing(who, coords if direction == "fwd" else grad, step >= start)
            tally.send(who, msg, bad, step, tokens, coords)
    return tally.result(strength, names)


# Clean drift streams: (senders, messages per step). One message per step is the live ``tiny`` swarm (a step is two
# microbatches over all receivers); three per step ends the warm-up inside the fastest early drift; two senders is
# a receiver with one peer to compare with.
DRIFT_CLEAN = ((2, 1), (3, 1), (3, 3))


def _attack_row(res: StreamResult, setting: str) -> dict:
    return dict(asdict(res), setting=setting, precision=res.precision, recall=res.recall, f1=res.f1)


def _clean_row(res: StreamResult, setting: str, senders: int, messages_per_step: Optional[int]) -> dict:
    messages = res.tn + res.fp
    return {"setting": setting, "senders": senders, "messages_per_step": messages_per_step,
            "direction": res.direction, "messages": messages, "flags": res.fp,
            "false_positive_rate": res.fp / max(messages, 1), "bans": res.honest_banned}


@dataclass(frozen=True)
class EvalOptions:
    """What ``evaluate`` runs."""

    rounds: int = 60  # rounds of each attacked static stream
    attack_start: int = 20  # the round its attacker starts corrupting in
    clean_rounds: int = 100  # rounds of each clean static stream
    seed: int = 0  # the pool, the trace, and the streams
    train_steps: int = 0  # Adam steps on the model before recording the static pool (``make_pool``)
    drift_steps: int = 0  # training steps to record for the drift streams (``make_drift_trace``); 0: none


class _Evaluation:
    """The rows of one ``evaluate`` run: attacked streams (``rows``) and clean ones (``clean``)."""

    def __init__(self, strengths: dict[str, Sequence[float]], config: Optional[SentinelConfig], opts: EvalOptions):
        self.strengths, self.config, self.opts = strengths, config, opts
        self.rows: list[dict] = []
        self.clean: list[dict] = []

    def _attacks(self) -> list[tuple[str, float, str]]:
        return [(kind, strength, direction) for kind, values in self.strengths.items() for strength in values
                for direction in ("fwd", "bwd")]

    def static(self, pool: HonestPool, audit_rate: float, suffix: str) -> None:
        opts = self.opts
        for kind, strength, direction in self._attacks():
            res = run_stream(pool, direction, kind, strength, self.config, rounds=opts.rounds,
                             attack_start=opts.attack_start, seed=opts.seed, audit_rate=audit_rate)
            self.rows.append(_attack_row(res, "static" + suffix))
        for direction in ("fwd", "bwd"):
            res = run_stream(pool, direction, None, 0.0, self.config, rounds=opts.clean_rounds,
                             attack_start=opts.clean_rounds, seed=opts.seed + 1, audit_rate=audit_rate)
            self.clean.append(_clean_row(res, "static" + suffix, 3, None))

    def drift(self, trace: DriftTrace, audit_rate: float, suffix: str) -> None:
        seed = self.opts.seed
        for kind, strength, direction in self._attacks():
            res = run_drift_stream(trace, direction, kind, strength, self.config, seed=seed, audit_rate=audit_rate)
            self.rows.append(_attack_row(res, "drift" + suffix))
        for senders, per_step in DRIFT_CLEAN:
            for direction in ("fwd", "bwd"):
                res = run_drift_stream(trace, direction, None, 0.0, self.config, seed=seed + 1, senders=senders,
                                       messages_per_step=per_step, audit_rate=audit_rate)
                self.clean.append(_clean_row(res, "drift" + suffix, senders, per_step))

    def sender_level(self) -> dict[str, dict]:
        """Per setting and over all: an attacker banned is a true positive, an honest sender banned a false one."""
        by_setting = {}
        for setting in sorted({r["setting"] for r in self.rows}) + ["all"]:
            sel = [r for r in self.rows if setting in ("all", r["setting"])]
            sel_clean = [c for c in self.clean if setting in ("all", c["setting"])]
            tp = sum(r["attacker_banned"] for r in sel)
            fp = sum(r["honest_banned"] for r in sel) + sum(c["bans"] for c in sel_clean)
            fn = len(sel) - tp
            precision, recall = tp / max(tp + fp, 1), tp / max(tp + fn, 1)
            delays = sorted(r["delay"] for r in sel if r["delay"] is not None)
            by_setting[setting] = {
                "attackers_banned": tp, "attackers": len(sel), "honest_banned": fp, "precision": precision,
                "recall": recall, "f1": 2 * precision * recall / max(precision + recall, 1e-12),
                "median_delay": delays[len(delays) // 2] if delays else None,
                "max_delay": delays[-1] if delays else None,
                "clean_messages": sum(c["messages"] for c in sel_clean),
                "clean_flags": sum(c["flags"] for c in sel_clean),
            }
        return by_setting


def evaluate(manifest: "Manifest | str" = "tiny", strengths: Optional[dict[str, Sequence[float]]] = None,
             config: Optional[SentinelConfig] = None, pool: Optional[HonestPool] = None,
             trace: Optional[DriftTrace] = None, options: Optional[EvalOptions] = None, **overrides) -> dict:
    """Every kind x strength x direction, plus clean streams. Returns a JSON-able report (see ``format_report``).

    ``strengths``: per attack kind, the strengths to run (default ``EVAL_STRENGTHS``). ``config``: the monitors'
    settings. ``pool``: the static traffic (default: recorded here). ``options``: see ``EvalOptions``; keyword
    ``overrides`` replace its fields. With ``drift_steps`` (or a ``trace``) it also streams traffic recorded
    *while the model trains* (``make_drift_trace``): every kind x strength x direction with the attack starting a
    third of the way in, and the ``DRIFT_CLEAN`` clean streams, whose honest statistics drift the whole time (the
    live failure mode)."""
    opts = replace(options or EvalOptions(), **overrides)
    t0 = time.perf_counter()
    pool = pool or make_pool(manifest, seed=opts.seed, train_steps=opts.train_steps)
    t_pool = time.perf_counter() - t0
    run = _Evaluation(strengths or EVAL_STRENGTHS, config, opts)
    drift: dict = {}
    if opts.drift_steps or trace is not None:
        t1 = time.perf_counter()
        trace = trace or make_drift_trace(manifest, steps=opts.drift_steps, seed=opts.seed)
        drift = {"steps": trace.steps, "loss_first": trace.losses[0], "loss_last": trace.losses[-1],
                 "trace_seconds": time.perf_counter() - t1}
    # Each setting twice: with audits, as for messages from the first or last stage (every two-stage pipeline),
    # and on statistics alone, as for a middle stage's messages (nobody can recompute those).
    for audit_rate, suffix in ((AUDIT_RATE, ""), (0.0, ", statistics only")):
        run.static(pool, audit_rate, suffix)
        if trace is not None:
            run.drift(trace, audit_rate, suffix)
    by_setting = run.sender_level()
    return {"pool_loss": pool.loss, "pool_seconds": t_pool, "seconds": time.perf_counter() - t0,
            "attacks": run.rows, "clean": run.clean, "drift": drift, "senders": by_setting["all"],
            "by_setting": by_setting}


def format_report(report: dict) -> str:
    lines = [f"SENTINEL offline evaluation (pool loss {report['pool_loss']:.2f}, {report['seconds']:.1f} s)"]
    if report.get("drift"):
        d = report["drift"]
        lines.append(f"drift: {d['steps']} training steps, loss {d['loss_first']:.2f} -> {d['loss_last']:.2f}")
    lines.append(f"{'setting':<8}{'attack':<12}{'strength':>9} {'dir':<4}{'banned':>7}{'delay':>6}{'honest bans':>12}"
                 f"{'prec':>6}{'recall':>7}{'F1':>6}  first reasons")
    for r in report["attacks"]:
        lines.append(
            f"{r.get('setting', 'static'):<8}{r['kind']:<12}{r['strength']:>9g} {r['direction']:<4}"
            f"{str(r['attacker_banned']):>7}{str(r['delay']) if r['delay'] is not None else '-':>6}"
            f"{r['honest_banned']:>12}{r['precision']:>6.2f}{r['recall']:>7.2f}{r['f1']:>6.2f}  "
            f"{', '.join(r['first_reasons'])}"
        )
    for c in report["clean"]:
        lines.append(f"clean {c.get('setting', 'static')} {c['direction']} ({c.get('senders', 3)} senders, "
                     f"{c.get('messages_per_step') or '-'}/step): {c['flags']}/{c['messages']} flagged "
                     f"(FPR {c['false_positive_rate']:.3f}), {c['bans']} bans")
    for setting, s in report.get("by_setting", {"all": report["senders"]}).items():
        lines.append(f"sender level [{setting}]: {s['attackers_banned']}/{s['attackers']} attackers banned, "
                     f"{s['honest_banned']} honest bans: precision {s['precision']:.2f} recall {s['recall']:.2f} "
                     f"F1 {s['f1']:.2f}; delay median {s.get('median_delay')} max {s.get('max_delay')}")
    lines.append("(message-level recall counts flagged corrupted messages until the ban: CUSUM / peer-test "
                 "detections flag only the alarm message, so it is low where the delay is long)")
    return "\n".join(lines)


if __name__ == "__main__":  # python -m agora.bench.sentinel_eval [train_steps] [drift_steps]
    import sys

    torch.set_num_threads(1)
    print(format_report(evaluate(train_steps=int(sys.argv[1]) if len(sys.argv) > 1 else 0,
                                 drift_steps=int(sys.argv[2]) if len(sys.argv) > 2 else 0)))
