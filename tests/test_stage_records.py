"""The node's shared reads of stage records: fresh reads when asked, older ones served when allowed, one read for
callers that ask at the same moment, a failed read raised to each of them."""

from __future__ import annotations

import asyncio

from agora.net.records import PeerState, StageRecord
from agora.server.stage_records import StageRecords


def record(peer: str, stage: int) -> StageRecord:
    return StageRecord(peer_id=peer, stage=stage, state=PeerState.SERVING.value, manifest_hash="h")


class FakeDHT:
    def __init__(self):
        self.served = {0: [record("a", 0)], 1: [record("b", 1)]}
        self.reads: list[int] = []
        self.gate: asyncio.Event | None = None  # set: every read waits for it (reads that overlap)
        self.fail = False

    async def read(self, stage: int) -> list[StageRecord]:
        self.reads.append(stage)
        if self.gate is not None:
            await self.gate.wait()
        if self.fail:
            raise TimeoutError("the DHT did not answer")
        return list(self.served[stage])


def test_a_fresh_read_by_default_an_older_one_only_when_the_caller_allows_it():
    dht = FakeDHT()
    cache = StageRecords(dht.read)

    async def main():
        assert [r.peer_id for r in await cache.get(0)] == ["a"]
        dht.served[0] = [record("a", 0), record("c", 0)]
        # within the allowed age: what was read, without a DHT read
        assert [r.peer_id for r in await cache.get(0, max_age_s=60.0)] == ["a"]
        assert dht.reads == [0]
        # by default (or past the allowed age) it reads again, and later callers see that read
        assert [r.peer_id for r in await cache.get(0)] == ["a", "c"]
        assert [r.peer_id for r in await cache.get(0, max_age_s=60.0)] == ["a", "c"]
        await asyncio.sleep(0.02)
        assert len(await cache.get(0, max_age_s=0.01)) == 2 and dht.reads == [0, 0, 0]
        # stages are held apart; a stage never read is read even with a long allowed age
        assert [r.peer_id for r in await cache.get(1, max_age_s=60.0)] == ["b"]
        assert dht.reads == [0, 0, 0, 1] and (cache.reads, cache.requests) == (4, 6)
        assert cache.age_s(1) < 1.0 and cache.age_s(5) == float("inf")
        cache.forget()
        await cache.get(1, max_age_s=60.0)
        assert dht.reads[-1] == 1 and cache.reads == 5

    asyncio.run(main())


def test_callers_at_the_same_moment_share_one_read_and_a_cancelled_one_does_not_cancel_it():
    dht = FakeDHT()
    cache = StageRecords(dht.read)

    async def main():
        dht.gate = asyncio.Event()
        waiters = [asyncio.create_task(cache.get(0)) for _ in range(3)]
        quitter = asyncio.create_task(cache.get(0, max_age_s=5.0))
        await asyncio.sleep(0.02)
        quitter.cancel()
        await asyncio.sleep(0.02)
        dht.gate.set()
        results = await asyncio.gather(*waiters)
        assert dht.reads == [0] and all([r.peer_id for r in got] == ["a"] for got in results)
        # each caller gets its own list: one caller editing it changes nothing for the others
        results[0].clear()
        assert [r.peer_id for r in await cache.get(0, max_age_s=60.0)] == ["a"]

    asyncio.run(main())


def test_a_failed_read_reaches_every_caller_and_keeps_the_older_records():
    dht = FakeDHT()
    cache = StageRecords(dht.read)

    async def main():
        await cache.get(0)
        dht.fail, dht.gate = True, asyncio.Event()
        waiters = [asyncio.create_task(cache.get(0)) for _ in range(2)]
        await asyncio.sleep(0.02)
        dht.gate.set()
        for outcome in await asyncio.gather(*waiters, return_exceptions=True):
            assert isinstance(outcome, TimeoutError)
        assert dht.reads == [0, 0]
        # the records of the last good read are still served to a caller that accepts their age
        assert [r.peer_id for r in await cache.get(0, max_age_s=60.0)] == ["a"]
        dht.fail = False
        assert [r.peer_id for r in await cache.get(0)] == ["a"] and dht.reads == [0, 0, 0]

    asyncio.run(main())


