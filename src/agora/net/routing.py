"""Choosing where work goes: small pure functions, easy to test (Petals/SWARM style).

* ``pick_peer``: the next-stage peer with the earliest expected finish time (queue + this job over the measured
  throughput), ties broken at random, peers never measured treated optimistically so they are probed soon.
* ``pick_stage``: which stage a joining peer should serve: empty stages first, then the least total throughput.
* ``plan_move``: whether a peer of an over-served stage should move to the bottleneck stage.
* ``plan_rebalance``: the one move the whole swarm agrees on (every peer evaluates the same records, so they all
  name the same mover; a DHT lock in the node covers the rare case of differing views).
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field, replace
from typing import Optional, Sequence

from agora.net.records import PeerState, StageRecord

DEFAULT_THROUGHPUT = 1000.0  # tokens/s assumed for peers not yet measured: optimistic, so they get probed


@dataclass
class BanList:
    """Peers that failed recently. Bans expire so a peer that recovers is used again."""

    duration_s: float = 15.0
    until: dict[str, float] = field(default_factory=dict)

    def ban(self, peer_id: str, now: Optional[float] = None) -> None:
        self.until[peer_id] = (now or time.monotonic()) + self.duration_s

    def lift(self, peer_id: str) -> None:
        """The peer answered after all: use it again now."""
        self.until.pop(peer_id, None)

    def banned(self, peer_id: str, now: Optional[float] = None) -> bool:
        t = self.until.get(peer_id)
        if t is None:
            return False
        if (now or time.monotonic()) >= t:
            del self.until[peer_id]
            return False
        return True


def expected_finish_s(rec: StageRecord, job_tokens: int, local_inflight: int = 0) -> float:
    tps = rec.throughput if rec.throughput > 0 else DEFAULT_THROUGHPUT
    return (rec.queue + local_inflight + 1) * job_tokens / tps


def pick_peer(
    candidates: Sequence[StageRecord],
    job_tokens: int,
    exclude: Sequence[str] = (),
    bans: Optional[BanList] = None,
    inflight: Optional[dict[str, int]] = None,
    rng: Optional[random.Random] = None,
) -> Optional[StageRecord]:
    """Earliest expected finish among serving, non-banned, non-excluded peers; None if there is none.

    A peer not measured yet is scored at the best throughput measured among the usable candidates (optimistic,
    so a replacement peer gets work right away instead of idling behind a pessimistic default).
    """
    rng = rng or random
    inflight = inflight or {}
    usable = [
        r for r in candidates
        if r.state == PeerState.SERVING.value and r.peer_id not in exclude and not (bans and bans.banned(r.peer_id))
    ]
    if not usable:
        return None
    best_measured = max((r.throughput for r in usable if r.throughput > 0), default=DEFAULT_THROUGHPUT)

    def score(r: StageRecord) -> float:
        rec = r if r.throughput > 0 else replace(r, throughput=best_measured)
        return expected_finish_s(rec, job_tokens, inflight.get(r.peer_id, 0))

    scored = [(score(r), rng.random(), r) for r in usable]
    best = min(s for s, _, _ in scored)
    ties = [(tie, r) for s, tie, r in scored if s <= best * 1.05 + 1e-9]
    return min(ties, key=lambda t: t[0])[1]


def pick_peer_or_fallback(
    candidates: Sequence[StageRecord],
    job_tokens: int,
    tried: Sequence[str] = (),
    bans: Optional[BanList] = None,
    inflight: Optional[dict[str, int]] = None,
    rng: Optional[random.Random] = None,
) -> Optional[StageRecord]:
    """``pick_peer``, relaxing its filters instead of giving up while a serving peer exists.

    Order of preference: untried and not banned; untried but banned; tried (and maybe banned). A ban is a
    preference learned from one failure (a reset stream can be transient); when every serving peer of a stage is
    banned, sending to one of them beats abandoning the microbatch. The caller bounds the attempts.
    """
    for exclude, use_bans in ((tried, bans), (tried, None), ((), None)):
        peer = pick_peer(candidates, job_tokens, exclude=exclude, bans=use_bans, inflight=inflight, rng=rng)
        if peer is not None:
            return peer
    return None


def stage_capacity(records: Sequence[StageRecord], typical: float) -> float:
    """Total throughput a stage offers; newcomers not yet measured count at the swarm's typical throughput."""
    live = [r for r in records if r.state in (PeerState.SERVING.value, PeerState.SYNCING.value, PeerState.JOINING.value)]
    return sum(r.throughput if r.throughput > 0 else typical for r in live)


