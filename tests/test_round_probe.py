"""A round's partner that stops answering (frozen) is noticed by a probe, before its record expires or hivemind's
all-reduce timeouts end (offline: a fake round control and scripted probe answers)."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest

from agora.net import transport
from agora.net.records import StageRecord
from agora.net.transport import RpcError
from agora.server.averaging import sync as sync_module
from agora.server.averaging.sync import PROBE_TIMEOUT_S, ReplicaSync


class _Control:
    """hivemind's StepControl as ``_await_round`` sees it: done after ``done_after`` seconds (never: None)."""

    def __init__(self, began_allreduce: bool, done_after=None):
        self.began_allreduce, self.cancelled = began_allreduce, False
        self.finish_at = None if done_after is None else time.monotonic() + done_after

    def done(self):
        return self.cancelled or (self.finish_at is not None and time.monotonic() >= self.finish_at)

    def cancel(self):
        self.cancelled = True

    def result(self, timeout=None):
        return {"partner": {"step": 5}}


def _sync(partners: list[str]) -> SimpleNamespace:
    """The parts of a ReplicaSync that the round's wait uses, its real methods bound to a plain namespace."""
    me = SimpleNamespace(ctx=SimpleNamespace(stage_index=0, p2p=None, manifest=SimpleNamespace(run_id="run")),
                         aborted_rounds=0, left_rounds=0, probe_failures=0, unresponsive={}, typical_allreduce_s=None,
                         _left_control=None)
    records = [StageRecord(peer_id=p, stage=0, state="serving", manifest_hash="h", step=5) for p in partners]

    async def round_partners(step):
        return [r for r in records if not ReplicaSync._is_unresponsive(me, r.peer_id)]

    me._round_partners = round_partners
    me.probe = lambda peers, *args, **kwargs: ReplicaSync.probe(me, peers, *args, **kwargs)
    me._partners_left = lambda step: ReplicaSync._partners_left(me, step)
    me._allreduce_probe_after = lambda: ReplicaSync._allreduce_probe_after(me)
    me._allreduce_probe_timeout = lambda: ReplicaSync._allreduce_probe_timeout(me)
    me.averager_busy = lambda: ReplicaSync.averager_busy(me)
    return me


@pytest.fixture
def frozen(monkeypatch):
    """Probes of the peers in the returned set hang until their timeout; the others answer at once."""
    hung: set[str] = set()
    probes: list[str] = []

    async def fake_call(p2p, peer_id, namespace, name, meta, tensors, timeout, stats=None):
        probes.append(peer_id)
        if peer_id.startswith("busy"):
            raise RpcError(transport.BUSY, "at its stream limit")
        if peer_id in hung or f"{peer_id}/once" in hung:
            hung.discard(f"{peer_id}/once")
            await asyncio.sleep(timeout)
            raise RpcError(transport.TIMEOUT, "no reply")
        return {"record": {}}, []

    monkeypatch.setattr(transport, "call", fake_call)
    return hung, probes


def test_a_frozen_partner_ends_the_matchmaking_wait_before_its_record_expires(frozen):
    hung, probes = frozen
    hung.add("partner")
    me, control = _sync(["partner"]), _Control(began_allreduce=False)
    t0 = time.monotonic()
    assert asyncio.run(ReplicaSync._await_round(me, control, 5, 20.0)) is None
    took = time.monotonic() - t0
    assert control.cancelled and me.aborted_rounds == 1 and probes == ["partner"]
    assert took < 2.0 + PROBE_TIMEOUT_S + 1.5, took  # before: until the record expired (up to 8 s more)
    assert ReplicaSync._is_unresponsive(me, "partner")
    sync_module.UNRESPONSIVE_S, saved = 0.0, sync_module.UNRESPONSIVE_S
    try:
        assert not ReplicaSync._is_unresponsive(me, "partner") and me.unresponsive == {}
    finally:
        sync_module.UNRESPONSIVE_S = saved


def test_a_partner_frozen_mid_all_reduce_makes_our_side_leave_the_round(frozen):
    hung, probes = frozen
    hung.add("partner")
    me, control = _sync(["partner"]), _Control(began_allreduce=True)
    me.typical_allreduce_s = 0.1  # probed after max(3 s, 4 x 0.1 s)
    t0 = time.monotonic()
    assert asyncio.run(ReplicaSync._await_round(me, control, 5, 20.0)) is None
    took = time.monotonic() - t0
    # Two probes missed in a row (2 s, then 4 s) before leaving; before the probes: hivemind's 5 s + 10 s timeouts
    assert 3.0 + 3 * PROBE_TIMEOUT_S <= took < 3.0 + 3 * PROBE_TIMEOUT_S + 1.5, took
    assert probes == ["partner", "partner"]
    assert me.left_rounds == 1 and me._left_control is control and me.averager_busy()
    control.cancel()  # the averager ended the round in the background
    assert not me.averager_busy()


def test_a_partner_that_misses_one_probe_on_a_saturated_link_is_not_left(frozen):
    """At 20 Mbit/s a probe queued behind the round's own transfer missed its 2 s; the partner was alive and the
    round was thrown away (4 of 52 rounds in a capped ``agora bench convergence`` run). One miss is not enough."""
    hung, probes = frozen
    hung.add("partner/once")
    me, control = _sync(["partner"]), _Control(began_allreduce=True, done_after=7.0)
    me.typical_allreduce_s = 0.1
    assert asyncio.run(ReplicaSync._await_round(me, control, 5, 20.0)) == {"partner": {"step": 5}}
    assert len(probes) >= 2 and me.left_rounds == 0 and me.unresponsive == {} and me.probe_failures == 0


