"""Averaging schemes in a live swarm: two replicas of the head stage with ``averaging.scheme: powersgd``.

What must hold: the replicas step together through real (two-phase) PowerSGD rounds, end every step with
bit-identical parameters, the loss goes down, and each round puts fewer all-reduce bytes on the wire than a full
round of the same stage (measured by the averager's byte counter, not computed).
"""

import asyncio
import contextlib
import time

import pytest
import torch

from agora.config import load_manifest
from agora.server.node import NodeOptions
from agora.client.trainer import Trainer
from swarm_util import feed_fake_gradients, local_swarm, random_batches, train_in_waves, wait_until

BASE = load_manifest("tiny").with_overrides(**{"optimizer.warmup_steps": 0, "optimizer.lr": 0.01})
POWERSGD = BASE.with_overrides(**{"averaging.scheme": "powersgd", "averaging.rank": 2, "averaging.dense_steps": 0})
# the first step a full round in the dense averager, PowerSGD rounds after it
POWERSGD_DENSE_FIRST = POWERSGD.with_overrides(**{"averaging.dense_steps": 1})
OPTS = NodeOptions(stall_step_s=1e9, averaging_timeout_s=15.0)


def _batches(man, n, b=4, seed=0):
    return random_batches(man.model.vocab_size, man.model.seq_len, n, b, seed)


_wait = wait_until


async def _train(man, steps: int, check_each_step=None):
    """Layout [0, 0, 1]: the head stage has two replicas that must average. Returns (losses, replicas). A run during
    which hivemind cut an all-reduce short and a check failed is run again by tests/conftest.py (docs/TESTING.md)."""
    async with local_swarm(man, [0, 0, 1], OPTS) as (boot, peers, nodes):
        trainer = Trainer(man, boot, shard=None)
        await trainer.start()
        try:  # closed on every way out: a run that is retried must not leave its trainer's I/O threads behind
            await _wait(lambda: len(trainer.swarm[0]) == 2 and len(trainer.swarm[1]) == 1, 30, "all peers to announce")
            heads = [n for n in nodes if n.stage_index == 0]
            data = _batches(man, 4)  # one step = 4 microbatches of 4 = target_batch_size 16, the same data every step
            val = data[:2]
            losses = [await trainer.evaluate(val)]
            for step in range(1, steps + 1):
                sent = await asyncio.gather(*(trainer.send(b) for b in data))
                assert all(x is not None for x in sent), sent
                await _wait(lambda: all(n.step >= step and n.runtime.samples == 0 for n in nodes), 40, f"step {step}")
                if check_each_step is not None:
                    await check_each_step(heads, step)
            losses.append(await trainer.evaluate(val))
            return losses, heads
        finally:
            trainer.close()


async def _identical(heads, step):
    a, b = heads
    assert a.step == b.step == step, (a.step, b.step)
    # The step counter moves inside the compute thread's step, before the fingerprint of its result is set: wait
    # for the step to be complete on both.
    await _wait(lambda: a.sync.fingerprint_step == b.sync.fingerprint_step == step, 10, f"step {step} to complete")
    for (name, pa), pb in zip(a.stage.named_parameters(), b.stage.parameters()):
        assert torch.equal(pa, pb), f"step {step}: {name} differs by {(pa - pb).abs().max().item():.3g}"
    assert a.sync.fingerprint == b.sync.fingerprint


FAILED_STEP = 3  # the round of this step fails on both replicas (as when matchmaking finds no group in time)


