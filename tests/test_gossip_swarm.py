"""``averaging.scheme: gossip`` in a live swarm: two replicas of one stage, pairwise exchanges through hivemind.

What must hold, checked against values computed here from the replicas' inner-phase parameters: with q = 0 nothing
is exchanged at a phase end (zero blocking bytes) and the next phase end steps from the Mix1-averaged start; with
q = 1 the Mix2 pair average leaves both replicas at the mean of their outer steps; a replica whose partner left
keeps training on its own.
"""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from agora.config import load_manifest
from agora.server.node import NodeOptions
from swarm_util import feed_fake_gradients, local_swarm, wait_until

BASE = load_manifest("tiny").with_overrides(**{"optimizer.warmup_steps": 0, "optimizer.lr": 0.01})
OPTS = NodeOptions(stall_step_s=1e9, averaging_timeout_s=15.0)
LR, MU = 0.7, 0.9


def _gossip(q: int, codec: str = "none", resync_every: int = 8):
    extra = {"resync_every": resync_every} if codec != "none" else {}
    return BASE.with_overrides(averaging={"scheme": "gossip", "every": 2, "q": q, "codec": codec, **extra})


async def _see_each_other(nodes) -> None:
    deadline = time.monotonic() + 30
    while min([len(await x.sync.replicas()) for x in nodes]) < 1:
        assert time.monotonic() < deadline, "replicas never saw each other"
        await asyncio.sleep(0.2)


def _own_step(start, mixed_start, momentum, end):
    """One replica's outer step from a (mixed) start on its own pseudo-gradient, in float64: (new, momentum)."""
    delta = start.double() - end.double()
    v = MU * momentum + delta
    return mixed_start.double() - LR * (delta + MU * v), v


@pytest.mark.parametrize("q,codec,resync_every", [(0, "none", 8), (1, "none", 8), (1, "float16", 8),
                                                   (1, "uint8", 8), (1, "uint8", 2)])