def test_a_slow_all_reduce_whose_partners_answer_is_waited_for(frozen):
    hung, probes = frozen
    me, control = _sync(["partner"]), _Control(began_allreduce=True, done_after=4.5)
    assert asyncio.run(ReplicaSync._await_round(me, control, 5, 20.0)) == {"partner": {"step": 5}}
    assert probes and me.left_rounds == 0 and me.unresponsive == {}
    assert me.typical_allreduce_s == pytest.approx(4.5, abs=0.5)


def test_a_partner_that_refuses_the_probe_answered_and_counts_as_alive(frozen):
    hung, probes = frozen
    me = _sync(["busy-partner"])
    assert asyncio.run(ReplicaSync._partners_left(me, 5)) and me.unresponsive == {}
    hung.add("gone")
    me = _sync(["busy-partner", "gone"])
    assert asyncio.run(ReplicaSync.probe(me, asyncio.run(me._round_partners(5)))) == [True, False]
    assert set(me.unresponsive) == {"gone"} and me.probe_failures == 1


def test_the_default_averaging_timeout_covers_a_stages_float64_gradients_at_8_mbit():
    from agora.server.averaging.sync import AVERAGING_TIMEOUT_MIN_S, default_averaging_timeout_s
    from agora.server.node import NodeOptions

    assert NodeOptions().averaging_timeout_s is None  # resolved per stage when the node builds its sync
    assert default_averaging_timeout_s(700_000) == AVERAGING_TIMEOUT_MIN_S  # tiny: 5.6 MB of float64
    assert default_averaging_timeout_s(7_000_000) == pytest.approx(7e6 * 8 / 2**20)  # small's largest: ~53 s


def test_state_download_timeouts_scale_with_the_stage_state():
    """A move into ``small``'s tail at 20 Mbit/s timed out on a flat 60 s per page (its first page is 64 MiB and the
    source's link also carried a round): the timeouts now follow what the download moves."""
    from agora.config import load_manifest
    from agora.net.state_transfer import PAGE_BYTES
    from agora.server.averaging.sync import (STATE_MIN_RATE_BYTES_PER_S, STATE_PAGE_TIMEOUT_MIN_S,
                                             STATE_SYNC_TIMEOUT_MIN_S, default_sync_timeout_s, stage_state_bytes,
                                             state_page_timeout_s)
    from agora.server.node import NodeOptions
    from agora.server.observers import Observers
    from agora.server.runtime import Counters, StageRuntime
    import torch

    assert NodeOptions().sync_timeout_s is None
    # The estimate bounds what a real export of a stage that stepped holds (parameters + Adam's two moments).
    rt = StageRuntime(load_manifest("tiny"), 1, Counters(), Observers())
    rt.apply_step([torch.full(p.shape, 0.01, dtype=torch.float64) for p in rt.stage.parameters()])
    _, names, tensors = rt.export_state()
    exported = sum(t.numel() * t.element_size() for t in tensors)
    estimate = stage_state_bytes(rt.stage)
    assert exported <= estimate <= 1.05 * exported, (exported, estimate)
    # tiny: the old flat values; small's tail (8.9M parameters, ~107 MB): 128 s per 64 MiB page, ~4 min in all.
    assert state_page_timeout_s(estimate) == STATE_PAGE_TIMEOUT_MIN_S
    assert default_sync_timeout_s(estimate) == STATE_SYNC_TIMEOUT_MIN_S
    tail = 8_915_456 * 12
    assert state_page_timeout_s(tail) == pytest.approx(PAGE_BYTES / STATE_MIN_RATE_BYTES_PER_S) == 128.0
    assert default_sync_timeout_s(tail) == pytest.approx(60 + tail / STATE_MIN_RATE_BYTES_PER_S)


def test_the_clip_wait_covers_the_slowest_stages_all_reduce():
    """Stages publish their gradient norms after their rounds: at 20 Mbit/s ``small``'s tail published 40 s after its
    round began, a flat 10 s wait expired at every step of stages 0 and 1, and they clipped by their own norms."""
    from agora.config import load_manifest
    from agora.model import count_parameters
    from agora.server.averaging.sync import (AVERAGING_MIN_RATE_BYTES_PER_S, CLIP_WAIT_MIN_S, SyncContext,
                                             default_clip_wait_s)

    tiny = count_parameters(load_manifest("tiny"))["per_stage"]
    small = count_parameters(load_manifest("small"))["per_stage"]
    assert default_clip_wait_s(tiny) == CLIP_WAIT_MIN_S == SyncContext.clip_wait_s
    assert default_clip_wait_s(small) == pytest.approx(max(small) * 8 / AVERAGING_MIN_RATE_BYTES_PER_S)
    assert 60 < default_clip_wait_s(small) < 80  # the tail's ~8.9M parameters: ~68 s, its averaging timeout
    assert default_clip_wait_s(small, averaging_timeout_s=30.0) == 30.0  # a node given a timeout: no longer
    assert default_clip_wait_s(small, averaging_timeout_s=300.0) == default_clip_wait_s(small)
    assert default_clip_wait_s(tiny, averaging_timeout_s=60.0) == CLIP_WAIT_MIN_S