async def _check_and_break_a_round(heads, step):
    await _identical(heads, step)
    if step == FAILED_STEP - 1:
        entered: list = []
        both_in = asyncio.Event()
        for h in heads:
            real = h.sync._average

            async def fail_once(samples, grads, sync=h.sync, real=real):
                # A round that fails for the whole group, like a matchmaking timeout: every member is in it (so
                # none sees the other step first and follows by download), then it ends without a result.
                sync._average = real
                await sync.ctx.run_compute(sync._load_buffers, grads, sync.ctx.runtime.step)  # payload built, then lost
                entered.append(sync)
                if len(entered) == len(heads):
                    both_in.set()
                await asyncio.wait_for(both_in.wait(), 20)
                return None

            h.sync._average = fail_once
    if step == FAILED_STEP:
        # Both replicas stepped with a zero update and kept G + E in their error buffers: still identical (checked
        # above) without a state download, and nothing of the gradient was dropped.
        # The local step is counted on the event loop just after the compute thread set the step's fingerprint.
        await _wait(lambda: all(h.sync.local_steps >= 1 for h in heads), 10, "the local step to be counted")
        for h in heads:
            assert h.sync.local_steps == 1 and h.sync.resyncs == 0
            errors = [e for e in h.sync.psgd.errors if e is not None]
            assert len(errors) == len(h.sync.psgd.compressed) and all(e.abs().sum() > 0 for e in errors)


def test_a_failed_dense_round_is_a_zero_step_whose_gradient_the_compressed_rounds_deliver():
    """``dense_steps`` 3: steps 1 and 2 are full rounds, step 3's full round fails on both replicas, step 4 is the
    first PowerSGD round. The failed dense round fails as a compressed one does: a zero step with ``G`` kept in the
    error buffer (checked at step 3 by ``_check_and_break_a_round``), so the replicas stay bit-identical without a
    state download (which over a link too slow for a dense round would be slower still)."""
    man = POWERSGD.with_overrides(**{"averaging.dense_steps": FAILED_STEP})
    losses, heads = asyncio.run(_train(man, steps=4, check_each_step=_check_and_break_a_round))
    elements = sum(p.numel() for p in heads[0].stage.parameters())
    for h in heads:
        assert h.sync.rounds_ok == 3 and h.sync.rounds_failed == 1, (h.sync.rounds_ok, h.sync.rounds_failed)
        assert h.sync.local_steps == 1 and h.sync.resyncs == 0 and h.sync.dense is None
    rounds = [a + b for a, b in zip(heads[0].sync.round_bytes, heads[1].sync.round_bytes)]
    assert rounds == [8 * elements] * 2 + [8 * heads[0].sync.psgd.numel_sent()], rounds
    assert losses[1] < losses[0] - 0.5, losses


def test_periodic_dense_rounds_deliver_the_error_buffer_and_keep_replicas_identical():
    """``dense_every`` 2 (no dense first steps): rounds at steps 0 and 2 (0-based) average ``G + E`` in full and empty
    the error buffers, steps 1 and 3 are PowerSGD rounds that fill them again. Measured by the averager's bytes, so a
    scheme that skipped the dense rounds, or ran every round dense, fails; the dense averager stays up."""
    man = POWERSGD.with_overrides(**{"averaging.dense_every": 2})
    seen: dict[int, list[bool]] = {}

    async def check(heads, step):
        await _identical(heads, step)
        seen[step] = [all(e is None for e in h.sync.psgd.errors) for h in heads]

    losses, heads = asyncio.run(_train(man, steps=4, check_each_step=check))
    # after steps 1 and 3 (dense rounds) nothing is left in the error buffers; after 2 and 4 (rank 2) there is
    assert seen == {1: [True, True], 2: [False, False], 3: [True, True], 4: [False, False]}, seen
    elements = sum(p.numel() for p in heads[0].stage.parameters())
    rounds = [a + b for a, b in zip(heads[0].sync.round_bytes, heads[1].sync.round_bytes)]
    compressed = 8 * heads[0].sync.psgd.numel_sent()
    assert rounds == [8 * elements, compressed] * 2, (rounds, elements, compressed)
    for h in heads:
        assert h.sync.rounds_ok == 4 and h.sync.rounds_failed == 0 and h.sync.resyncs == 0
        assert h.sync.dense is not None  # it serves every dense_every-th step: not shut down
    assert losses[1] < losses[0] - 0.5, losses


