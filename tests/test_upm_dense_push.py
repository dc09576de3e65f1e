"""A dense run's rotation (float64 d x d) reaches the other stage even when it is larger than the incoming-request
budget that the run's ``fwd_bwd`` requests alone would give a node (two of the largest, at least 4 MiB)."""

from __future__ import annotations

import asyncio

from agora.config import load_manifest
from agora.net.admission import MIN_BUDGET_BYTES
from agora.server.handler import largest_request_bytes
from agora.server.node import NodeOptions
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
