"""Routing decisions are pure functions of DHT records: which peer gets a microbatch, which stage a newcomer
serves, and whether (and who) should move to another stage."""

import random

import pytest

from agora.net.records import StageRecord
from agora.net.routing import (
    DEFAULT_THROUGHPUT,
    BanList,
    Move,
    drop_stale,
    pick_peer,
    pick_peer_or_fallback,
    pick_stage,
    plan_move,
    plan_rebalance,
)


def rec(peer, stage=0, state="serving", throughput=0.0, queue=0):
    return StageRecord(peer_id=peer, stage=stage, state=state, manifest_hash="h", throughput=throughput, queue=queue)


# ------------------------------------------------------------------------------------------------ pick_peer
def test_pick_peer_prefers_earliest_expected_finish():
    fast, slow = rec("fast", throughput=2000.0), rec("slow", throughput=500.0)
    assert pick_peer([slow, fast], 100).peer_id == "fast"
    # A queue at the fast peer makes the slow one finish first ...
    busy = rec("fast", throughput=2000.0, queue=9)  # (9+1)*100/2000 = 0.5 s > 0.2 s
    assert pick_peer([slow, busy], 100).peer_id == "slow"
    # ... and so do our own microbatches in flight there.
    assert pick_peer([slow, fast], 100, inflight={"fast": 9}).peer_id == "slow"


def test_pick_peer_only_serving_unbanned_unexcluded():
    recs = [rec("a", state="joining"), rec("b", state="syncing"), rec("c", state="leaving"), rec("d"), rec("e")]
    bans = BanList(duration_s=15.0)
    bans.ban("d")
    assert pick_peer(recs, 10, exclude=["e"], bans=bans) is None
    assert pick_peer(recs, 10, bans=bans).peer_id == "e"
    assert pick_peer([], 10) is None


def test_ban_expires():
    bans = BanList(duration_s=10.0)
    bans.ban("x", now=100.0)
    assert bans.banned("x", now=109.0)
    assert not bans.banned("x", now=110.5)
    assert not bans.banned("never-banned")


def test_unmeasured_peer_is_scored_optimistically_against_measured_ones():
    # The default is far below what these peers measure: a replacement must still be probed, not starved.
    measured = rec("old", throughput=50 * DEFAULT_THROUGHPUT)
    fresh = rec("new", throughput=0.0)
    picks = {pick_peer([measured, fresh], 512, rng=random.Random(i)).peer_id for i in range(20)}
    assert "new" in picks
    # With work queued at the measured peer, the newcomer wins outright.
    assert pick_peer([rec("old", throughput=50 * DEFAULT_THROUGHPUT, queue=3), fresh], 512).peer_id == "new"


def test_ties_are_broken_at_random():
    recs = [rec("a", throughput=1000.0), rec("b", throughput=1000.0)]
    assert {pick_peer(recs, 10, rng=random.Random(i)).peer_id for i in range(30)} == {"a", "b"}


def test_fallback_relaxes_bans_then_tried_but_never_picks_non_serving():
    bans = BanList(duration_s=15.0)
    bans.ban("a")
    recs = [rec("a"), rec("b", state="leaving")]
    assert pick_peer(recs, 10, bans=bans) is None
    assert pick_peer_or_fallback(recs, 10, bans=bans).peer_id == "a"  # banned but the only serving one
    assert pick_peer_or_fallback(recs, 10, tried=["a"], bans=bans).peer_id == "a"  # tried: last resort
    assert pick_peer_or_fallback([rec("a"), rec("c")], 10, tried=["a"], bans=bans).peer_id == "c"
    assert pick_peer_or_fallback([rec("b", state="leaving")], 10) is None


# ------------------------------------------------------------------------------------------------ pick_stage
def test_pick_stage_fills_empty_stages_first_then_the_weakest():
    swarm = [[rec("a", 0, throughput=100.0)], [], [rec("c", 2, throughput=100.0)]]
    assert pick_stage(swarm) == 1
    swarm = [[rec("a", 0, throughput=100.0), rec("b", 0, throughput=100.0)], [rec("c", 1, throughput=150.0)]]
    assert pick_stage(swarm) == 1
    # A peer that is leaving does not count; one that is still syncing does (it will serve soon).
    swarm = [[rec("a", 0, throughput=100.0), rec("b", 0, throughput=100.0, state="leaving")],
             [rec("c", 1, throughput=100.0), rec("d", 1, state="syncing")]]
    assert pick_stage(swarm) == 0
    # Everything empty: the first stage.
    assert pick_stage([[], [], []]) == 0


# ------------------------------------------------------------------------------------------------ plan_move
def test_plan_move_to_bottleneck_when_gain_is_large_enough():
    swarm = [[rec(p, 0, throughput=100.0) for p in "abc"], [rec("d", 1, throughput=100.0)]]
    move = plan_move(swarm, 0, 100.0)
    assert move == Move(0, 1, 2.0)  # caps 300/100 -> 200/200
    assert plan_move(swarm, 1, 100.0) is None  # the bottleneck itself does not move