def test_powersgd_replicas_stay_bit_identical_learn_and_send_less_than_full():
    t0 = time.monotonic()
    losses, heads = asyncio.run(_train(POWERSGD_DENSE_FIRST, steps=4, check_each_step=_check_and_break_a_round))
    psgd_s = time.monotonic() - t0
    for h in heads:
        # step 1 a full round (dense_steps 1), steps 2 and 4 real two-replica PowerSGD rounds, step 3's round
        # failed; no repair by state download was ever needed
        assert h.sync.scheme == "powersgd" and h.sync.rounds_ok == 3, (h.sync.rounds_ok, h.sync.rounds_failed)
        assert h.sync.rounds_failed == 1 and h.sync.local_steps == 1 and h.sync.resyncs == 0
        assert any(e is not None and e.abs().sum() > 0 for e in h.sync.psgd.errors)  # error feedback is live
        assert h.sync.dense is None  # past its dense steps, the dense averager is shut down
    assert losses[1] < losses[0] - 0.5, losses

    full_losses, full_heads = asyncio.run(_train(BASE, steps=1))
    # In a group of two each replica sends the other the part of the payload that the other reduces, so per round
    # the two replicas together send exactly the payload once: 8 bytes x every gradient element for full, 8 bytes x
    # (P + Q + passthrough elements) for PowerSGD. Measured by the averager's serializer, so a scheme that silently
    # fell back to full rounds (or sent nothing) fails here.
    elements = sum(p.numel() for p in heads[0].stage.parameters())
    psgd_rounds = [a + b for a, b in zip(heads[0].sync.round_bytes, heads[1].sync.round_bytes)]
    full_rounds = [a + b for a, b in zip(full_heads[0].sync.round_bytes, full_heads[1].sync.round_bytes)]
    assert len(psgd_rounds) == 3 and len(full_rounds) == 1, (psgd_rounds, full_rounds)
    assert full_rounds == [8 * elements], (full_rounds, elements)
    # the dense first round moved what a full round moves, the compressed ones P, Q and the passthrough tensors
    assert psgd_rounds == [8 * elements] + [8 * heads[0].sync.psgd.numel_sent()] * 2, psgd_rounds
    assert psgd_rounds[1] * 4 < full_rounds[0], (psgd_rounds, full_rounds)
    print(f"all-reduce bytes per round (both replicas): full {full_rounds[0]}, powersgd rank 2 {psgd_rounds[1]} "
          f"({full_rounds[0] / psgd_rounds[1]:.1f}x less); powersgd run {psgd_s:.0f}s, losses {losses}")


