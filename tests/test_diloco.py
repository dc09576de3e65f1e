"""``averaging.scheme: diloco``: the outer step's arithmetic, and two replicas of a live swarm.

What must hold: a replica's outer proposal is PyTorch's Nesterov SGD on the pseudo-gradient; averaging proposals is
DiLoCo's update with the averaged pseudo-gradient; in a live swarm the replicas differ between rounds and leave
every round bit-identical at exactly the outer step computed here from their inner-phase parameters (with H = 1,
outer lr 1 and momentum 0: the average of the replicas' parameters, i.e. per-step averaging); a joiner continues
the outer state; a replica whose partner leaves mid-round steps alone and trains on.
"""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from agora.config import ManifestError, load_manifest
from agora.net.dht import make_dht
from agora.optim.outer import nesterov_outer_step
from agora.server.averaging.diloco import MOMENTUM, OUTER
from agora.server.node import NodeOptions, StageNode
from swarm_util import feed_fake_gradients, local_swarm, train_in_waves, wait_until

BASE = load_manifest("tiny").with_overrides(**{"optimizer.warmup_steps": 0, "optimizer.lr": 0.01})
OPTS = NodeOptions(stall_step_s=1e9, averaging_timeout_s=15.0)


def _diloco(every: int, lr: float = 0.7, mu: float = 0.9):
    return BASE.with_overrides(averaging={"scheme": "diloco", "every": every, "outer_lr": lr, "outer_momentum": mu})


def test_outer_proposal_is_nesterov_sgd_on_the_pseudo_gradient():
    torch.manual_seed(0)
    outer = torch.randn(5, 3)
    param = torch.nn.Parameter(outer.clone())
    sgd = torch.optim.SGD([param], lr=0.7, momentum=0.9, nesterov=True)
    mine, momentum = outer.double(), torch.zeros(5, 3, dtype=torch.float64)
    for _ in range(4):
        local = mine.float() + 0.1 * torch.randn(5, 3)  # where an inner phase left this replica
        param.grad = (param.detach() - local).clone()  # the pseudo-gradient, as DiLoCo feeds its outer optimizer
        sgd.step()
        mine, momentum = nesterov_outer_step(mine.float(), momentum.float(), local, 0.7, 0.9)
        assert torch.allclose(mine, param.detach().double(), atol=1e-6)
        assert torch.allclose(momentum, sgd.state[param]["momentum_buffer"].double(), atol=1e-6)


def test_averaging_proposals_is_the_outer_step_on_the_averaged_pseudo_gradient():
    torch.manual_seed(1)
    outer, momentum = torch.randn(64), torch.randn(64)
    locals_, weights = [outer + 0.05 * torch.randn(64) for _ in range(3)], [1.0, 2.0, 5.0]
    proposals = [nesterov_outer_step(outer, momentum, x, 0.7, 0.9) for x in locals_]
    avg_outer = sum(w * p[0] for w, p in zip(weights, proposals)) / sum(weights)
    avg_momentum = sum(w * p[1] for w, p in zip(weights, proposals)) / sum(weights)
    mean_local = sum(w * x.double() for w, x in zip(weights, locals_)) / sum(weights)
    want_outer, want_momentum = nesterov_outer_step(outer, momentum, mean_local, 0.7, 0.9)
    assert torch.allclose(avg_outer, want_outer, atol=1e-12) and torch.allclose(avg_momentum, want_momentum, atol=1e-12)
    # H = 1, outer lr 1, no momentum: the proposal is the replica's own parameters (per-step parameter averaging).
    assert torch.equal(nesterov_outer_step(outer, momentum, locals_[0], 1.0, 0.0)[0].float(), locals_[0])


def test_diloco_settings_are_validated_and_other_schemes_keep_their_hash():
    assert _diloco(4).averaging.outer_lr == 0.7
    with pytest.raises(ManifestError, match="only apply to schemes 'diloco' and 'gossip'"):
        BASE.with_overrides(averaging={"scheme": "sparse", "outer_lr": 0.5})
    with pytest.raises(ManifestError, match="only applies to scheme 'sparse'"):
        BASE.with_overrides(averaging={"scheme": "diloco", "rho": 0.5})
    with pytest.raises(ManifestError, match="outer_momentum"):
        BASE.with_overrides(averaging={"scheme": "diloco", "outer_momentum": 1.0})
    # Fields added for DiLoCo must not change other schemes' manifest hashes (their checkpoints must still load).
    assert "outer_lr" not in BASE.with_overrides(averaging={"scheme": "sparse"}).canonical_json()
    assert "outer_lr" in _diloco(4).canonical_json()


