"""A process notices it was frozen (server/freeze.py), and a run whose caller left is not applied (exactly_once)."""

from __future__ import annotations

import asyncio

import pytest

from agora.server.exactly_once import ExactlyOnce
from agora.server.freeze import FreezeWatch


class _Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_gap_between_ticks_is_a_freeze_that_drops_work_in_flight_and_refuses_new_work_for_a_moment():
    clock = _Clock()
    watch = FreezeWatch(threshold_s=5.0, grace_s=2.0, period_s=0.5, clock=clock)
    epoch = watch.epoch
    for _ in range(20):  # a busy but running process: ticks every 0.5-4.9 s are no freeze
        clock.now += 0.5
        assert watch.tick() is None
    clock.now += 4.9
    assert not watch.refusing() and not watch.stale(epoch)
    clock.now += 40.0  # SIGSTOP for 40 s: the first check afterwards sees it, before the ticker runs
    assert watch.stale(epoch) and watch.epoch == epoch + 1 and watch.last_freeze_s == pytest.approx(40.0)
    assert watch.refusing()
    clock.now += 1.0
    assert watch.refusing()
    clock.now += 1.5
    assert not watch.refusing() and not watch.stale(watch.epoch) and watch.frozen_s == pytest.approx(40.0)
    with pytest.raises(ValueError):
        FreezeWatch(threshold_s=0.5, period_s=0.5)


def test_the_ticker_notices_a_real_stall_of_the_event_loop():
    async def main():
        watch = FreezeWatch(threshold_s=0.3, grace_s=0.1, period_s=0.05)
        ticker = asyncio.create_task(watch.run())
        await asyncio.sleep(0.2)
        assert watch.epoch == 0
        import time
        time.sleep(0.5)  # the loop is blocked, as if stopped
        await asyncio.sleep(0.1)
        ticker.cancel()
        return watch

    watch = asyncio.run(main())
    assert watch.epoch == 1 and watch.last_freeze_s >= 0.5


def test_a_run_is_wanted_while_a_caller_awaits_it_and_not_once_every_caller_left():
    async def main():
        once = ExactlyOnce()
        key = ("caller", "mb1")
        release = asyncio.Event()
        seen = {}

        async def compute():
            await release.wait()
            seen["wanted_at_commit"] = once.wanted(key)
            return {"ok": True}, []

        caller = asyncio.create_task(once.run(key, compute))
        await asyncio.sleep(0.01)
        assert once.wanted(key) and once.wanted(None)
        caller.cancel()  # the caller's stream closed (a hedge to another replica won)
        await asyncio.gather(caller, return_exceptions=True)
        assert not once.wanted(key) and once.wanted(None)
        retry = asyncio.create_task(once.run(key, compute))  # a retry of the same label joins the run
        await asyncio.sleep(0.01)
        release.set()
        reply = await retry
        return reply, seen, once

    reply, seen, once = asyncio.run(main())
    assert reply == ({"ok": True}, []) and seen == {"wanted_at_commit": True} and once.waiters == {}
