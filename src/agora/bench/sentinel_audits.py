"""SENTINEL evaluated without an oracle: real recomputations by imperfect replicas, and attacks it was not built for.

The traffic is real (``agora.bench.sentinel_traffic``): a preset (``small`` for the benchmark, ``tiny`` for tests)
trains on its corpus with its optimizer, four replica seats per stage, one microbatch each per step. Every
*stream* replays those steps into a fresh receiver's ``SentinelMonitor`` set up as a node's
(``node_config``, ``SentinelConfig(seed=manifest.seed)``): the head's activations (``fwd``) or the tail's
gradients (``bwd``), with audits (a receiver next to the first or last stage) or on statistics alone (a middle
stage's messages). All streams advance together, step by step, so recomputations are computed once per step.

Nothing hands the monitor the honest answer:

* **Replicas are imperfect** (``ReplicaModel``, drawn per step and replica, the same in every stream): a replica
  may be one optimizer step behind or ahead, and then sends and recomputes with those weights and claims that
  version; it may not answer an audit or a retry (absent); odd-numbered replicas round differently (their
  recomputations are not bit-identical).
* **Audits run as a node runs them** (``Screening._run_audit``): replicas ranked by ``rank_auditors`` (the
  sender's claimed step first), ``AUDITORS_ASKED`` asked, the first that confirms ends it, and the monitor judges
  the recomputations with the node's tolerance (``recomputed``). How often an audit could judge at all is
  reported (``audits``: answered, usable = a recomputation at the sender's claimed version).
* **Attackers lie as auditors**: asked to recompute an honest sender's message, an attacking replica returns a
  perturbed one claiming the sender's version; two colluding replicas return the same lie (they frame honest
  senders together) and vouch for each other's messages by returning them unchanged.
* **A flagged gradient is retried** on another replica of the tail (as ``Downstream.send`` does); that retry is
  screened too (a colluder's exact copy is a fake reproduction). A flagged activation is re-sent elsewhere by its
  sender, out of this receiver's sight.
* **Stale messages are never replays**: the stale attacker sends real messages of microbatches it computed and
  never sent (spares of its own data first).

Rows: the attack kinds SENTINEL has features for (``EVAL_STRENGTHS``, its design set), held-out attacks in their
own rows (a small random rotation of the k coordinates, a white-box perturbation kept just under every feature's
threshold, a corruption below the audit tolerance, a sleeper that behaves for two thirds of the run, and two
colluding replicas), and clean streams.
"""

from __future__ import annotations

import random
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Optional, Sequence

import torch
from torch import Tensor

from agora.bench.sentinel_eval import EVAL_STRENGTHS
from agora.bench.sentinel_traffic import TRAFFIC_SIZES, StepTraffic, TrafficSize, TrainingTraffic
from agora.lab.attacks import AttackState, apply_attack
from agora.net.records import PeerState, StageRecord
from agora.sentinel import AUDIT_RATE, SentinelConfig, SentinelMonitor, node_config, version_key
from agora.server.screening import AUDITORS_ASKED, rank_auditors

SEATS = 4  # replicas per stage, each sending one microbatch per step to the receiver
LIE_NOISE = 0.5  # a lying auditor's perturbation, x the message's rms: far beyond any tolerance


@dataclass(frozen=True)
class ReplicaModel:
    """How honest replicas of the sender's stage behave, drawn per (step, replica), the same in every stream."""

    absent: float = 0.15  # does not answer an audit or a retry in time (busy, timed out, gone)
    behind: float = 0.15  # has not applied the latest optimizer step yet: sends and recomputes with older weights
    ahead: float = 0.15  # has already applied the next one

    def present(self, seed: int, step: int, seat: int) -> bool:
        return random.Random(f"present:{seed}:{step}:{seat}").random() >= self.absent

    def offset(self, seed: int, step: int, seat: int) -> int:
        """The replica's weights at ``step``, in steps relative to the step's (-1 behind, +1 ahead)."""
        r = random.Random(f"offset:{seed}:{step}:{seat}").random()
        if r < self.behind and step > 0:
            return -1
        return 1 if r >= 1 - self.ahead else 0


@dataclass(frozen=True)
class Row:
    """One attack (or the clean case) as the report lists it; streamed in both directions and both settings."""

    label: str
    group: str  # "standard" (kinds SENTINEL has features for), "held-out", "clean"
    kind: Optional[str]
    strength: float
    start: int  # the first step the attackers corrupt in
    colluding: bool = False  # two attacking replicas that vouch for each other

    @property
    def attackers(self) -> tuple[str, ...]:
        if self.kind is None:
            return ()
        return ("accomplice", "attacker") if self.colluding else ("attacker",)

    @property
    def senders(self) -> tuple[str, ...]:
        return ("honest-0", "honest-1", "accomplice" if self.colluding else "honest-2", "attacker")


