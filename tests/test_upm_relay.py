"""A rotation reaches a replica of the other stage even when it was applied before that replica was in anybody's
view (server/upm.py, ``FrameLedger.relayable``). CI once failed so: stage 1's drawer read stage 2's records before
stage 2 served, pushed R to its own replica only, both applied it a step later, and stage 2 refused every message of
the new frame (``frame_unknown``) for good, since only rotations still due were pushed."""

from __future__ import annotations

import asyncio
import time

import torch

from agora.config import load_manifest
from agora.model import Stage
from agora.net.records import PeerState, StageRecord
from agora.net.transport import RpcError
from agora.server import upm
from agora.server.stage_records import StageRecords


def test_an_applied_rotation_still_reaches_a_replica_that_joined_the_view_late_one_frame_at_a_time(monkeypatch):
    man = load_manifest("tiny").with_overrides(stages=[1, 1, 2], **{"security.upm": {"every_s": 1.0}})
    ledger = upm.FrameLedger(Stage(man, 1))
    assert ledger.sides() == [0, 1]  # stage 1 draws for boundary 1 (its output), stage 2 is on its far side

    def recs(stage, *peers):
        return [StageRecord(p, stage, PeerState.SERVING.value, man.hash) for p in peers]

    records = {0: [], 1: recs(1, "a", "b"), 2: []}  # stage 2 is not in the DHT yet when "a" draws
    calls: list[tuple[str, int]] = []
    epochs = {"b": 0, "c": 0, "d": 0}  # what each receiver holds of boundary 1
    refusing = {"d"}  # a receiver that cannot take a rotation for a while (busy, unreachable)

    async def fake_call(p2p, peer, run_id, method, meta, tensors, timeout):
        calls.append((peer, meta["epoch"]))
        if peer in refusing:
            raise RpcError("unavailable", "busy")
        held = epochs[peer]
        if meta["epoch"] > held + 1:
            raise RpcError("not_ready", f"at frame {held}")
        if meta["epoch"] <= held:
            return {"verdict": "applied"}, []
        epochs[peer] = meta["epoch"]
        return {"verdict": "accepted"}, []

    async def read(stage):
        return list(records[stage])

    cache = StageRecords(read)

    async def run_compute(fn, *args):
        return fn(*args)

    monkeypatch.setattr(upm.transport, "call", fake_call)
    monkeypatch.setattr(upm, "PUSH_EVERY_S", 0.0)
    step = [3]
    hooks = upm.RotationHooks(peer_id="a", p2p=lambda: None, records=cache.get, run_io=None,
                              run_compute=run_compute,
                              ledger=lambda: ledger, stage=lambda: 1, step=lambda: step[0], is_serving=lambda: True,
                              is_stopping=lambda: False, log_event=lambda *a, **k: None)
    rotations = upm.Rotations(man, hooks)

    async def tick():
        cache.forget()  # every tick reads the records afresh (the cache's age is not under test)
        await rotations.tick()
        await asyncio.sleep(0.05)  # the transfers are tasks of their own

    async def draw_and_apply():
        rotations._last_drawn[1] = time.monotonic() - 10  # every_s has passed
        await tick()
        rot = ledger.pending()[-1]
        step[0] = rot.apply_step
        ledger.apply_due(rot.apply_step, {})
        return rot

    async def main():
        first = await draw_and_apply()
        assert first.epoch == 1 and ledger.epoch_out == 1 and not ledger.pending()
        assert calls == [("b", 1)] and epochs["b"] == 1  # only its own replica was in view
        records[2] = recs(2, "c", "d")  # stage 2 serves now
        await tick()
        assert epochs["c"] == 1, calls  # applied here already, yet sent: c can convert the new frame's messages
        assert ("d", 1) in calls and epochs["d"] == 0
        # The next frame goes to every peer that has the first, never to d before d has acknowledged the first.
        calls.clear()
        second = await draw_and_apply()
        await tick()
        assert second.epoch == 2 and epochs["b"] == epochs["c"] == 2
        assert ("d", 2) not in calls and ("d", 1) in calls, calls
        refusing.clear()
        await tick()
        assert epochs["d"] == 1
        await tick()
        assert epochs["d"] == 2, calls
        # Acknowledged everywhere: nothing more is sent; and a frame RELAY_EPOCHS behind leaves the window.
        calls.clear()
        await tick()
        assert calls == []
        for _ in range(upm.RELAY_EPOCHS):
            await draw_and_apply()
        await tick()
        assert min(e for _, e in rotations._pushes) == ledger.epoch_out - upm.RELAY_EPOCHS + 1
        assert [r.epoch for r in ledger.relayable()] == list(range(ledger.epoch_out - upm.RELAY_EPOCHS + 1,
                                                                    ledger.epoch_out + 1))
        for pushes in rotations._pushes.values():
            pushes.cancel()

    asyncio.run(main())