def _phase_ends(nodes) -> dict[int, dict[str, list]]:
    """{step: {peer id: parameters}}: each replica's inner-phase end at every outer round, seen through the public
    observer hook."""
    ends: dict[int, dict[str, list]] = {}
    for node in nodes:
        node.observers.subscribe("outer_round_start", lambda step, params, pid=node.peer_id: ends.setdefault(
            step, {}).__setitem__(pid, [p.detach().clone() for p in params]))
    return ends


async def _see_each_other(nodes) -> None:
    deadline = time.monotonic() + 30
    while min([len(await x.sync.replicas()) for x in nodes]) < 1:
        assert time.monotonic() < deadline, "replicas never saw each other"
        await asyncio.sleep(0.2)


def _expected_outer(outer, momentum, ends, lr, mu):
    """Independently of the code under test: DiLoCo's outer Nesterov step on the replicas' mean pseudo-gradient
    (equal weights: every replica was fed the same number of samples), in float64."""
    new_outer, new_mom = [], []
    for i in range(len(outer)):
        d = sum(outer[i].double() - e[i].double() for e in ends) / len(ends)
        v = mu * momentum[i].double() + d
        new_mom.append(v)
        new_outer.append(outer[i].double() - lr * (d + mu * v))
    return new_outer, new_mom


@pytest.mark.parametrize("every,lr,mu", [(2, 0.7, 0.9), (1, 1.0, 0.0)], ids=["H2-nesterov", "H1-lr1-mom0"])
def test_replicas_differ_between_rounds_and_leave_each_round_identical_at_the_outer_step(every, lr, mu):
    man = _diloco(every, lr, mu)

    async def main():
        async with local_swarm(man, [0, 0], OPTS) as (boot, peers, nodes):
            a, b = nodes
            assert a.sync.scheme == b.sync.scheme == "diloco"
            ends = _phase_ends(nodes)
            await _see_each_other(nodes)
            outer = [t.clone() for t in a.sync.outer]
            momentum = [t.clone() for t in a.sync.momentum]
            assert all(torch.equal(x, y) for x, y in zip(outer, b.sync.outer))
            for step in range(1, 2 * every + 1):
                for i, x in enumerate(nodes):
                    await x.run_compute(feed_fake_gradients, x, 10 * step + i)
                await wait_until(lambda: a.step == b.step == step and a.sync.averaging_step == b.sync.averaging_step
                                 == -1 and a.sync.stepping is b.sync.stepping is False, 30, f"step {step}")
                pa, pb = list(a.stage.parameters()), list(b.stage.parameters())
                if step % every:
                    # Inside an inner phase: each replica stepped on its own gradients.
                    assert any(not torch.equal(x, y) for x, y in zip(pa, pb)), f"identical inside a phase ({step})"
                    continue
                assert set(ends[step]) == {a.peer_id, b.peer_id}
                want, want_mom = _expected_outer(outer, momentum, list(ends[step].values()), lr, mu)
                for name_p, x, y, w in zip(a.stage.named_parameters(), pa, pb, want):
                    assert torch.equal(x, y), f"step {step}: {name_p[0]} differs after the round"
                    assert torch.allclose(x.double(), w, atol=2e-6), f"step {step}: {name_p[0]} is not the outer step"
                for x, y, w in zip(a.sync.momentum, b.sync.momentum, want_mom):
                    assert torch.equal(x, y) and torch.allclose(x.double(), w, atol=2e-6), (
                        f"step {step}: momentum a-b {float((x - y).abs().max()):.3g}, a-want "
                        f"{float((x.double() - w).abs().max()):.3g}; rounds ok {a.sync.rounds_ok}/{b.sync.rounds_ok}"
                        f", alone {a.sync.outer_rounds_alone}/{b.sync.outer_rounds_alone}")
                if (lr, mu) == (1.0, 0.0):  # per-step averaging: the mean of the two replicas' parameters
                    mean = [(x.double() + y.double()) / 2 for x, y in zip(*ends[step].values())]
                    assert all(torch.allclose(x.double(), m, atol=1e-6) for x, m in zip(pa, mean))
                assert a.sync.fingerprint == b.sync.fingerprint
                outer = [t.clone() for t in a.sync.outer]
                momentum = [t.clone() for t in a.sync.momentum]

            # A joiner downloads a replica's state, outer state included, and continues its phase.
            dht = make_dht(peers, manifest=man)
            joiner = StageNode(man, 0, dht, OPTS)
            try:
                await joiner.start()
                joined = (joiner.step, [torch.equal(x, y) for x, y in zip(joiner.sync.outer, a.sync.outer)],
                          [torch.equal(x, y) for x, y in zip(joiner.sync.momentum, a.sync.momentum)],
                          sorted(joiner.runtime.sync_state) == sorted(a.runtime.sync_state))
            finally:
                await joiner.stop()
                dht.shutdown()
            return a, b, joined

    a, b, joined = asyncio.run(main())
    assert a.sync.rounds_ok == b.sync.rounds_ok == 2 and a.sync.outer_rounds_alone == b.sync.outer_rounds_alone == 0
    assert a.sync.resyncs == b.sync.resyncs == 0
    step, outer_same, momentum_same, names_same = joined
    assert step == 2 * every and all(outer_same) and all(momentum_same) and names_same
    assert any(n.startswith(OUTER) for n in a.runtime.sync_state) and any(n.startswith(MOMENTUM)
                                                                           for n in a.runtime.sync_state)
    # Measured on the wire: a round moves parameters and momentum in float64 (the two replicas together send the
    # payload once), twice a full round of the same stage.
    elements = sum(p.numel() for p in a.stage.parameters())
    assert [x + y for x, y in zip(a.sync.round_bytes, b.sync.round_bytes)] == [2 * 8 * elements] * 2


