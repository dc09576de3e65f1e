"""The one retry loop (``client/router.py``) and a runtime's refusal of work from a stage it left, offline."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from agora.client.router import Router, RouterOptions
from agora.config import load_manifest
from agora.net import transport
from agora.net.protocol import OVER_SHARE, held_seconds
from agora.net.records import StageRecord
from agora.net.transport import RpcError
from agora.server.observers import Observers
from agora.server.runtime import Counters, StageRuntime

MAN = load_manifest("tiny")


def _record(peer: str, throughput: float = 100.0) -> StageRecord:
    return StageRecord(peer_id=peer, stage=1, state="serving", manifest_hash=MAN.hash, throughput=throughput)


class _Stage:
    """A PeerSource with fixed records; counts refreshes."""

    def __init__(self, peers: list[str]):
        self.records = [_record(p) for p in peers]
        self.refreshes = 0

    def candidates(self):
        return self.records

    async def refresh(self):
        self.refreshes += 1


def _router(peers: list[str], **options) -> tuple[Router, _Stage]:
    stage = _Stage(peers)
    opts = RouterOptions(**{"max_retries": 2, "backoff_s": 0.0, "wait_for_peers_s": 0.2, **options})
    return Router(None, MAN.run_id, 1, stage, opts), stage


@pytest.fixture
def replies(monkeypatch):
    """Scripted replies per peer: an RpcError code raises it, anything else is returned as the reply meta."""
    script: dict[str, list] = {}
    calls: list[str] = []

    async def fake_call(p2p, peer_id, namespace, name, meta, tensors, timeout, stats=None):
        calls.append(peer_id)
        outcome = script[peer_id].pop(0) if len(script[peer_id]) > 1 else script[peer_id][0]
        if isinstance(outcome, str):
            raise RpcError(outcome, f"{peer_id} says {outcome}")
        return outcome, []

    monkeypatch.setattr(transport, "call", fake_call)
    return script, calls


def test_a_failing_peer_is_banned_and_another_replica_serves(replies):
    script, calls = replies
    script.update({"a": [transport.UNREACHABLE], "b": [{"loss": 1.0}]})
    router, stage = _router(["a", "b"])
    stage.records[0].throughput = 1e6  # "a" is the fastest: it is picked first
    counted = {"retry": 0, "failure": 0}

    async def main():
        return await router.call({}, [], on_retry=lambda: counted.__setitem__("retry", counted["retry"] + 1),
                                 on_failure=lambda: counted.__setitem__("failure", counted["failure"] + 1))

    peer, (meta, _) = asyncio.run(main())
    assert calls == ["a", "b"] and peer.peer_id == "b" and meta == {"loss": 1.0}
    assert router.acks == {"b": 1} and router.bans.banned("a") and not router.bans.banned("b")
    assert counted == {"retry": 1, "failure": 1} and router.errors == {transport.UNREACHABLE: 1}


def test_an_error_no_replica_can_fix_is_raised_at_once(replies):
    script, calls = replies
    script.update({"a": ["shape_mismatch"]})
    router, _ = _router(["a"])
    with pytest.raises(RpcError) as err:
        asyncio.run(router.call({}, []))
    assert err.value.code == "shape_mismatch" and calls == ["a"]


def test_retries_are_bounded(replies):
    script, calls = replies
    script.update({"a": ["leaving"], "b": [transport.TIMEOUT]})
    router, _ = _router(["a", "b"], max_retries=2)
    failures = []
    with pytest.raises(RpcError) as err:
        asyncio.run(router.call({}, [], on_failure=lambda: failures.append(1)))
    assert err.value.code == "retries_exhausted"
    assert len(calls) == 3 and len(failures) == 3  # max_retries + 1 attempts, each one counted
    assert not router.bans.banned("a") and router.bans.banned("b")  # leaving is healthy; a timeout is not


def test_a_refused_reply_is_retried_on_another_replica(replies):
    script, calls = replies
    script.update({"a": [{"from": "a"}], "b": [{"from": "b"}]})
    router, _ = _router(["a", "b"])

    async def refuse_a(peer, reply):
        return peer.peer_id != "a"

    peer, (meta, _) = asyncio.run(router.call({}, [], accept=refuse_a))
    assert peer.peer_id == "b" and meta == {"from": "b"} and router.acks == {"b": 1}


def test_an_empty_stage_is_waited_for_then_given_up(replies):
    router, stage = _router([])
    with pytest.raises(RpcError) as err:
        asyncio.run(router.call({}, []))
    assert err.value.code == "no_peers" and stage.refreshes >= 1
    stopped_router, stopped_stage = _router([], wait_for_peers_s=60.0)
    with pytest.raises(RpcError):
        asyncio.run(stopped_router.call({}, [], stopped=lambda: True))  # a leaving node stops waiting at once
    assert stopped_stage.refreshes == 0


def test_a_retired_runtime_refuses_microbatches_of_the_stage_it_left():
    """A stage move retires the runtime: a backward arriving for a forward it computed answers ``leaving`` (the
    caller retries elsewhere) instead of training a runtime nobody serves; so does one from before a failed move
    that reactivated it."""
    rt = StageRuntime(MAN, 0, Counters(), Observers())
    tokens = torch.randint(0, MAN.model.vocab_size, (2, 16), dtype=torch.int32)
    pending, _ = rt.forward([tokens, tokens[:, -1]], train=True, generation=rt.generation)
    grad = torch.randn(2, 16, MAN.residual.k)
    rt.retire()
    with pytest.raises(RpcError) as err:
        rt.backward(pending, grad)
    assert err.value.code == "leaving"
    rt.activate(7)  # back to this stage after a failed move
    with pytest.raises(RpcError):
        rt.backward(pending, grad)
    fresh, _ = rt.forward([tokens, tokens[:, -1]], train=True, generation=rt.generation)
    assert rt.backward(fresh, grad) is None and rt.samples == 2  # the head returns no gradient; samples count


def test_a_broken_stream_is_retried_once_on_the_same_peer_then_elsewhere(replies):
    """The peer may have run the request before its stream broke: calling it again lets it answer from that run
    (server/exactly_once.py) instead of another replica accumulating the microbatch a second time."""
    script, calls = replies
    script.update({"a": [transport.CONNECTION_LOST, {"from": "a"}], "b": [{"from": "b"}]})
    router, stage = _router(["a", "b"])
    stage.records[0].throughput = 1e6
    peer, (meta, _) = asyncio.run(router.call({}, []))
    assert calls == ["a", "a"] and meta == {"from": "a"}

    calls.clear()
    script.update({"a": [transport.CONNECTION_LOST], "b": [{"from": "b"}]})
    router, stage = _router(["a", "b"])
    stage.records[0].throughput = 1e6
    peer, (meta, _) = asyncio.run(router.call({}, []))
    assert calls == ["a", "a", "b"] and meta == {"from": "b"}


def test_with_every_peer_tried_it_waits_for_the_records_to_change_before_calling_one_again(replies):
    """A killed replica's record outlives it by up to its TTL: retries spent at once on it (and on a replica that
    refused for a moment) would abandon the microbatch. With ``fallback_wait_s`` the router re-reads the records
    until the stage's peers change, then calls the best of those left."""
    script, calls = replies
    script.update({"a": [transport.UNREACHABLE], "b": ["batch_full", {"from": "b"}]})
    router, stage = _router(["a", "b"], max_retries=3, fallback_wait_s=5.0)
    stage.records[0].throughput = 1e6  # the dead "a" looks fastest: without the wait it is called again
    dead = stage.records[0]

    async def expire_a():
        stage.refreshes += 1
        if stage.refreshes == 3:
            stage.records.remove(dead)

    stage.refresh = expire_a
    peer, (meta, _) = asyncio.run(router.call({}, []))
    assert calls == ["a", "b", "b"] and meta == {"from": "b"} and stage.refreshes == 3

    # Nothing changes: it waits out ``fallback_wait_s`` once per retry, then calls a tried peer anyway (bounded).
    calls.clear()
    script.update({"a": [transport.UNREACHABLE], "b": ["batch_full"]})
    router, stage = _router(["a", "b"], max_retries=2, fallback_wait_s=0.6)
    t0 = time.monotonic()
    with pytest.raises(RpcError) as err:
        asyncio.run(router.call({}, []))
    assert err.value.code == "retries_exhausted" and len(calls) == 3 and time.monotonic() - t0 >= 0.6