def test_powersgd_replica_stuck_inside_the_allreduce_then_killed(monkeypatch):
    """Three head replicas; one joins the PowerSGD group and then never delivers (its all-reduce hangs) and is
    killed. The two others still step within the round's bounds and end with bit-identical parameters: a round
    cut short leaves P or Q partly un-averaged, replicas then differ and adopt one state (error buffers reset)."""
    from hivemind.averaging.allreduce import AllReduceRunner
    from hivemind.averaging.control import AveragingStage

    from agora.server.node import StageNode
    from agora.net.dht import make_dht, visible_maddrs

    opts = NodeOptions(stall_step_s=1e9, averaging_timeout_s=12.0, hop_timeout_s=10.0)

    async def stuck(self):  # the victim's all-reduce: joined the group, never delivers
        await asyncio.sleep(3600)
        yield

    async def main():
        boot = make_dht()
        dhts, nodes = [boot], []

        async def add(stage):
            dht = make_dht(visible_maddrs(boot))
            dhts.append(dht)
            node = StageNode(POWERSGD, stage, dht, opts)
            nodes.append(node)
            await node.start()
            return node

        try:
            survivors = [await add(0), await add(0)]
            monkeypatch.setattr(AllReduceRunner, "run", stuck)  # inherited by the victim's forked averager only
            victim = await add(0)
            monkeypatch.undo()
            await add(1)
            trainer = Trainer(POWERSGD, boot, shard=None)
            await trainer.start()
            await _wait(lambda: len(trainer.swarm[0]) == 3 and len(trainer.swarm[1]) == 1, 30, "all peers")
            assert all(x is not None for x in await asyncio.gather(*(trainer.send(b) for b in _batches(POWERSGD, 4))))

            def victim_in_allreduce():
                ctl = victim.sync.control
                return ctl is not None and ctl.stage == AveragingStage.RUNNING_ALLREDUCE

            await _wait(victim_in_allreduce, 40, "the victim to be inside the all-reduce")
            await asyncio.sleep(0.5)
            for task in [*victim._tasks, victim._sync_task]:  # abrupt death: no leave, connections break
                task.cancel()
            victim.dht.shutdown()
            victim.sync.shutdown()
            nodes.remove(victim)
            t_crash = time.monotonic()
            await _wait(lambda: all(n.step >= 1 for n in survivors), 2 * opts.averaging_timeout_s + 15,
                        "the survivors to step")
            stepped_after = time.monotonic() - t_crash
            await _wait(lambda: survivors[0].step == survivors[1].step and all(
                torch.equal(a, b) for a, b in zip(survivors[0].stage.parameters(), survivors[1].stage.parameters())),
                40, "the survivors to agree")
            trainer.close()
            return stepped_after, survivors
        finally:
            for node in nodes:
                with contextlib.suppress(Exception):
                    await node.stop()
            for dht in dhts:
                with contextlib.suppress(Exception):
                    dht.shutdown()

    # Bounded: main() already failed if the survivors had not stepped within 2 x averaging timeout + 15 s.
    stepped_after, survivors = asyncio.run(main())
    # The broken round was noticed: a survivor's round failed (zero step) or their results differed (state adopted).
    assert sum(s.sync.rounds_failed + s.sync.resyncs for s in survivors) >= 1
    print(f"survivors stepped {stepped_after:.1f}s after the crash; rounds ok/failed/resyncs: "
          f"{[(s.sync.rounds_ok, s.sync.rounds_failed, s.sync.resyncs) for s in survivors]}")


# ------------------------------------------------------------------------------------------------ sparse (SPARTA)

SPARSE = BASE.with_overrides(**{"averaging": {"scheme": "sparse", "rho": 0.5, "every": 2}})


def _state(node) -> dict:
    out = {}
    for name, p in node.stage.named_parameters():
        st = node.runtime.optimizer.state[p]
        out[name] = [p.detach().reshape(-1).clone(), st["exp_avg"].reshape(-1).clone(),
                     st["exp_avg_sq"].reshape(-1).clone()]
    return out


def _assert_slice_averaged(a, b, part):
    """On ``part`` the replicas agree (the round wrote the same average on both); elsewhere they still differ."""
    sa, sb = _state(a), _state(b)
    for name in sa:
        idx = a.sync.sparse.partition.indices(name, part)
        rest = torch.ones(sa[name][0].numel(), dtype=torch.bool)
        rest[idx] = False
        for kind, (ta, tb) in enumerate(zip(sa[name], sb[name])):
            torch.testing.assert_close(ta[idx], tb[idx], rtol=1e-6, atol=0, msg=f"{name}[{kind}] on the slice")
            if kind < 2 and rest.any():  # (v of a parameter can coincide where both gradients were tiny)
                assert not torch.equal(ta[rest], tb[rest]), f"{name}[{kind}] off the slice should still differ"