@pytest.mark.parametrize("codec", ["none", "float16"])
def test_a_replica_whose_partner_leaves_mid_round_steps_alone_and_trains_on(codec):
    man = _diloco(2).with_overrides(**{"averaging.codec": codec})  # float16: the rounds are compressed ones

    async def main():
        async with local_swarm(man, [0, 0], OPTS) as (boot, peers, nodes):
            a, b = nodes
            await _see_each_other(nodes)
            await a.run_compute(feed_fake_gradients, a, 1, 16)  # a alone holds the whole batch; b follows
            await wait_until(lambda: a.step == b.step == 1 and not a.sync.stepping, 30, "step 1 on both")
            # b stalls (its sync loop cannot take its lock) while a's outer round after step 2 waits for it, then
            # leaves: a must give up on it and take the outer step alone.
            async with b.sync.lock:
                await a.run_compute(feed_fake_gradients, a, 2, 16)
                await wait_until(lambda: a.sync.averaging_step == 2, 20, "a's outer round to start")
                await asyncio.sleep(2.5)
                assert a.sync.averaging_step == 2, "a's round ended although its partner never came"
                await b.stop()
            await wait_until(lambda: a.step == 2 and a.sync.averaging_step == -1 and not a.sync.stepping, 40,
                             "a's outer round to end")
            t0 = time.monotonic()
            for step in (3, 4):  # alone now: its next outer round does not wait for anyone
                await a.run_compute(feed_fake_gradients, a, step, 16)
                await wait_until(lambda: a.step == step and not a.sync.stepping, 20, f"a's step {step}")
            return a, time.monotonic() - t0

    a, alone_s = asyncio.run(main())
    assert a.step == 4 and a.sync.outer_rounds_alone == 2 and a.sync.rounds_ok == 0, (
        a.step, a.sync.outer_rounds_alone, a.sync.rounds_ok)
    assert a.sync.codec_at(2) is (codec != "none")
    assert all(float(r.abs().max()) == 0 for r in a.sync.residual)  # a lone step carries the residual whole
    assert alone_s < 10, f"two steps and an outer round alone took {alone_s:.1f}s"


def test_a_diloco_swarm_learns_through_a_pipeline_and_every_inner_step_is_a_new_version():
    man = _diloco(2)
    opts = NodeOptions(stall_step_s=1.0, averaging_timeout_s=10.0)

    async def main():
        async with local_swarm(man, [0, 0, 1], opts) as (boot, peers, nodes):
            heads = [n for n in nodes if n.stage_index == 0]
            versions = []
            losses = await train_in_waves(man, boot, nodes, 6,
                                          after_wave=lambda _: versions.append([h.runtime.version for h in heads]))
            return losses, heads, versions

    losses, heads, versions = asyncio.run(main())
    assert losses[1] < losses[0] - 0.5, losses
    assert all(h.sync.resyncs == 0 for h in heads), [h.sync.resyncs for h in heads]
    assert all(h.step >= 4 for h in heads) and all(h.sync.rounds_ok >= 1 for h in heads), [
        (h.step, h.sync.rounds_ok, h.sync.outer_rounds_alone) for h in heads]
    # Parameters a forward reads change at every inner step and every outer round: SENTINEL's audits and the
    # stages' weight snapshots key on this version.
    for i in range(2):
        assert all(later[i] > earlier[i] for earlier, later in zip(versions, versions[1:])), versions