@pytest.fixture
def slow_replies(monkeypatch):
    """Per peer: (delay in seconds, outcome). Records calls and which of them were cancelled."""
    script: dict[str, tuple[float, object]] = {}
    calls: list[str] = []
    cancelled: list[str] = []

    async def fake_call(p2p, peer_id, namespace, name, meta, tensors, timeout, stats=None):
        calls.append(peer_id)
        delay, outcome = script[peer_id]
        try:
            await asyncio.sleep(delay)
        except asyncio.CancelledError:
            cancelled.append(peer_id)
            raise
        if isinstance(outcome, str):
            raise RpcError(outcome, f"{peer_id} says {outcome}")
        return outcome, []

    monkeypatch.setattr(transport, "call", fake_call)
    return script, calls, cancelled


def test_a_slow_call_is_hedged_to_another_replica_and_the_first_answer_wins(slow_replies):
    """A frozen replica: past ``hedge_factor`` x its typical latency (at least ``hedge_min_s``) the call also goes to
    another replica; its answer wins, the frozen one's call is cancelled and the frozen peer is routed around."""
    script, calls, cancelled = slow_replies
    script.update({"a": (30.0, {"from": "a"}), "b": (0.01, {"from": "b"})})
    router, stage = _router(["a", "b"], hedge_factor=4.0, hedge_min_s=0.2, timeout_s=30.0)
    stage.records[0].throughput = 1e6  # "a" is picked first
    router.latency.update({"a": 0.01})  # it used to answer in 10 ms: hedged after max(0.2, 0.04) s
    t0 = time.monotonic()
    peer, (meta, _) = asyncio.run(router.call({}, []))
    took = time.monotonic() - t0
    assert peer.peer_id == "b" and meta == {"from": "b"} and calls == ["a", "b"] and cancelled == ["a"]
    assert 0.2 <= took < 2.0 and router.hedges == router.hedges_won == 1
    assert router.bans.banned("a") and router.acks == {"b": 1}