def test_plan_move_needs_the_gain_threshold():
    # caps 200 / 150: moving one peer gives 100 / 250 -> worse; never a move.
    swarm = [[rec("a", 0, throughput=100.0), rec("b", 0, throughput=100.0)], [rec("c", 1, throughput=150.0)]]
    assert plan_move(swarm, 0, 100.0) is None
    # caps 390 / 200 (three fast peers, two slow): 260 / 300 -> min 260, gain 1.3: exactly at the threshold.
    swarm = [[rec(p, 0, throughput=130.0) for p in "abc"], [rec("d", 1, throughput=100.0), rec("e", 1, throughput=100.0)]]
    assert plan_move(swarm, 0, 130.0, min_gain=1.3).to_stage == 1
    assert plan_move(swarm, 0, 130.0, min_gain=1.31) is None


def test_plan_move_has_hysteresis():
    before = [[rec(p, 0, throughput=100.0) for p in "abc"], [rec("d", 1, throughput=100.0)]]
    move = plan_move(before, 0, 100.0)
    assert move is not None
    # After the move (c now serves stage 1) nobody wants to move back, nor further.
    after = [[rec("a", 0, throughput=100.0), rec("b", 0, throughput=100.0)],
             [rec("c", 1, throughput=100.0), rec("d", 1, throughput=100.0)]]
    assert all(plan_move(after, s, 100.0) is None for s in (0, 1))
    assert plan_rebalance(after) is None


def test_last_peer_of_a_stage_never_moves():
    # Stage 0 has one very fast peer, stage 1 is slow: moving would empty stage 0.
    swarm = [[rec("a", 0, throughput=10_000.0)], [rec("b", 1, throughput=10.0)]]
    assert plan_move(swarm, 0, 10_000.0) is None
    assert plan_rebalance(swarm) is None
    # A syncing newcomer does not make the serving one movable (it may never finish syncing).
    swarm[0].append(rec("c", 0, state="syncing"))
    assert plan_move(swarm, 0, 10_000.0) is None


def test_plan_move_into_an_empty_stage_has_infinite_gain():
    swarm = [[rec("a", 0, throughput=100.0), rec("b", 0, throughput=100.0)], []]
    move = plan_move(swarm, 0, 100.0)
    assert move.to_stage == 1 and move.gain == float("inf")


def test_plan_move_estimates_the_movers_contribution_at_the_target():
    # Stage 1 peers are 4x slower per token (e.g. the LM head): a stage-0 peer moving there adds ~40, not 160.
    swarm = [[rec(p, 0, throughput=160.0) for p in "abc"], [rec("d", 1, throughput=40.0), rec("e", 1, throughput=40.0)]]
    # caps 480 / 80 -> 320 / 120: gain 1.5 (with the mover's own 160 it would wrongly look like 320 / 240 = 3.0).
    move = plan_move(swarm, 0, 160.0)
    assert move is not None and move.gain == pytest.approx(1.5)


def test_plan_rebalance_names_exactly_one_mover_the_smallest_id():
    swarm = [[rec(p, 0, throughput=100.0) for p in ("p3", "p1", "p2")], [rec("q", 1, throughput=100.0)]]
    mover, move = plan_rebalance(swarm)
    assert mover == "p1" and move == Move(0, 1, 2.0)
    # Everybody computes the same answer from the same records, whatever order the DHT returned them in.
    for seed in range(5):
        shuffled = [list(s) for s in swarm]
        random.Random(seed).shuffle(shuffled[0])
        assert plan_rebalance(shuffled)[0] == "p1"


def test_plan_rebalance_prefers_the_largest_gain():
    # Two over-served stages; moving from stage 0 (fast peers) lifts the bottleneck more than from stage 1.
    swarm = [[rec("a", 0, throughput=300.0), rec("b", 0, throughput=300.0)],
             [rec("c", 1, throughput=150.0), rec("d", 1, throughput=150.0)],
             [rec("e", 2, throughput=100.0)]]
    mover, move = plan_rebalance(swarm)
    assert move.to_stage == 2 and mover in ("a", "c")
    gains = {m: plan_move(swarm, s, t).gain for m, s, t in (("a", 0, 300.0), ("c", 1, 150.0))}
    assert mover == max(gains, key=gains.get)


def test_stale_records_are_dropped_for_stage_choice():
    alive, dead = rec("a", 0, throughput=100.0), rec("b", 0, throughput=100.0)
    alive.updated, dead.updated = 1000.0, 990.0
    other = rec("c", 1, throughput=100.0)
    other.updated = 999.0
    swarm = [[alive, dead], [other]]
    assert pick_stage(swarm) == 1  # the dead record still makes stage 0 look served twice
    fresh = drop_stale(swarm, max_age_s=6.5, now=1001.0)
    assert [[r.peer_id for r in s] for s in fresh] == [["a"], ["c"]]
    assert pick_stage(fresh, rng=random.Random(0)) in (0, 1)  # now a tie, not a clear win for stage 1
    # Records without a time (old writers) are kept.
    assert drop_stale([[rec("x")]], max_age_s=1.0, now=1e9) == [[rec("x")]]