def test_codec_settings_are_validated_and_leave_other_hashes_alone():
    assert _diloco(4).with_overrides(**{"averaging.codec": "uint8"}).averaging.resync_every == 8
    with pytest.raises(ManifestError, match="codec only applies to schemes 'diloco' and 'gossip'"):
        BASE.with_overrides(averaging={"scheme": "full", "codec": "float16"})
    with pytest.raises(ManifestError, match="resync_every only applies"):
        BASE.with_overrides(averaging={"scheme": "diloco", "resync_every": 4})
    gossip = BASE.with_overrides(averaging={"scheme": "gossip", "codec": "uint8", "resync_every": 4})
    assert gossip.averaging.codec == "uint8" and gossip.averaging.resync_every == 4
    with pytest.raises(ManifestError, match="resync_every only applies"):
        BASE.with_overrides(averaging={"scheme": "gossip", "resync_every": 4})
    with pytest.raises(ManifestError):
        BASE.with_overrides(averaging={"scheme": "diloco", "codec": "int4"})
    assert "codec" not in _diloco(4).canonical_json()  # the fields came later: DiLoCo manifests keep their hash
    coded = _diloco(4).with_overrides(**{"averaging.codec": "float16"})
    assert "codec" in coded.canonical_json() and coded.hash != _diloco(4).hash


@pytest.mark.parametrize("codec", ["float16", "uint8"])
def test_the_wire_codecs_round_trip_within_their_rounding_through_hivemind(codec):
    from hivemind.compression import CompressionInfo, deserialize_torch_tensor
    from agora.server.averaging.allreduce import MIN_QUANTIZED_VALUES, CountingCompression

    comp = CountingCompression(codec)
    torch.manual_seed(0)
    big = torch.randn(10_000) * 0.02 + 0.5
    for tensor in (big, torch.zeros(5000), torch.full((5000,), 3.0), torch.randn(10).double()):
        message = comp.compress(tensor, CompressionInfo.from_tensor(tensor))
        back = deserialize_torch_tensor(message)  # as the reducer decodes it: by the part's own type
        assert back.dtype == tensor.dtype and back.shape == tensor.shape
        if codec == "uint8" and tensor.numel() < MIN_QUANTIZED_VALUES:
            assert torch.equal(back, tensor)  # a small part goes uncompressed
        elif codec == "float16":
            assert torch.allclose(back, tensor, rtol=2 ** -10, atol=1e-7)
        elif float(tensor.std()) == 0:
            assert torch.equal(back, tensor)  # one bin, decoded to its mean: exact
        else:  # 256 bins over 6 standard deviations, each decoded to the mean of its values; beyond 3 the edge bins
            err, sigma = (back - tensor).abs(), float(tensor.std())  # hold the outliers, whose error is their excess
            inside = (tensor - tensor.mean()).abs() < 2.9 * sigma
            assert float(err.mean()) < 6 * sigma / 256 / 2 and float(err[inside].max()) <= 6 * sigma / 256
    # A payload the sender rounded itself (error feedback) crosses hivemind's parts, whatever their cut, unchanged.
    rounded = comp.roundtrip(big)
    for part in (rounded[:3000], rounded[3000:9000], rounded[9000:]):
        assert torch.equal(deserialize_torch_tensor(comp.compress(part, CompressionInfo.from_tensor(part))), part)
    per_value = {"float16": 2, "uint8": 1}[codec]
    assert len(comp.compress(big, CompressionInfo.from_tensor(big)).buffer) <= per_value * big.numel() + 1032