def _rotations_of(monkeypatch, stage: int, served: dict[int, list[str]], drawer: str):
    """The rotation protocol of node "me" at ``stage`` (``tiny``), holding rotation 1 of boundary 0 drawn by
    ``drawer``, its records read through a ``StageRecords`` over a fake DHT serving ``served`` (stage -> peers), its
    pushes recorded instead of sent. Returns ``(protocol, records, fake DHT, peers pushed to)``."""
    import torch

    from agora.config import load_manifest
    from agora.model import Stage
    from agora.server import upm

    man = load_manifest("tiny").with_overrides(**{"security.upm": {"every_s": 3600.0}})
    dht = FakeDHT()
    dht.served = {s: [StageRecord(p, s, PeerState.SERVING.value, man.hash) for p in peers]
                  for s, peers in served.items()}
    cache = StageRecords(dht.read)
    ledger = upm.FrameLedger(Stage(man, stage))
    ledger.accept(upm.Rotation(0, 1, 0, torch.eye(ledger.width, dtype=torch.float64), drawer))
    sent: list[str] = []

    async def fake_call(p2p, peer, run_id, method, meta, tensors, timeout):
        sent.append(peer)
        return {"verdict": "accepted"}, []

    monkeypatch.setattr(upm.transport, "call", fake_call)
    monkeypatch.setattr(upm, "PUSH_EVERY_S", 0.0)
    hooks = upm.RotationHooks(peer_id="me", p2p=lambda: None, records=cache.get, run_io=None, run_compute=None,
                              ledger=lambda: ledger, stage=lambda: stage, step=lambda: 0, is_serving=lambda: True,
                              is_stopping=lambda: False, log_event=lambda *a, **k: None)
    return upm.Rotations(man, hooks), cache, dht, sent


def test_upm_reads_only_records_older_than_it_allows(monkeypatch):
    """The rotation protocol's reads go through the node's ``StageRecords``: records another part of the node read a
    moment ago (the replica sync its own stage, the next hop the next stage) cost the protocol no DHT read; records
    older than ``RECORDS_MAX_AGE_S`` are read again."""
    from agora.server import upm

    rotations, cache, dht, sent = _rotations_of(monkeypatch, 0, {0: ["me", "twin"], 1: ["next"]}, drawer="me")

    async def main():
        await cache.get(0)  # the replica sync's read of its stage
        await cache.get(1)  # the next hop's read of the next stage
        await rotations.tick()
        await asyncio.sleep(0.05)
        assert sorted(sent) == ["next", "twin"] and dht.reads == [0, 1]  # pushed to both, no read of its own
        monkeypatch.setattr(upm, "RECORDS_MAX_AGE_S", 0.01)
        await asyncio.sleep(0.05)
        await rotations.tick()
        assert sorted(dht.reads) == [0, 0, 1, 1]  # older than it allows now: read again

    asyncio.run(main())


def test_upm_reads_the_previous_stage_less_often_than_its_own(monkeypatch):
    """A node of stage 1 relays the rotations of boundary 0 to stage 0 as well. Nothing else in the node reads stage
    0, so those reads reach the DHT: they are made only when the view is older than ``PREVIOUS_STAGE_MAX_AGE_S``,
    while its own stage is read again past ``RECORDS_MAX_AGE_S``."""
    from agora.server import upm

    rotations, cache, dht, sent = _rotations_of(monkeypatch, 1, {0: ["drawer", "other"], 1: ["me", "twin"]},
                                                drawer="drawer")

    async def main():
        await rotations.tick()
        await asyncio.sleep(0.05)
        assert sorted(sent) == ["drawer", "other", "twin"] and sorted(dht.reads) == [0, 1]
        monkeypatch.setattr(upm, "RECORDS_MAX_AGE_S", 0.01)
        dht.served[0].append(StageRecord("joiner", 0, PeerState.SERVING.value, dht.served[0][0].manifest_hash))
        await asyncio.sleep(0.05)
        await rotations.tick()
        await asyncio.sleep(0.05)
        assert sorted(dht.reads) == [0, 1, 1]  # its own stage read again, the previous one not yet
        assert "joiner" not in sent
        monkeypatch.setattr(upm, "PREVIOUS_STAGE_MAX_AGE_S", 0.01)
        await rotations.tick()
        await asyncio.sleep(0.05)
        assert sorted(dht.reads) == [0, 0, 1, 1, 1] and "joiner" in sent

    asyncio.run(main())


def test_a_live_node_serves_the_protocols_reads_from_what_its_other_parts_read():
    """Two real nodes with UPM: the head's protocol asks for records every tick (pushing its rotation until the tail
    acknowledges, then relaying it) and the node's ``StageRecords`` answers part of those requests without a DHT
    read, because the protocol, the sync and the next hop share it."""
    from agora.config import load_manifest
    from agora.server.node import NodeOptions
    from swarm_util import local_swarm, wait_until

    man = load_manifest("tiny").with_overrides(**{"security.upm": {"every_s": 1.0, "lead_steps": 2}})

    async def main():
        async with local_swarm(man, [0, 1], NodeOptions(stall_step_s=1e9)) as (_boot, _peers, (head, tail)):
            await wait_until(lambda: tail.rotations.received >= 1, 60,
                             f"the tail to accept a rotation (head: {head.rotations.summary()})")
            await asyncio.sleep(2.0)
            return head.records

    records = asyncio.run(main())
    from_memory = records.requests - records.reads - records.joined
    assert from_memory > 0, (records.requests, records.reads, records.joined)