def test_gossip_mixes_phase_starts_in_the_background_and_pairs_at_the_phase_end(q, codec, resync_every):
    man = _gossip(q, codec, resync_every)
    # With a codec a pair exchanges its difference from a reference both hold, compressed: each end lands off the
    # exact average by the codec's rounding of that difference (float16: 2^-11 of it, relative; uint8: 256 bins over
    # 6 standard deviations, the few elements beyond 3 clamped; measured 1.3e-2 of the largest difference here).
    rounding = {"none": 0.0, "float16": 2 ** -11, "uint8": 0.05}[codec]
    # resync_every 2: the exchanges of round 2 (the phase end at step 4, the Mix1 after it) are exact and become the
    # pair's reference; round 3's (step 6) are differences from it, compressed
    steps = 6 if resync_every == 2 else 4

    async def main():
        async with local_swarm(man, [0, 0], OPTS) as (boot, peers, nodes):
            a, b = nodes
            assert a.sync.scheme == "gossip" and a.sync.q == q
            ends: dict[int, dict[str, list]] = {}
            for node in nodes:
                node.observers.subscribe("outer_round_start", lambda step, params, pid=node.peer_id: ends.setdefault(
                    step, {}).__setitem__(pid, [p.detach().clone() for p in params]))
            await _see_each_other(nodes)
            starts = {n.peer_id: [t.clone() for t in n.sync.outer] for n in nodes}
            seed = [t.double() for t in a.sync.outer]  # the common start: the codec's reference
            momenta = {n.peer_id: [torch.zeros_like(t, dtype=torch.float64) for t in n.sync.outer] for n in nodes}
            seen, errors, scales = [], [], []
            for step in range(1, steps + 1):
                for i, x in enumerate(nodes):
                    await x.run_compute(feed_fake_gradients, x, 10 * step + i)
                await wait_until(lambda: a.step == b.step == step and not a.sync.stepping and not b.sync.stepping,
                                 40, f"step {step}")
                if step % 2:
                    continue
                if step > 2:  # Mix1 of the phase that started at step - 2 averaged the two starts
                    mixed = [(x.double() + y.double()) / 2 for x, y in zip(*starts.values())]
                else:
                    mixed = None  # the first phase starts from the seed's weights: nothing to mix
                want = {}
                for pid in starts:
                    base = mixed if mixed is not None else [t.double() for t in starts[pid]]
                    pairs = [_own_step(s, m, u, e) for s, m, u, e in zip(starts[pid], base, momenta[pid],
                                                                          ends[step][pid])]
                    want[pid] = [p[0] for p in pairs]
                    momenta[pid] = [p[1] for p in pairs]
                if q == 1:  # Mix2 with two replicas: one pair average of the two outer steps
                    mean = [(x + y) / 2 for x, y in zip(*want.values())]
                    want = {pid: mean for pid in want}
                for n in nodes:
                    got = [p.detach().double() for p in n.stage.parameters()]
                    off = [float((g - w).abs().max()) / max(1e-12, float((w - r).abs().max()))
                           for g, w, r in zip(got, want[n.peer_id], seed)]
                    errors.append(max(off))
                    assert all(torch.allclose(g, w, atol=3e-6 + 2 * rounding * float((w - r).abs().max()))
                               for g, w, r in zip(got, want[n.peer_id], seed)), (step, q, off)
                    assert all(torch.allclose(m.double(), w, atol=3e-6) for m, w in zip(n.sync.momentum,
                                                                                          momenta[n.peer_id]))
                starts = {n.peer_id: [t.clone() for t in n.sync.outer] for n in nodes}
                seen.append(max(float((x - y).abs().max()) for x, y in zip(a.stage.parameters(),
                                                                             b.stage.parameters())))
                scales.append(max(float((w - r).abs().max()) for w, r in zip(want[a.peer_id], seed)))
            await wait_until(lambda: all(n.sync._mix1_task.done() for n in nodes), 30, "the last Mix1")
            if codec == "uint8":  # the counters reach the summary and /metrics
                from agora.ops.metrics import NodeCollector
                from agora.roles import node_summary
                summary = node_summary(a)
                assert summary["gossip_exchanges_compressed"] == a.sync.exchanges_compressed > 0
                assert summary["gossip_reference_mismatches"] == 0
                families = {f.name: f for f in NodeCollector(a).collect()}
                assert families["agora_gossip_exchanges_compressed"].samples[0].value == a.sync.exchanges_compressed
            return a, b, seen, errors, scales

    a, b, seen, errors, scales = asyncio.run(main())
    print(f"largest distance from the exact average, relative to the largest difference from the start: "
          f"{max(errors):.2e}; pair distances {seen}")
    exact = 2 if resync_every == 2 else 0  # round 2's Mix2 and Mix1
    for s in (a.sync, b.sync):
        assert s.rounds_ok == steps // 2 and s.exchanges_failed == 0 and s.resyncs == 0
        # every other exchange is a compressed one, from the common start or the pair's last exact exchange
        assert s.exchanges_compressed == (s.exchanges_ok - exact if codec != "none" else 0)
        assert s.reference_mismatches == 0
        if exact:  # round 2's Mix1 renewed the pair's reference, named by its label and both members
            (partner, (name, _, since)), = s._references.items()
            assert partner == (b if s is a.sync else a).peer_id and since == 2
            assert name == f"mix1-4|{min(a.peer_id, b.peer_id)}|{max(a.peer_id, b.peer_id)}"
        assert s.background_bytes > 0  # Mix1 of the second and third phases
        if q == 0:
            assert s.blocking_bytes == 0  # nothing on the wire at a phase end
        else:
            assert s.blocking_bytes > 0
    if q == 0:
        assert all(d > 0 for d in seen)  # each replica stepped on its own pseudo-gradient
    elif codec == "none":
        assert all(d < 1e-5 for d in seen)  # the pair average leaves them (all but) equal
    else:
        # equal but for the codec's rounding of each end's difference from the start
        assert all(d <= 2 * rounding * scale + 1e-5 for d, scale in zip(seen, scales)), (seen, scales)
    if q == 1:  # each phase end: one pair exchange (each replica sends half), float32, float16 or uint8
        elements = sum(p.numel() for p in a.stage.parameters())
        sent = a.sync.blocking_bytes + b.sync.blocking_bytes
        if codec == "uint8":  # 1 byte per value, plus a 1 KiB codebook per part and small parts in float32
            # two Mix2 exchanges compressed (both ends together send the vector once per exchange), and with
            # resync_every 2 round 2's Mix2 in float32
            float32 = 4 * elements if exact else 0
            assert 2 * elements + float32 <= sent <= 2 * elements * 1.35 + float32, (sent, elements)
            if exact:
                assert seen[1] < 1e-5  # the exact exchange leaves the pair (all but) equal
        else:
            assert sent == 2 * elements * (2 if codec == "float16" else 4)