@pytest.mark.parametrize("codec", ["float16", "uint8"])
def test_compressed_rounds_step_on_the_averaged_pseudo_gradient_and_exact_rounds_reunite_the_replicas(codec):
    from agora.server.averaging.allreduce import CountingCompression

    lr, mu = 0.7, 0.9
    man = _diloco(1, lr, mu).with_overrides(**{"averaging.codec": codec, "averaging.resync_every": 3})
    rounding = CountingCompression(codec).roundtrip  # what a receiver decodes of a whole tensor

    async def main():
        async with local_swarm(man, [0, 0], OPTS) as (boot, peers, nodes):
            a, b = nodes
            ends = _phase_ends(nodes)
            await _see_each_other(nodes)
            state = {n.peer_id: ([t.clone() for t in n.sync.outer], [t.clone() for t in n.sync.momentum])
                     for n in nodes}
            residual = {n.peer_id: [torch.zeros_like(t) for t in n.sync.outer] for n in nodes}
            errors = []
            for step in range(1, 5):
                compressed = step % 3 != 0  # round k = step (every = 1); every 3rd round is exact
                assert a.sync.codec_at(step) is b.sync.codec_at(step) is compressed
                for i, x in enumerate(nodes):
                    await x.run_compute(feed_fake_gradients, x, 10 * step + i)
                await wait_until(lambda: a.step == b.step == step and a.sync.averaging_step == b.sync.averaging_step
                                 == -1 and a.sync.stepping is b.sync.stepping is False, 30, f"step {step}")
                if compressed:
                    # Each replica sends its pseudo-gradient plus its residual, rounded; keeps what rounding took.
                    sent = {}
                    for n in nodes:
                        outer = state[n.peer_id][0]
                        wanted = [o - e.float() + r for o, e, r in zip(outer, ends[step][n.peer_id],
                                                                        residual[n.peer_id])]
                        sent[n.peer_id] = [rounding(w) for w in wanted]
                        residual[n.peer_id] = [w - q for w, q in zip(wanted, sent[n.peer_id])]
                        got = [r.clone() for r in n.sync.residual]
                        assert all(torch.equal(g, r) for g, r in zip(got, residual[n.peer_id])), f"step {step}"
                    mean = [(x.double() + y.double()) / 2 for x, y in zip(*sent.values())]
                    for n in nodes:  # its own outer state, stepped on the mean of what was sent
                        outer, mom = state[n.peer_id]
                        want, _ = _expected_outer(outer, mom, [[o.double() - d for o, d in zip(outer, mean)]], lr, mu)
                        for p, w, d in zip(n.stage.parameters(), want, mean):
                            scale = float(d.abs().max()) or 1.0
                            errors.append(float((p.double() - w).abs().mean()) / scale)
                else:  # exact: the average of the proposals, residuals included, bit-identical on both
                    outer = [(x.double() + y.double()) / 2 for x, y in zip(state[a.peer_id][0], state[b.peer_id][0])]
                    mom = [(x.double() + y.double()) / 2 for x, y in zip(state[a.peer_id][1], state[b.peer_id][1])]
                    carried = [[e.double() - r.double() for e, r in zip(ends[step][n.peer_id], residual[n.peer_id])]
                               for n in nodes]
                    want, _ = _expected_outer(outer, mom, carried, lr, mu)
                    for x, y, w in zip(a.stage.parameters(), b.stage.parameters(), want):
                        assert torch.equal(x, y) and torch.allclose(x.double(), w, atol=2e-6), f"step {step}"
                    assert all(torch.equal(x, y) for x, y in zip(a.sync.momentum, b.sync.momentum))
                    assert a.sync.fingerprint == b.sync.fingerprint
                    assert all(float(r.abs().max()) == 0 for n in nodes for r in n.sync.residual)
                    residual = {n.peer_id: [torch.zeros_like(t) for t in n.sync.outer] for n in nodes}
                state = {n.peer_id: ([t.clone() for t in n.sync.outer], [t.clone() for t in n.sync.momentum])
                         for n in nodes}
            return a, b, errors

    a, b, errors = asyncio.run(main())
    # What is left is hivemind's answer to each member (the average minus its part), rounded again by the codec:
    # against the largest element of the averaged pseudo-gradient, on average per tensor. (Taking one replica's own
    # pseudo-gradient instead of the mean is off by ~lr (1 + mu) / 2 of it.)
    assert max(errors) < {"float16": 1e-3, "uint8": 1e-2}[codec], max(errors)
    for s in (a.sync, b.sync):
        assert s.rounds_ok == 4 and s.codec_rounds == 3 and s.outer_rounds_alone == 0
    elements = sum(p.numel() for p in a.stage.parameters())
    together = [x + y for x, y in zip(a.sync.round_bytes, b.sync.round_bytes)]
    assert together[2] == 2 * 8 * elements  # exact: parameters and momentum in float64
    bound = {"float16": 2 * elements, "uint8": 1.3 * elements}[codec]  # 2 B each, or 1 B + codebooks + small parts
    assert max(together[0], together[1], together[3]) <= bound, (together, elements)
