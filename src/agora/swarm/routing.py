"""Choosing where work goes: small pure functions, easy to test (Petals/SWARM style).

* ``pick_peer``: the next-stage peer with the earliest expected finish time (queue + this job over the measured
  throughput), ties broken at random, peers never measured treated optimistically so they are probed soon.
* ``pick_stage``: which stage a joining peer should serve: empty stages first, then the least total throughput.
* ``plan_move``: whether a peer of an over-served stage should move to the bottleneck stage.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from typing import Optional, Sequence

from agora.swarm.records import PeerState, StageRecord

DEFAULT_THROUGHPUT = 1000.0  # tokens/s assumed for peers not yet measured: optimistic, so they get probed


@dataclass
class BanList:
    """Peers that failed recently. Bans expire so a peer that recovers is used again."""

    duration_s: float = 15.0
    until: dict[str, float] = field(default_factory=dict)

    def ban(self, peer_id: str, now: Optional[float] = None) -> None:
        self.until[peer_id] = (now or time.monotonic()) + self.duration_s

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
    """Earliest expected finish among serving, non-banned, non-excluded peers; None if there is none."""
    rng = rng or random
    inflight = inflight or {}
    usable = [
        r for r in candidates
        if r.state == PeerState.SERVING.value and r.peer_id not in exclude and not (bans and bans.banned(r.peer_id))
    ]
    if not usable:
        return None
    scored = [(expected_finish_s(r, job_tokens, inflight.get(r.peer_id, 0)), rng.random(), r) for r in usable]
    best = min(s for s, _, _ in scored)
    ties = [(tie, r) for s, tie, r in scored if s <= best * 1.05 + 1e-9]
    return min(ties, key=lambda t: t[0])[1]


def stage_capacity(records: Sequence[StageRecord], typical: float) -> float:
    """Total throughput a stage offers; newcomers not yet measured count at the swarm's typical throughput."""
    live = [r for r in records if r.state in (PeerState.SERVING.value, PeerState.SYNCING.value, PeerState.JOINING.value)]
    return sum(r.throughput if r.throughput > 0 else typical for r in live)


def typical_throughput(swarm: Sequence[Sequence[StageRecord]]) -> float:
    measured = sorted(r.throughput for stage in swarm for r in stage if r.throughput > 0)
    return measured[len(measured) // 2] if measured else DEFAULT_THROUGHPUT


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


def plan_move(
    swarm: Sequence[Sequence[StageRecord]],
    my_stage: int,
    my_throughput: float,
    min_gain: float = 1.3,
) -> Optional[Move]:
    """Move from ``my_stage`` to the bottleneck stage if that lifts the swarm's bottleneck by >= ``min_gain``.

    Hysteresis comes from the gain threshold: after a move the new bottleneck is never worse by that factor, so
    the move back cannot pass the same test. The last peer of a stage never moves (it would empty the stage).
    """
    typical = typical_throughput(swarm)
    caps = [stage_capacity(stage, typical) for stage in swarm]
    live_here = [r for r in swarm[my_stage] if r.state == PeerState.SERVING.value]
    if len(live_here) <= 1:
        return None
    target = min(range(len(caps)), key=lambda s: caps[s])
    if target == my_stage:
        return None
    before = min(caps)
    after_caps = list(caps)
    after_caps[my_stage] -= my_throughput
    after_caps[target] += my_throughput
    after = min(after_caps)
    if before <= 0:
        return Move(my_stage, target, float("inf"))
    gain = after / before
    return Move(my_stage, target, gain) if gain >= min_gain else None