def test_a_gossip_replica_whose_partner_left_keeps_training():
    man = _gossip(1)

    async def main():
        async with local_swarm(man, [0, 0], OPTS) as (boot, peers, nodes):
            a, b = nodes
            await _see_each_other(nodes)
            await a.run_compute(feed_fake_gradients, a, 1, 16)
            await wait_until(lambda: a.step == b.step == 1 and not a.sync.stepping, 30, "step 1 on both")
            await b.stop()
            t0 = time.monotonic()
            for step in (2, 3, 4):  # phase ends at 2 and 4: exchanges with a partner that is gone
                await a.run_compute(feed_fake_gradients, a, step, 16)
                await wait_until(lambda: a.step == step and not a.sync.stepping, 40, f"a's step {step}")
            return a, time.monotonic() - t0

    a, seconds = asyncio.run(main())
    assert a.step == 4 and a.sync.rounds_ok == 2 and a.sync.outer_rounds_alone == 2, (a.step, a.sync.rounds_ok)
    assert seconds < 30, f"three steps and two phase ends without the partner took {seconds:.0f}s"


def test_an_exchange_gives_up_as_soon_as_its_partner_is_gone():
    """A pairwise exchange knows its one partner: once that partner's record is gone (or not serving) the wait
    ends within about a second or two, not at the averaging timeout, even while other replicas of the phase live."""
    from types import SimpleNamespace

    from agora.server.averaging.sync import ReplicaSync

    class NeverDone:
        began_allreduce = False
        cancelled = False

        def done(self):
            return self.cancelled

        def cancel(self):
            self.cancelled = True

    checks = []

    async def partner_alive():
        checks.append(time.monotonic())
        return len(checks) < 2  # alive at the first check, gone at the second

    fake = SimpleNamespace(ctx=SimpleNamespace(stage_index=0), aborted_rounds=0)
    control = NeverDone()
    t0 = time.monotonic()
    result = asyncio.run(ReplicaSync._await_round(fake, control, None, 60.0, alive=partner_alive))
    assert result is None and control.cancelled and fake.aborted_rounds == 1
    assert len(checks) == 2 and time.monotonic() - t0 < 5.0


def test_which_reference_an_exchange_sends_its_difference_from():
    """With a codec: the pair's own reference, else the common start, and none (an exact exchange) every
    ``resync_every``-th round, once the reference is ``resync_every`` rounds old, after a failed or mismatched
    exchange with that partner, and without a codec."""
    from types import SimpleNamespace

    from agora.server.averaging.gossip import GossipSync

    start = ("start:1.0", [torch.zeros(2)], 0)
    fake = SimpleNamespace(codec="uint8", resync_every=4, _references={}, _no_start=set(), _start_reference=start)
    ref = lambda partner, round_index: GossipSync._reference_for(fake, partner, round_index)  # noqa: E731
    assert ref("p", 1) is start and ref("p", 4) is None and ref("p", 0) is None  # rounds 0, 4, 8...: exact
    assert ref("p", 5) is None  # the start is 5 rounds old: a pair that missed round 4 renews its reference now
    fake._references["p"] = ("mix2-16-0-0|a|p", [torch.ones(2)], 8)
    assert ref("p", 9)[0] == "mix2-16-0-0|a|p" and ref("q", 9) is None  # q: only the (too old) start in common
    assert ref("p", 11) is not None and ref("p", 13) is None  # exact rounds at 12; by age at 13 as well
    GossipSync._forget_reference(fake, "p")
    assert ref("p", 9) is None and ref("q", 2) is start  # p's next exchange is exact; q keeps the common start
    fake._references["q"] = ("mix1-16|a|q", [torch.ones(2)], 8)
    GossipSync._prune_references(fake, ["me", "p"], 2)  # q left: its copy of the parameters goes
    assert "q" not in fake._references and fake._start_reference is start
    GossipSync._prune_references(fake, ["me", "p"], 4)  # the start is too old for any exchange from round 4 on
    assert fake._start_reference is None
    fake.codec = "none"
    assert ref("q", 2) is None


def test_the_start_reference_names_the_weights_it_holds():
    from agora.server.averaging.sync import tensors_fingerprint

    weights = [torch.randn(3, 4, generator=torch.Generator().manual_seed(0)), torch.ones(5)]
    same = [t.clone() for t in weights]
    moved = [t.clone() for t in weights]
    moved[0][1, 2] += 1e-6
    assert tensors_fingerprint(weights) == tensors_fingerprint(same) != tensors_fingerprint(moved)
    assert tensors_fingerprint(weights) != tensors_fingerprint(weights[::-1])  # order matters