def default_rows(steps: int) -> list[Row]:
    """The design-set kinds at two strengths, the held-out attacks and the clean row, for a ``steps``-step run."""
    start, late = steps // 3, 2 * steps // 3
    rows = [Row(f"{kind}:{s:g}", "standard", kind, s, start) for kind, values in EVAL_STRENGTHS.items()
            for s in values]
    rows += [
        Row("rotate:0.1 (random rotation of the k coordinates, 0.1 rad)", "held-out", "rotate", 0.1, start),
        Row("evade:0.8 (bias kept under 0.8 x every threshold)", "held-out", "evade", 0.8, start),
        Row("sub_tolerance:0.9 (bias of 0.9 x the audit tolerance)", "held-out", "sub_tolerance", 0.9, start),
        Row(f"sleeper (honest until step {late}, then bias:0.5)", "held-out", "bias", 0.5, late),
        Row("collude (two replicas, stale:1, vouching)", "held-out", "stale", 1.0, start, colluding=True),
        Row("clean", "clean", None, 0.0, steps),
    ]
    return rows


@dataclass
class AuditCounts:
    """What the audits of one stream could do."""

    attempted: int = 0
    answered: int = 0  # at least one replica answered
    usable: int = 0  # ... and one of them at the sender's claimed version (the monitor can judge)
    confirmed: int = 0  # a recomputation matched the message
    convicted: int = 0  # the sender was struck
    on_corrupt: int = 0  # audits of corrupted messages
    cleared_corrupt: int = 0  # ... that a recomputation "confirmed" (a colluder's vouching, below the tolerance)
    convicted_honest: int = 0  # honest messages struck by an audit (lying auditors)
    lies: int = 0  # recomputations an attacker falsified


Recomputation = tuple[str, Tensor, list]  # (auditor, its result, its version), as ``recomputed`` takes them


def ask_auditors(monitor: SentinelMonitor, sender: str, msg: Tensor, version: list,
                 replicas: Sequence[tuple[str, int]], stage: int, answer: Callable[[str], Optional[Recomputation]],
                 rng: random.Random) -> list[Recomputation]:
    """The recomputations a node's audit collects (``Screening._run_audit``): ``replicas`` (name, the step its
    record shows) ranked by ``rank_auditors``, the first ``AUDITORS_ASKED`` asked (``answer``: their reply, or
    None when they do not answer, which spends the slot as a failed call does); the first that confirms the
    message ends it."""
    records = [StageRecord(name, stage, PeerState.SERVING.value, "", step=step) for name, step in replicas]
    ranked = rank_auditors(records, sender, monitor.banned_peers(), version_key(version), rng)
    results = []
    for rec in ranked[:AUDITORS_ASKED]:
        reply = answer(rec.peer_id)
        if reply is None:
            continue
        results.append(reply)
        if monitor.same_message(msg, reply[1]):
            break
    return results


def falsified(real: Tensor, *key: object) -> Tensor:
    """A lying auditor's recomputation: ``real`` plus noise derived from ``key`` (the microbatch), so colluders
    that lie about the same message agree with each other."""
    gen = torch.Generator().manual_seed(random.Random(":".join(map(str, ("lie", *key)))).getrandbits(62))
    noise = torch.randn(real.shape, generator=gen) * real.float().pow(2).mean().sqrt() * LIE_NOISE
    return (real.float() + noise).to(real.dtype)