def test_sparse_replicas_step_on_own_gradients_and_average_a_seeded_slice_in_the_background():
    async def main():
        async with local_swarm(SPARSE, [0, 0], OPTS) as (boot, peers, nodes):
            a, b = nodes
            assert a.sync.scheme == b.sync.scheme == "sparse"
            seen = {}

            async def both_see_each_other():
                for x in nodes:
                    seen[x.peer_id] = len(await x.sync.replicas())

            deadline = time.monotonic() + 30
            while min(seen.values(), default=0) < 1:
                assert time.monotonic() < deadline, "replicas never saw each other"
                await both_see_each_other()
                await asyncio.sleep(0.2)
            for step in (1, 2):  # together the replicas hold the batch: each steps on its own gradient
                for i, x in enumerate(nodes):
                    await x.run_compute(feed_fake_gradients, x, 10 * step + i)
                await _wait(lambda: a.step == b.step == step, 20, f"step {step}")
            # Step 2 = H: a background round averages partition class (2 // H) % N = 1 of params, m and v.
            await _wait(lambda: a.sync.rounds_ok == b.sync.rounds_ok == 1, 30, "the first SPARTA round")
            _assert_slice_averaged(a, b, part=1)
            assert a.step == b.step == 2 and a.sync.local_steps == b.sync.local_steps == 2

            # One replica alone holds the batch and steps; the other follows at once on its own gradient (none
            # here: a zero-gradient step) and never downloads the state of the one ahead, although they differ.
            await a.run_compute(feed_fake_gradients, a, 99, 16)
            # (``step`` moves when the compute thread applies it, ``local_steps`` when the round coroutine resumes)
            await _wait(lambda: a.step == b.step == 3 and not a.sync.stepping and not b.sync.stepping, 20,
                        "b to follow a's step")
            assert a.sync.resyncs == b.sync.resyncs == 0 and b.sync.local_steps == 3
            for i, x in enumerate(nodes):
                await x.run_compute(feed_fake_gradients, x, 40 + i)
            await _wait(lambda: a.sync.rounds_ok == b.sync.rounds_ok == 2, 30, "the second SPARTA round")
            _assert_slice_averaged(a, b, part=0)
            assert a.sync.resyncs == b.sync.resyncs == 0 and a.sync.rounds_failed == b.sync.rounds_failed == 0
            return a, b

    a, b = asyncio.run(main())
    # Measured on the wire: per round the two replicas together send the payload once, 3 x (1/N) of the state.
    payload = 8 * a.sync.sparse.payload_numel()
    assert [x + y for x, y in zip(a.sync.round_bytes, b.sync.round_bytes)] == [payload, payload]
    elements = sum(p.numel() for p in a.stage.parameters())
    assert payload < 8 * 3 * elements * 0.51


def _sparse_swarm(man):
    """Layout [0, 0, 1], 6 waves of training with sparse averaging between the head's replicas: (losses, heads)."""
    opts = NodeOptions(stall_step_s=1.0, averaging_timeout_s=10.0)

    async def main():
        async with local_swarm(man, [0, 0, 1], opts) as (boot, peers, nodes):
            heads = [n for n in nodes if n.stage_index == 0]
            losses = await train_in_waves(man, boot, nodes, 6, timeout=30, settled=lambda: all(
                h.sync._sparse_task is None or h.sync._sparse_task.done() for h in heads))
            return losses, heads

    return asyncio.run(main())


@pytest.mark.parametrize("every", [2, 1], ids=["every-2", "every-step-the-default"])
def test_sparse_swarm_learns_without_state_downloads(every):
    man = SPARSE if every == 2 else BASE.with_overrides(averaging={"scheme": "sparse", "rho": 0.5})
    assert man.averaging.every == every
    losses, heads = _sparse_swarm(man)
    assert losses[1] < losses[0] - 0.5, losses
    assert all(h.sync.resyncs == 0 for h in heads), [h.sync.resyncs for h in heads]
    assert all(h.step >= 2 for h in heads), [h.step for h in heads]
    assert all(h.sync.rounds_ok >= 1 for h in heads), [h.sync.rounds_ok for h in heads]
    print(f"sparse: losses {losses}, steps {[h.step for h in heads]}, rounds ok {[h.sync.rounds_ok for h in heads]}, "
          f"failed {[h.sync.rounds_failed for h in heads]}")


