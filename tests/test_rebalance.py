"""When a peer moves to the bottleneck stage: only once the plan has named the same move for a while."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from agora.config import load_manifest
from agora.net.routing import Move
from agora.server import rebalance
from agora.server.rebalance import Rebalancer

MAN = load_manifest("tiny")


def _node(moved: list) -> SimpleNamespace:
    async def run_io(fn, *args):
        return [] if fn is not rebalance.announce else True  # no swarm to read, no lock held by others

    async def move_to(stage):
        moved.append(stage)
        return True

    return SimpleNamespace(manifest=MAN, step=100, run_io=run_io, dht=None, peer_id="me", stage_index=0,
                           opts=SimpleNamespace(min_move_gain=1.3, rebalance_confirm_s=45.0), move_to=move_to)


def test_a_move_is_made_only_after_the_plan_held_for_the_confirmation_time(monkeypatch):
    """A replica frozen for 40 s (a closed laptop lid) makes its stage the bottleneck while its record is gone:
    moving a peer there, and back when it wakes, costs two state downloads. The plan must hold at every check for
    ``rebalance_confirm_s``; one check without it starts the count again."""
    plans = []
    monkeypatch.setattr(rebalance, "plan_rebalance", lambda swarm, gain: plans[-1])
    moved: list = []
    reb = Rebalancer(_node(moved))
    now = [1000.0]
    reb.clock = lambda: now[0]
    to_tail = ("me", Move(from_stage=0, to_stage=1, gain=1.5))

    def check(at: float, plan):
        now[0] = 1000.0 + at
        plans.append(plan)
        return asyncio.run(reb.maybe_move())

    assert check(0, to_tail) is None and check(15, to_tail) is None and check(30, to_tail) is None
    assert check(40, None) is None  # the frozen replica is back: the plan no longer holds
    assert check(45, to_tail) is None and check(80, to_tail) is None and moved == []  # counted from 45 again
    assert check(90, to_tail) == to_tail[1] and moved == [1]
    assert check(95, ("someone-else", to_tail[1])) is None and moved == [1]  # only the named mover moves