class _Stream:
    """One row in one direction and setting: a receiver's monitor fed every step's messages."""

    def __init__(self, row: Row, direction: str, audited: bool, traffic: TrainingTraffic, replicas: ReplicaModel,
                 seed: int):
        self.row, self.direction, self.audited, self.replicas, self.seed = row, direction, audited, replicas, seed
        self.traffic = traffic
        m = traffic.manifest
        self.boundary = 0 if direction == "fwd" else m.n_stages - 2
        self.stage = 0 if direction == "fwd" else m.n_stages - 1  # the senders' stage
        self.monitor = SentinelMonitor(node_config(SentinelConfig(seed=m.seed), (direction,) if audited else ()))
        tag = f"{seed}:{row.label}:{direction}:{audited}"
        self.rng, self.audit_rng = random.Random(f"order:{tag}"), random.Random(f"audit:{tag}")
        self.states = {a: AttackState() for a in row.attackers}
        self.gens = {a: torch.Generator().manual_seed(seed + 1 + i) for i, a in enumerate(row.attackers)}
        self.audits = AuditCounts()
        self.tp = self.fp = self.fn = self.tn = 0
        self.honest_msgs = self.honest_flags = self.corrupt = self.retries = 0
        self.delay: Optional[int] = None
        self.first_reasons: list = []

    # ------------------------------------------------------------------ one step
    def step(self, cur: StepTraffic) -> None:
        order = list(enumerate(self.row.senders))
        self.rng.shuffle(order)
        for seat, who in order:
            if self.monitor.banned(who):
                continue  # a banned peer is routed no more work
            if who in self.row.attackers and cur.step == self.row.start - 1:
                self._bank_spares(who, cur)
            msg, version, bad = self._outgoing(who, seat, seat, cur)
            verdict = self._observe(who, seat, msg, version, bad, cur)
            if self.audited and (verdict.flagged or self.audit_rng.random() < AUDIT_RATE):
                self._audit(who, seat, msg, version, bad, verdict.flagged, cur)
            if verdict.flagged and not verdict.banned and self.direction == "bwd":
                self._retry(who, seat, msg, version, cur)

    def _attacking(self, who: str, step: int) -> bool:
        return who in self.row.attackers and step >= self.row.start

    def _honest(self, who: str, replica_seat: int, seat: int, cur: StepTraffic) -> tuple[Tensor, list]:
        """What replica ``who`` (seat ``replica_seat``) computes for ``seat``'s microbatch, and its version: an
        attacker holds the step's weights; an honest replica may be a step behind or ahead."""
        off = 0 if who in self.row.attackers else self.replicas.offset(self.seed, cur.step, replica_seat)
        if off == 0 and replica_seat == seat:
            msg = (cur.fwd if self.direction == "fwd" else cur.bwd)[seat]  # its training computation
        else:
            msg = self.traffic.recompute(self.direction, seat, cur.step + off, other_arithmetic=replica_seat % 2 == 1)
        return msg, self.traffic.version(self.direction, cur.step + off)

    def _outgoing(self, who: str, replica_seat: int, seat: int, cur: StepTraffic) -> tuple[Tensor, list, bool]:
        """(what ``who`` sends for ``seat``'s microbatch, its claimed version, whether it is corrupted)."""
        honest, version = self._honest(who, replica_seat, seat, cur)
        if not self._attacking(who, cur.step):
            if who in self.row.attackers:
                self.states[who].remember(honest)  # replay and evade draw on what it sent while behaving
            return honest, version, False
        msg = apply_attack(self.row.kind, self.row.strength, honest, self.gens[who], self.states[who])
        return msg, version, not torch.equal(msg, honest)

    def _bank_spares(self, who: str, cur: StepTraffic) -> None:
        """Before attacking, a stale attacker computes microbatches of its own data it never sends."""
        if self.row.kind != "stale":
            return
        lag, index = int(self.row.strength), self.row.attackers.index(who)
        for spare in cur.spares.get(self.direction, [])[index * lag:(index + 1) * lag]:
            self.states[who].spare(spare)

    def _observe(self, who: str, seat: int, msg: Tensor, version: list, bad: bool, cur: StepTraffic):
        v = self.monitor.observe(who, self.boundary, self.direction, msg, step=cur.step, tokens=cur.tokens[seat],
                                 paired=cur.to_tail[seat] if self.direction == "bwd" else None, version=version)
        self.corrupt += bad
        if self.delay is None and self.corrupt and any(self.monitor.banned(a) for a in self.row.attackers):
            self.delay = self.corrupt
        if bad:
            self.tp += v.flagged
            self.fn += not v.flagged
            if v.flagged and not self.first_reasons:
                self.first_reasons = v.reasons[:3]
        else:
            self.fp += v.flagged
            self.tn += not v.flagged
            if who not in self.row.attackers:
                self.honest_msgs += 1
                self.honest_flags += v.flagged
        return v

    # ------------------------------------------------------------------ audits and retries
    def _record_step(self, who: str, step: int) -> int:
        if who in self.row.attackers:
            return step
        return step + self.replicas.offset(self.seed, step, self.row.senders.index(who))

    def _audit(self, who: str, seat: int, msg: Tensor, version: list, bad: bool, flagged: bool,
               cur: StepTraffic) -> None:
        """Have the other replicas recompute the message as a node does, then let the monitor judge."""
        a = self.audits
        a.attempted += 1
        a.on_corrupt += bad
        replicas = [(name, self._record_step(name, cur.step)) for name in self.row.senders]
        results = ask_auditors(self.monitor, who, msg, version, replicas, self.stage,
                               lambda auditor: self._answer(auditor, who, seat, msg, version, cur), self.audit_rng)
        if not results:
            return
        a.answered += 1
        claimed = version_key(version)
        witnesses = [t for _, t, v in results if version_key(v) == claimed]
        a.usable += bool(witnesses)
        verdict = self.monitor.recomputed(who, self.boundary, self.direction, msg, version, results, flagged)
        if any(self.monitor.same_message(msg, t) for t in witnesses):
            a.confirmed += 1
            a.cleared_corrupt += bad
        if verdict.flagged:
            a.convicted += 1
            a.convicted_honest += not bad
            if self.delay is None and self.corrupt and any(self.monitor.banned(x) for x in self.row.attackers):
                self.delay = self.corrupt

    def _answer(self, auditor: str, sender: str, seat: int, msg: Tensor, version: list,
                cur: StepTraffic) -> Optional[Recomputation]:
        """A replica's reply to an audit of ``sender``'s message for ``seat``'s microbatch, or None (absent)."""
        auditor_seat = self.row.senders.index(auditor)
        if self._attacking(auditor, cur.step):
            if sender in self.row.attackers:
                return auditor, msg.clone(), version  # vouches for its accomplice: "I computed the same"
            self.audits.lies += 1
            return auditor, falsified(self.traffic.recompute(self.direction, seat, cur.step), self.seed, cur.step,
                                      seat, self.direction), version
        if not self.replicas.present(self.seed, cur.step, auditor_seat) and auditor not in self.row.attackers:
            return None
        honest, own_version = self._honest(auditor, auditor_seat, seat, cur)
        return auditor, honest, own_version

    def _retry(self, who: str, seat: int, msg: Tensor, version: list, cur: StepTraffic) -> None:
        """The receiver retries a flagged gradient's microbatch on other tails until one is accepted (at most two)."""
        others = [(i, n) for i, n in enumerate(self.row.senders) if n != who and not self.monitor.banned(n)]
        self.rng.shuffle(others)
        tries = 0
        for replica_seat, name in others:
            if tries == 2:
                return
            if name not in self.row.attackers and not self.replicas.present(self.seed, cur.step, replica_seat):
                continue
            tries += 1
            self.retries += 1
            if self._attacking(name, cur.step) and who in self.row.attackers:
                reply, reply_version, bad = msg.clone(), version, True  # a colluder reproduces its accomplice's
            else:
                reply, reply_version, bad = self._outgoing(name, replica_seat, seat, cur)
            verdict = self._observe(name, seat, reply, reply_version, bad, cur)
            if not verdict.flagged:
                return

    # ------------------------------------------------------------------ result
    def result(self) -> dict:
        attackers = self.row.attackers
        honest = [s for s in self.row.senders if s not in attackers]
        banned = sum(self.monitor.banned(a) for a in attackers)
        precision = self.tp / (self.tp + self.fp) if self.tp + self.fp else 1.0
        recall = self.tp / (self.tp + self.fn) if self.tp + self.fn else 1.0
        return {
            "setting": "audits" if self.audited else "statistics only", "group": self.row.group,
            "label": self.row.label, "kind": self.row.kind or "clean", "strength": self.row.strength,
            "direction": self.direction, "start": self.row.start, "attackers": len(attackers),
            "attackers_banned": banned, "attacker_banned": bool(attackers) and banned == len(attackers),
            "delay": self.delay, "honest_banned": sum(self.monitor.banned(h) for h in honest),
            "tp": self.tp, "fp": self.fp, "fn": self.fn, "tn": self.tn, "precision": precision, "recall": recall,
            "f1": 2 * precision * recall / (precision + recall) if precision + recall else 0.0,
            "honest_messages": self.honest_msgs, "honest_flags": self.honest_flags,
            "honest_flag_rate": self.honest_flags / max(self.honest_msgs, 1), "corrupt_sent": self.corrupt,
            "retries": self.retries, "audits": asdict(self.audits), "first_reasons": self.first_reasons,
        }


