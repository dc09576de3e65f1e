"""The tied-embedding exchange asks another replica of the other end when the first one is frozen (offline)."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import torch

from agora.config import load_manifest
from agora.model import Stage
from agora.net import transport
from agora.net.records import StageRecord
from agora.net.transport import RpcError
from agora.server.averaging.tied import HEDGE_MIN_S, TiedExchange
from agora.server.stage_records import StageRecords

MAN = load_manifest("tiny").with_overrides(**{
    "residual.mode": "dense", "residual.k": None, "residual.wire_dtype": "fp32", "model.tie_embeddings": True,
    "stages": [2, 2]})


def _exchange(peers: list[str]) -> TiedExchange:
    records = [StageRecord(peer_id=p, stage=1, state="serving", manifest_hash=MAN.hash) for p in peers]

    async def read(stage):  # the records of the other end, whatever is read
        return records

    ctx = SimpleNamespace(manifest=MAN, runtime=SimpleNamespace(stage=Stage(MAN, 0)), stage_index=0, p2p=None,
                          dht=None, records=StageRecords(read), is_serving=lambda: True, averaging_timeout_s=20.0)
    return TiedExchange(ctx)


def test_a_frozen_replica_of_the_other_end_does_not_hold_the_step(monkeypatch):
    exchange = _exchange(["frozen", "live"])
    theirs = torch.full(exchange.shape, 0.5)
    asked: list[str] = []

    async def fake_call(p2p, peer_id, namespace, name, meta, tensors, timeout, stats=None):
        asked.append(peer_id)
        if peer_id == "frozen":
            await asyncio.sleep(timeout)  # never answers: the call ends at its timeout
            raise RpcError(transport.TIMEOUT, "no reply")
        start, stop = meta["rows"]
        return {"step": meta["step"]}, [theirs[start:stop].clone()]

    monkeypatch.setattr(transport, "call", fake_call)
    monkeypatch.setattr("random.shuffle", lambda peers: peers.sort())  # "frozen" is asked first
    ours = [torch.ones(exchange.shape) if i == exchange.index else torch.zeros(1) for i in range(exchange.index + 1)]
    t0 = time.monotonic()
    out = asyncio.run(exchange.offer_and_fetch(7, ours))
    took = time.monotonic() - t0
    assert torch.equal(out[exchange.index], torch.full(exchange.shape, 1.5))
    assert HEDGE_MIN_S <= took < HEDGE_MIN_S + 2.0, took  # before the fix: the whole 40 s deadline
    assert asked[0] == "frozen" and "live" in asked and exchange.hedged == 1 and exchange.exchanged == 1


def test_replicas_that_have_not_averaged_yet_are_asked_again_until_one_has(monkeypatch):
    exchange = _exchange(["a", "b"])
    answers = {"a": 3, "b": 5}  # each says not_ready this many times

    async def fake_call(p2p, peer_id, namespace, name, meta, tensors, timeout, stats=None):
        if answers[peer_id] > 0:
            answers[peer_id] -= 1
            raise RpcError("not_ready", "not averaged yet")
        start, stop = meta["rows"]
        return {"step": meta["step"]}, [torch.zeros(stop - start, exchange.shape[1])]

    monkeypatch.setattr(transport, "call", fake_call)
    got = asyncio.run(exchange._fetch(3, deadline=time.monotonic() + 10.0))
    assert got is not None and tuple(got.shape) == exchange.shape and exchange.hedged == 0
