"""A dense run's rotation (float64 d x d) reaches the other stage even when it is larger than the incoming-request
budget that the run's ``fwd_bwd`` requests alone would give a node (two of the largest, at least 4 MiB)."""

from __future__ import annotations

import asyncio

from agora.config import load_manifest
from agora.net.admission import MIN_BUDGET_BYTES
from agora.server.handler import largest_request_bytes
from agora.server.node import NodeOptions
from agora.server.stage_records import StageRecords
from agora.server.upm import push_timeout_s, rotation_bytes
from swarm_util import local_swarm, wait_until


def _dense(d_model: int):
    return load_manifest("tiny").with_overrides(**{
        "model.d_model": d_model, "model.ffn_dim": 64, "model.vocab_size": 512, "model.seq_len": 16,
        "residual.mode": "dense", "security.upm": {"every_s": 1.0, "lead_steps": 2}})


def test_rotation_size_and_push_deadline():
    man = _dense(1024)
    assert rotation_bytes(man) == 8 * 1024 * 1024
    assert rotation_bytes(load_manifest("tiny")) == 0  # no UPM, no rotations
    assert rotation_bytes(load_manifest("tiny").with_overrides(**{"security.upm": {"every_s": 5.0}})) == 8 * 8 * 8
    # A 128 MiB rotation (d = 4096) at the slowest rate a server tolerates (64 KiB/s) takes 2048 s: the sender waits.
    assert push_timeout_s(128 * 2**20) >= 2048 and push_timeout_s(0) > 0


def test_a_dense_rotation_larger_than_the_request_budget_reaches_the_next_stage():
    man = _dense(1024)
    assert rotation_bytes(man) > max(2 * largest_request_bytes(man), MIN_BUDGET_BYTES)  # the case under test

    async def main():
        async with local_swarm(man, [0, 1], NodeOptions(stall_step_s=1e9)) as (_boot, _peers, (head, tail)):
            # No training needed: the head draws boundary 0's first rotation every_s after it serves and pushes it.
            await wait_until(lambda: tail.rotations.received >= 1, 60,
                             f"the tail to accept a rotation (head: {head.rotations.summary()}, "
                             f"tail: {tail.rotations.summary()})")
            return head.rotations.summary(), tail.rotations.summary(), tail.incoming.snapshot()

    head, tail, incoming = asyncio.run(main())
    assert head["drawn"] >= 1 and tail["refused"] == 0
    assert [d[:2] for d in tail["due"]] == [[0, 1]], tail


def test_a_stuck_transfer_never_holds_the_push_loop_nor_gets_a_later_frame_in_parallel(monkeypatch):
    """``Rotations._push`` starts one task per peer and returns: a peer that never answers (frozen, or a slow link
    carrying a large dense rotation) neither delays the others nor gets a second copy in parallel, nor the next frame
    of the boundary before it acknowledged this one (it would refuse it: ``not_ready``). Leaving the relay window
    (``tests/test_upm_relay.py``) cancels the transfer."""
    import torch

    from agora.net.records import PeerState, StageRecord
    from agora.server import upm

    man = _dense(64)
    records = {s: [StageRecord(p, s, PeerState.SERVING.value, man.hash) for p in peers]
               for s, peers in ((0, ["me", "slow"]), (1, ["fast"]))}
    calls: list[tuple[str, int]] = []
    cancelled: list[int] = []

    async def fake_call(p2p, peer, run_id, method, meta, tensors, timeout):
        calls.append((peer, meta["epoch"]))
        assert timeout >= upm.push_timeout_s(8 * 64 * 64)
        if peer == "slow":
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                cancelled.append(meta["epoch"])
                raise
        return {"verdict": "accepted"}, []

    monkeypatch.setattr(upm.transport, "call", fake_call)

    async def read(stage):
        return records[stage]

    hooks = upm.RotationHooks(peer_id="me", p2p=lambda: None, records=StageRecords(read).get, run_io=None,
                              run_compute=None,
                              ledger=lambda: None, stage=lambda: 0, step=lambda: 0, is_serving=lambda: True,
                              is_stopping=lambda: False, log_event=lambda *a, **k: None)
    rotations = upm.Rotations(man, hooks)
    r = torch.eye(64, dtype=torch.float64)

    async def main():
        first = upm.Rotation(0, 1, 5, r, "me")
        await asyncio.wait_for(rotations._push(first), 1.0)  # returns at once although "slow" never answers
        await asyncio.sleep(0.1)
        pushes = rotations._pushes[(0, 1)]
        assert pushes.acked == {"fast"} and set(pushes.sending) == {"slow"}
        # a later tick: no second transfer to a peer with one in progress, none to an acked one
        await rotations._push(first)
        await asyncio.sleep(0.1)
        assert sorted(calls) == [("fast", 1), ("slow", 1)], calls
        await rotations._push(upm.Rotation(0, 2, 9, r, "me"))  # the next frame: to the peer that has the first
        await asyncio.sleep(0.1)
        assert sorted(calls) == [("fast", 1), ("fast", 2), ("slow", 1)], calls
        assert cancelled == [] and set(rotations._pushes[(0, 1)].sending) == {"slow"}
        for pushes in rotations._pushes.values():
            pushes.cancel()
        await asyncio.sleep(0.1)
        assert cancelled == [1]

    asyncio.run(main())