@dataclass(frozen=True)
class AuditedEvalOptions:
    """What ``evaluate_audited`` runs."""

    seed: int = 0
    replicas: ReplicaModel = field(default_factory=ReplicaModel)
    directions: tuple[str, ...] = ("fwd", "bwd")
    settings: tuple[bool, ...] = (True, False)  # with audits, statistics only


def summarize(rows: Sequence[dict]) -> dict[str, dict]:
    """Sender level per (group, setting): an attacker banned is a true positive, an honest sender banned a false
    one (clean streams count with the design-set group); audits: how many could judge."""
    out: dict[str, dict] = {}
    for group in ("standard", "held-out"):
        for setting in ("audits", "statistics only"):
            sel = [r for r in rows if r["group"] == group and r["setting"] == setting]
            if not sel:
                continue
            clean = ([r for r in rows if r["group"] == "clean" and r["setting"] == setting]
                     if group == "standard" else [])
            tp = sum(r["attackers_banned"] for r in sel)
            fn = sum(r["attackers"] for r in sel) - tp
            fp = sum(r["honest_banned"] for r in sel + clean)
            precision, recall = tp / max(tp + fp, 1), tp / max(tp + fn, 1)
            delays = sorted(r["delay"] for r in sel if r["delay"] is not None)
            audits = {k: sum(r["audits"][k] for r in sel + clean) for k in asdict(AuditCounts())}
            out[f"{group}, {setting}"] = {
                "attackers_banned": tp, "attackers": tp + fn, "honest_banned": fp, "precision": precision,
                "recall": recall, "f1": 2 * precision * recall / max(precision + recall, 1e-12),
                "median_delay": delays[len(delays) // 2] if delays else None,
                "max_delay": delays[-1] if delays else None,
                "clean_messages": sum(r["honest_messages"] for r in clean),
                "clean_flags": sum(r["honest_flags"] for r in clean),
                "audits": audits,
                "audit_answered": audits["answered"] / audits["attempted"] if audits["attempted"] else None,
                "audit_usable": audits["usable"] / audits["attempted"] if audits["attempted"] else None,
            }
    return out


def evaluate_audited(size: "str | TrafficSize" = "small", rows: Optional[Sequence[Row]] = None,
                     options: Optional[AuditedEvalOptions] = None, log: Callable[[str], None] = lambda _: None
                     ) -> dict:
    """Train ``size`` (a ``TRAFFIC_SIZES`` name or a ``TrafficSize``) for real and stream every row
    (``default_rows``) in each direction and setting through its own receiver. Returns a JSON-able report: per
    stream ``rows``, the per-(group, setting) ``summary``, and what the traffic was (``traffic``)."""
    opts = options or AuditedEvalOptions()
    size = TRAFFIC_SIZES[size] if isinstance(size, str) else size
    rows = list(rows) if rows is not None else default_rows(size.steps)
    t0 = time.perf_counter()
    spare_at: dict[int, int] = {}
    for row in rows:  # each stale attacker banks ``lag`` spares the step before it starts
        if row.kind == "stale":
            need = int(row.strength) * len(row.attackers)
            spare_at[row.start - 1] = max(spare_at.get(row.start - 1, 0), need)
    traffic = TrainingTraffic(size, seats=SEATS, seed=opts.seed, spare_at=spare_at)
    streams = [_Stream(row, d, audited, traffic, opts.replicas, opts.seed)
               for audited in opts.settings for row in rows for d in opts.directions]
    for cur in traffic.run():
        for stream in streams:
            stream.step(cur)
        if cur.step % 8 == 7 or cur.step == size.steps - 1:
            log(f"step {cur.step + 1}/{size.steps}: loss {cur.loss:.3f}, {time.perf_counter() - t0:.0f} s")
    results = [s.result() for s in streams]
    same, other = traffic.same_version_diffs, traffic.other_version_diffs
    return {
        "traffic": {
            "preset": size.preset, "steps": size.steps, "seats": SEATS, "corpus": traffic.manifest.data.corpus,
            "message_shape": [size.sequences, size.seq_len, traffic.manifest.residual.k],
            "wire_dtype": traffic.manifest.residual.wire_dtype, "loss_first": traffic.losses[0],
            "loss_last": traffic.losses[-1], "replicas": asdict(opts.replicas),
            "audit_tolerance": SentinelConfig().audit_tolerance,
            "same_version_recomputations": len(same),
            "same_version_max_diff": max(same, default=None),
            "same_version_nonbitwise": sum(d > 0 for d in same),
            "other_version_min_diff": min(other, default=None),
            "other_version_median_diff": sorted(other)[len(other) // 2] if other else None,
        },
        "rows": results, "summary": summarize(results), "seconds": time.perf_counter() - t0,
    }