def typical_throughput(swarm: Sequence[Sequence[StageRecord]]) -> float:
    measured = sorted(r.throughput for stage in swarm for r in stage if r.throughput > 0)
    return measured[len(measured) // 2] if measured else DEFAULT_THROUGHPUT


def drop_stale(
    swarm: Sequence[Sequence[StageRecord]], max_age_s: float, now: Optional[float] = None
) -> list[list[StageRecord]]:
    """The records refreshed within ``max_age_s`` (by their writer's clock, ``updated``).

    A killed peer's record lives on until it expires; its ``updated`` time stops moving right away. A newcomer
    choosing a stage skips such records, or it would see the dead peer's stage as still served and join another.
    Records without a time are kept. ``max_age_s`` must exceed the announce period plus clock skew between hosts.
    """
    now = time.time() if now is None else now
    return [[r for r in stage if not r.updated or now - r.updated <= max_age_s] for stage in swarm]


def pick_stage(swarm: Sequence[Sequence[StageRecord]], rng: Optional[random.Random] = None) -> int:
    """Empty stages first (lowest index), otherwise the stage with the least capacity (ties at random)."""
    rng = rng or random
    typical = typical_throughput(swarm)
    caps = [stage_capacity(stage, typical) for stage in swarm]
    empty = [s for s, c in enumerate(caps) if c == 0]
    if empty:
        return empty[0]
    low = min(caps)
    return rng.choice([s for s, c in enumerate(caps) if c <= low * 1.0001])


@dataclass(frozen=True)
class Move:
    from_stage: int
    to_stage: int
    gain: float  # bottleneck capacity after / before


def _serving(records: Sequence[StageRecord]) -> list[StageRecord]:
    return [r for r in records if r.state == PeerState.SERVING.value]


def plan_move(
    swarm: Sequence[Sequence[StageRecord]],
    my_stage: int,
    my_throughput: float,
    min_gain: float = 1.3,
) -> Optional[Move]:
    """Move from ``my_stage`` to the bottleneck stage if that lifts the swarm's bottleneck by >= ``min_gain``.

    The mover's contribution at the target is estimated from the target's own measured peers (stages differ in
    cost: a tail with the LM head is slower per token than a middle stage); with none measured, from the mover.
    Hysteresis comes from the gain threshold: after a move the bottleneck is higher, so the move back would
    lower it and cannot pass the test; dwell times in the node keep noisy measurements from flapping. The last
    serving peer of a stage never moves (it would empty the stage). Ties for the bottleneck mean no single move
    helps (the other tied stage stays the bottleneck), which the gain test reports as no move.
    """
    typical = typical_throughput(swarm)
    caps = [stage_capacity(stage, typical) for stage in swarm]
    if len(_serving(swarm[my_stage])) <= 1:
        return None
    target = min(range(len(caps)), key=lambda s: (caps[s], s))
    if target == my_stage:
        return None
    mine = my_throughput if my_throughput > 0 else typical
    measured = [r.throughput for r in _serving(swarm[target]) if r.throughput > 0]
    gained = sum(measured) / len(measured) if measured else mine
    before = caps[target]
    after_caps = list(caps)
    after_caps[my_stage] -= mine
    after_caps[target] += gained
    after = min(after_caps)
    if before <= 0:
        return Move(my_stage, target, float("inf"))
    gain = after / before
    return Move(my_stage, target, gain) if gain >= min_gain else None


def plan_rebalance(
    swarm: Sequence[Sequence[StageRecord]], min_gain: float = 1.3
) -> Optional[tuple[str, Move]]:
    """(peer id, move) of the single best move in the swarm, or None.

    Every serving peer of every stage is a candidate with its own throughput; the largest gain wins and ties go to
    the smallest peer id. Peers that read the same records compute the same answer, so exactly one of them moves.
    """
    best: Optional[tuple[float, str, Move]] = None
    for stage, records in enumerate(swarm):
        for r in _serving(records):
            move = plan_move(swarm, stage, r.throughput, min_gain)
            if move is None:
                continue
            key = (-move.gain, r.peer_id)
            if best is None or key < (-best[0], best[1]):
                best = (move.gain, r.peer_id, move)
    return None if best is None else (best[1], best[2])
