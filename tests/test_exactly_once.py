"""A retried training microbatch is accumulated once: the run in progress or its cached reply answers the retry."""

import asyncio

import pytest
import torch

from agora.config import load_manifest
from agora.net import transport
from agora.net.protocol import FWD_BWD
from agora.server.exactly_once import ExactlyOnce, microbatch_key
from swarm_util import local_swarm, wait_until

# No optimizer step during the test: every sample stays counted in the stages' accumulators.
MAN = load_manifest("tiny").with_overrides(**{"batch.target_batch_size": 4096})


def test_a_key_runs_once_even_when_its_first_caller_goes_away():
    async def main():
        once = ExactlyOnce()
        runs = []

        async def compute(tag: str):
            runs.append(tag)
            await asyncio.sleep(0.2)
            return {"tag": tag}, [torch.zeros(4)]

        first = asyncio.create_task(once.run(("peer", "a"), lambda: compute("first")))
        await asyncio.sleep(0.05)
        first.cancel()  # the caller's stream closed: its run goes on
        retry = await once.run(("peer", "a"), lambda: compute("retry"))  # waits for the run in progress
        again = await once.run(("peer", "a"), lambda: compute("again"))  # answered from the cache
        other = await once.run(("peer", "b"), lambda: compute("other"))
        unlabelled = [await once.run(None, lambda: compute("x")) for _ in range(2)]
        return runs, retry, again, other, unlabelled, once.duplicates

    runs, retry, again, other, unlabelled, duplicates = asyncio.run(main())
    assert runs == ["first", "other", "x", "x"]
    assert retry[0] == again[0] == {"tag": "first"} and other[0] == {"tag": "other"}
    assert duplicates == 2 and [u[0] for u in unlabelled] == [{"tag": "x"}] * 2


def test_a_failed_run_runs_again_and_the_cache_stays_within_its_bytes():
    async def main():
        once = ExactlyOnce(max_bytes=1000)
        calls = []

        async def failing():
            calls.append("fail")
            raise RuntimeError("downstream unreachable")

        async def big(i: int):
            calls.append(i)
            return {}, [torch.zeros(100)]  # 400 bytes

        with pytest.raises(RuntimeError):
            await once.run(("p", "f"), failing)
        await once.run(("p", "f"), lambda: big(0))  # nothing was kept of the failure: it runs
        for i in range(1, 5):
            await once.run(("p", str(i)), lambda i=i: big(i))
        await asyncio.sleep(0)
        return calls, once.bytes, list(once.done)

    calls, nbytes, kept = asyncio.run(main())
    assert calls == ["fail", 0, 1, 2, 3, 4]
    assert nbytes <= 1000 and kept == [("p", "3"), ("p", "4")]


def test_labels_are_bounded_strings():
    assert microbatch_key("peer", {"mb": "ab12"}) == ("peer", "ab12")
    assert microbatch_key("peer", {}) is None
    assert microbatch_key("peer", {"mb": 7}) is None and microbatch_key("peer", {"mb": "x" * 65}) is None


def test_a_stage_pipeline_accumulates_a_retried_microbatch_once():
    """A caller that gives up mid-way (its timeout) and retries the same labelled microbatch: each stage ran it
    once (samples counted once, one backward), and the retry's reply is the gradient of the one run."""

    async def main():
        async with local_swarm(MAN, [0, 1]) as (boot, peers, nodes):
            head, tail = nodes
            await wait_until(lambda: len(head.downstream.records) == 1, 30, "the head to see the tail")
            p2p = await boot.replicate_p2p()
            gen = torch.Generator().manual_seed(0)
            tokens = torch.randint(0, MAN.model.vocab_size, (4, MAN.model.seq_len), generator=gen, dtype=torch.int32)
            last = torch.randint(0, MAN.model.vocab_size, (4,), generator=gen, dtype=torch.int32)
            meta = {"run_id": MAN.run_id, "manifest_hash": MAN.hash, "stage": 0, "train": True, "mb": "retry-me"}
            with pytest.raises(transport.RpcError):
                await transport.call(p2p, head.peer_id, MAN.run_id, FWD_BWD, meta, [tokens, last], timeout=0.01)
            first, _ = await transport.call(p2p, head.peer_id, MAN.run_id, FWD_BWD, meta, [tokens, last], timeout=60)
            again, _ = await transport.call(p2p, head.peer_id, MAN.run_id, FWD_BWD, meta, [tokens, last], timeout=60)
            fresh, _ = await transport.call(p2p, head.peer_id, MAN.run_id, FWD_BWD, dict(meta, mb="another"),
                                            [tokens, last], timeout=60)
            return ([n.runtime.samples for n in nodes], [n.counters.backward for n in nodes], first, again, fresh,
                    head.handler.exactly_once.duplicates)

    samples, backward, first, again, fresh, duplicates = asyncio.run(main())
    assert samples == [8, 8] and backward == [2, 2]  # two distinct microbatches of 4, each once at each stage
    # The retry after the timeout found the run in progress, or its reply (or the timeout beat the request there).
    assert first["loss"] == again["loss"] == fresh["loss"] and duplicates in (1, 2)


def test_claims_and_points_of_no_return_let_one_of_a_hedged_pair_apply():
    once = ExactlyOnce()
    assert once.claim(("trainer", "a"))  # the hedge target claims first: granted...
    assert not once.pass_point(("trainer", "a"))  # ...and our run drops it; the claim is used up
    assert once.pass_point(("trainer", "a"))  # a later retry here runs
    assert not once.claim(("trainer", "a"))  # our run passed: a claim is refused
    assert once.pass_point(None)  # unlabelled requests are not tracked