def test_averaging_spec_of_the_demo_and_benchmark_commands():
    import pytest

    from agora.config import ManifestError
    from agora.lab.demo import demo_manifest

    assert demo_manifest("tiny", 2, averaging="full").hash == demo_manifest("tiny", 2).hash
    a = demo_manifest("tiny", 2, averaging="sparse, every=5, rho=0.1").averaging
    assert (a.scheme, a.every, a.rho) == ("sparse", 5, 0.1)
    assert demo_manifest("small", 3, averaging="powersgd,rank=8").averaging.rank == 8
    d = demo_manifest("small", 3, averaging="diloco,every=4,outer_lr=0.5").averaging
    assert (d.scheme, d.every, d.outer_lr, d.outer_momentum) == ("diloco", 4, 0.5, 0.9)
    with pytest.raises(ValueError, match="expected SCHEME"):
        demo_manifest("tiny", 2, averaging="sparse,every")
    with pytest.raises(ManifestError, match="only applies to schemes 'sparse', 'diloco' and 'gossip'"):
        demo_manifest("tiny", 2, averaging="powersgd,every=5")


@pytest.mark.parametrize("base", ["full", "powersgd"])
def test_numuon_replicas_averaging_every_step_stay_bit_identical_and_learn(base):
    """NuMuon's Krylov sketch is seeded per (run seed, step, parameter): two replicas stepping with the same
    averaged (or PowerSGD-compressed) gradient take the same rank-k step and never need a state download."""
    man = (BASE if base == "full" else POWERSGD).with_overrides(
        **{"optimizer.name": "numuon", "optimizer.muon.rank": 0.25})
    losses, heads = asyncio.run(_train(man, steps=3, check_each_step=_identical))
    assert all(h.sync.resyncs == 0 and h.sync.rounds_ok == 3 for h in heads), [h.sync.rounds_ok for h in heads]
    assert losses[1] < losses[0] - 0.5, losses
    # Bit-identical replicas: the sampled consensus distance each saw at a shared step is exactly 0.
    assert [h.sync.consensus_distance for h in heads] == [0.0, 0.0]


def test_sparse_rounds_with_muon_average_its_momentum_and_the_swarm_learns():
    losses, heads = _sparse_swarm(SPARSE.with_overrides(**{"optimizer.name": "muon"}))
    assert losses[1] < losses[0] - 0.5, losses
    assert all(h.sync.resyncs == 0 and h.sync.rounds_failed == 0 for h in heads)
    assert sum(h.sync.rounds_ok for h in heads) >= 2, [h.sync.rounds_ok for h in heads]
    # SPARTA replicas step on their own gradients: at a shared step they differ, by a little.
    distances = [h.sync.consensus_distance for h in heads if h.sync.consensus_distance is not None]
    assert distances and all(0.0 < d < 0.5 for d in distances), distances


def test_replicas_grow_blocks_mid_run_in_agreement():
    """Architecture warm-up in a swarm: blocks join at the same steps on both replicas of the head (zeroed output
    projections, fresh optimizer state), which stay bit-identical through it and learn."""
    man = BASE.with_overrides(**{"optimizer.total_steps": 10, "training.warmup_depth": {"until": 0.3}})
    depths = {}

    async def check(heads, step):
        await _identical(heads, step)
        depths[step] = [h.runtime.stage.active_depth for h in heads]

    losses, heads = asyncio.run(_train(man, steps=3, check_each_step=check))
    assert depths == {1: [2, 2], 2: [3, 3], 3: [4, 4]}, depths  # tiny: a block joins after each of the first 3 steps
    assert all(h.sync.resyncs == 0 for h in heads)
    assert losses[1] < losses[0] - 0.3, losses