def test_a_call_answered_in_time_is_not_hedged_and_an_unmeasured_stage_is_never_hedged(slow_replies):
    script, calls, cancelled = slow_replies
    script.update({"a": (0.05, {"from": "a"}), "b": (0.01, {"from": "b"})})
    router, stage = _router(["a", "b"], hedge_factor=4.0, hedge_min_s=0.5)
    stage.records[0].throughput = 1e6
    assert router.hedge_after("a") is None  # nothing measured yet: the call waits for its timeout as before
    peer, _ = asyncio.run(router.call({}, []))
    assert peer.peer_id == "a" and router.hedge_after("a") == 0.5 and router.hedge_after("b") == 0.5
    peer, _ = asyncio.run(router.call({}, []))
    assert peer.peer_id == "a" and calls == ["a", "a"] and router.hedges == 0 and cancelled == []
    off, _ = _router(["a"], hedge_factor=0.0)
    off.latency["a"] = 0.01
    assert off.hedge_after("a") is None


def test_a_hedged_call_whose_first_peer_answers_first_lifts_its_ban_and_both_failing_fails_the_attempt(slow_replies):
    script, calls, cancelled = slow_replies
    script.update({"a": (0.4, {"from": "a"}), "b": (5.0, {"from": "b"})})
    router, stage = _router(["a", "b"], hedge_factor=1.0, hedge_min_s=0.1)
    stage.records[0].throughput = 1e6
    router.latency["a"] = 0.1
    peer, _ = asyncio.run(router.call({}, []))
    assert peer.peer_id == "a" and calls == ["a", "b"] and cancelled == ["b"]
    assert router.hedges == 1 and router.hedges_won == 0 and not router.bans.banned("a")

    calls.clear()
    script.update({"a": (0.3, transport.TIMEOUT), "b": (0.05, "not_serving")})
    router, stage = _router(["a", "b"], max_retries=0, hedge_factor=1.0, hedge_min_s=0.1)
    stage.records[0].throughput = 1e6
    router.latency["a"] = 0.1
    with pytest.raises(RpcError) as err:
        asyncio.run(router.call({}, []))
    assert err.value.code == "retries_exhausted" and calls == ["a", "b"]
    assert router.errors == {"not_serving": 1, transport.TIMEOUT: 1}


def test_a_call_sent_on_by_a_replica_holding_its_share_is_hedged_back_to_it_as_a_retry(monkeypatch):
    """Replica "a" held its share of the batch and sent the microbatch on (``over_share``); the only other replica,
    "b", is frozen. The hedge goes back to "a" (a redirect is no failure) as a retry, which "a" takes; without
    that the call waited for the frozen peer's full timeout."""
    calls: list[tuple[str, int]] = []
    hedge_of: list = []

    async def fake_call(p2p, peer_id, namespace, name, meta, tensors, timeout, stats=None):
        calls.append((peer_id, meta["attempt"]))
        hedge_of.append(meta.get("hedge_of"))
        if peer_id == "b":
            await asyncio.sleep(30.0)
        if meta["attempt"] == 0:
            raise RpcError(OVER_SHARE, "a holds its share")
        return {"from": peer_id}, []

    monkeypatch.setattr(transport, "call", fake_call)
    router, stage = _router(["a", "b"], hedge_factor=4.0, hedge_min_s=0.2, timeout_s=30.0)
    stage.records[0].throughput = 1e6  # "a" is picked first
    router.latency.update({"a": 0.01, "b": 0.01})
    t0 = time.monotonic()
    peer, (meta, _) = asyncio.run(router.call({}, []))
    assert peer.peer_id == "a" and meta == {"from": "a"} and time.monotonic() - t0 < 2.0
    assert calls == [("a", 0), ("b", 1), ("a", 1)] and router.hedges == router.hedges_won == 1
    assert hedge_of == [None, None, "b"]  # the hedge target claims the microbatch from the peer called first


def test_time_a_reply_says_it_was_held_for_a_batch_is_not_latency(monkeypatch):
    """A peer whose calls waited 5 s for its stage's round still hedges after its working time: a frozen peer
    otherwise stalled its callers for the whole timeout (4 x a latency inflated by holds)."""

    async def fake_call(p2p, peer_id, namespace, name, meta, tensors, timeout, stats=None):
        await asyncio.sleep(0.3)
        return {"held_s": 0.25}, []

    monkeypatch.setattr(transport, "call", fake_call)
    router, _ = _router(["a"], hedge_factor=4.0, hedge_min_s=0.1)
    asyncio.run(router.call({}, []))
    assert router.latency["a"] < 0.15 and router.hedge_after("a") < 0.6
    assert held_seconds({"held_s": -1}) == held_seconds({"held_s": "x"}) == held_seconds({}) == 0.0
    assert held_seconds({"held_s": True}) == 0.0 and held_seconds({"held_s": 2}) == 2.0