def test_a_microbatch_hedged_between_two_replicas_is_applied_by_exactly_one():
    """The same labelled microbatch reaches two head replicas at once, the second as a hedge of the first
    (``hedge_of``): the hedge target claims it from the first before sending it downstream, so exactly one of them
    applies it, whichever gets there first (before claims, both did: 8 samples instead of 4). A hedge whose first
    peer no longer serves the stage goes on."""

    async def main():
        async with local_swarm(MAN, [0, 0, 1]) as (boot, peers, nodes):
            first, second, tail = nodes
            await wait_until(lambda: first.peer_id in second.sync.replica_ids and len(first.downstream.records) == 1
                             and len(second.downstream.records) == 1, 30, "the replicas and the tail to be seen")
            p2p = await boot.replicate_p2p()
            gen = torch.Generator().manual_seed(0)
            tokens = torch.randint(0, MAN.model.vocab_size, (4, MAN.model.seq_len), generator=gen, dtype=torch.int32)
            last = torch.randint(0, MAN.model.vocab_size, (4,), generator=gen, dtype=torch.int32)
            meta = {"run_id": MAN.run_id, "manifest_hash": MAN.hash, "stage": 0, "train": True, "mb": "hedged"}
            outcomes = await asyncio.gather(
                transport.call(p2p, first.peer_id, MAN.run_id, FWD_BWD, meta, [tokens, last], timeout=60),
                transport.call(p2p, second.peer_id, MAN.run_id, FWD_BWD, dict(meta, attempt=1, hedge_of=first.peer_id),
                               [tokens, last], timeout=60),
                return_exceptions=True)
            pair = ([n.runtime.samples for n in nodes], [not isinstance(o, BaseException) for o in outcomes],
                    [getattr(o, "code", None) for o in outcomes],
                    second.handler.claims_lost + first.handler.dropped, first.handler.claims_granted)
            # A hedge whose first peer is not a replica of the stage (it moved): the target applies it.
            alone = await transport.call(p2p, second.peer_id, MAN.run_id, FWD_BWD,
                                         dict(meta, mb="moved", attempt=1, hedge_of=tail.peer_id), [tokens, last],
                                         timeout=60)
            return pair, [n.runtime.samples for n in nodes], alone

    (samples, succeeded, codes, losers, granted), after, alone = asyncio.run(main())
    assert sum(samples[:2]) == 4 and samples[2] == 4, samples  # one application at each stage
    assert sorted(succeeded) == [False, True] and "leaving" in codes and losers == 1
    assert granted == (1 if succeeded[1] else 0)
    assert sum(after[:2]) == 8 and after[2] == 8 and alone[0]["loss"] is not None


def test_the_tail_replica_that_drops_a_hedged_microbatch_keeps_none_of_its_gradient():
    """At the tail the backward runs with the forward, before the point of no return. The replica that drops its
    copy of a hedged pair (its claim refused, or its run claimed away) must leave the parameters' accumulated
    gradient as it was: before 2026-12-05 it had already added it, so a swarm's step took the dropped copy's
    gradient too, uncounted (2 of 8 runs of a 3x2 swarm ended 0.1-0.4% apart in loss)."""
    from agora.server.observers import Observers
    from agora.server.runtime import Counters, StageRuntime

    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, MAN.model.vocab_size, (4, MAN.model.seq_len), generator=gen, dtype=torch.int32)
    last = torch.randint(0, MAN.model.vocab_size, (4,), generator=gen, dtype=torch.int32)
    head = StageRuntime(MAN, 0, Counters(), Observers())
    pending, _ = head.forward([tokens, last], False, head.generation)
    boundary = head.boundary(pending)
    sent = [boundary.coords, boundary.tokens, last]
    reference = StageRuntime(MAN, 1, Counters(), Observers())
    expected_upstream = reference.finish_tail(reference.forward(sent, True, reference.generation)[0])
    expected = [p.grad.clone() for p in reference.stage.parameters()]

    async def main():
        async with local_swarm(MAN, [0, 1, 1]) as (boot, peers, nodes):
            _, first, second = nodes
            await wait_until(lambda: first.peer_id in second.sync.replica_ids, 30,
                             "the tail replicas to see each other")
            p2p = await boot.replicate_p2p()
            meta = {"run_id": MAN.run_id, "manifest_hash": MAN.hash, "stage": 1, "train": True, "mb": "hedged-tail"}
            outcomes = await asyncio.gather(
                transport.call(p2p, first.peer_id, MAN.run_id, FWD_BWD, meta, sent, timeout=60),
                transport.call(p2p, second.peer_id, MAN.run_id, FWD_BWD, dict(meta, attempt=1, hedge_of=first.peer_id),
                               sent, timeout=60),
                return_exceptions=True)
            grads = [[None if p.grad is None else p.grad.clone() for p in n.runtime.stage.parameters()]
                     for n in (first, second)]
            return outcomes, [n.runtime.samples for n in (first, second)], grads

    outcomes, samples, grads = asyncio.run(main())
    won = [not isinstance(o, BaseException) for o in outcomes]
    assert sorted(won) == [False, True], outcomes
    winner, loser = (0, 1) if won[0] else (1, 0)
    assert samples[winner] == 4 and samples[loser] == 0, samples
    assert all(g is None for g in grads[loser]), "the replica that dropped the microbatch kept its gradient"
    assert all(torch.equal(g, e) for g, e in zip(grads[winner], expected))
    assert torch.equal(outcomes[winner][1][0], expected_upstream)
