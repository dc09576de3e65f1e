"""A curvature-driven architecture warm-up (``training.warmup_depth.mode: curvature``): the warm-up's clock stops
while the measured ``lr * lambda`` is above its limit, centralized and in a swarm, where every replica of every stage
takes the same decisions from the same DHT records."""

import asyncio

import pytest
import torch

from agora.client.trainer import Trainer
from agora.config import load_manifest
from agora.lab.train_local import train_model
from agora.model import WARMUP_LAG_STEPS, warmup_end, warmup_measurement
from agora.ops.metrics import NodeCollector
from agora.server.node import NodeOptions
from agora.server.runtime import Counters, RuntimeOptions, StageRuntime
from agora.server.observers import Observers
from swarm_util import local_swarm, random_batches, wait_until

TINY = load_manifest("tiny").with_overrides(**{"optimizer.total_steps": 40, "optimizer.lr": 0.01,
                                               "optimizer.warmup_steps": 0})


def _curvature(hold_above: float, every: int = 2, m=TINY):
    return m.with_overrides(**{"training.warmup_depth": {"until": 0.3, "mode": "curvature", "hold_above": hold_above,
                                                         "curvature_every": every}})


def test_a_step_reads_the_latest_measurement_at_least_two_steps_old():
    m = _curvature(0.5, every=5)
    assert WARMUP_LAG_STEPS == 2
    assert [warmup_measurement(m, s) for s in (0, 6, 7, 11, 12, 16, 17)] == [None, None, 5, 5, 10, 10, 15]
    assert warmup_end(m) == 12 + 4 - 1  # tiny: joins at clock 4, 8, 12, each ramping over 4 steps


def test_centralized_the_clock_stops_only_for_measurements_above_the_limit():
    steps = 14
    never, _ = train_model(_curvature(1e6), steps, val_batches=1)
    by_steps, _ = train_model(TINY.with_overrides(**{"training.warmup_depth": {"until": 0.3}}), steps, val_batches=1,
                              curvature_every=2)
    # Never held: the schedule of mode steps, and training is not touched by the measurements (same losses).
    assert [r["depth"] for r in never["history"]] == [r["depth"] for r in by_steps["history"]]
    assert never["train_loss"] == by_steps["train_loss"]
    assert never["warmup"]["held_steps"] == 0 and never["curvature"]["values"]

    low, _ = train_model(_curvature(1e-6), steps, val_batches=1)
    values = {v["step"]: v["lr_x_lambda"] for v in low["curvature"]["values"]}
    clock = 0
    for step, rec in enumerate(low["history"]):  # replay the rule from the measurements the run reported
        m = warmup_measurement(_curvature(1e-6), step)
        held = m is not None and abs(values[m]) > 1e-6 * 38 and clock < warmup_end(TINY.with_overrides(
            **{"training.warmup_depth": {"until": 0.3}}))
        clock += not held
        assert rec["warmup_clock"] == clock, (step, rec, values)
    assert low["warmup"]["held_steps"] > 0 and low["warmup"]["clock"] + low["warmup"]["held_steps"] == steps
    assert [r["depth"] for r in low["history"]] != [r["depth"] for r in never["history"]]


def test_the_clock_travels_with_a_stage_state_and_old_states_fall_back_to_the_step():
    m = _curvature(0.5)
    a = StageRuntime(m, 1, Counters(), Observers(), options=RuntimeOptions())
    for hold in (False, True, True, False, False):
        a.apply_step([torch.full(p.shape, 0.01, dtype=torch.float64) for p in a.stage.parameters()], hold_warmup=hold)
    assert (a.step, a.warmup_clock) == (5, 3)
    b = StageRuntime(m, 1, Counters(), Observers(), options=RuntimeOptions())
    step, names, tensors = a.export_state()
    b.import_state(step, names, tensors)
    assert (b.step, b.warmup_clock, b.stage.active_depth) == (5, 3, a.stage.active_depth)
    assert b.stage.write_scales == a.stage.write_scales
    kept = [i for i, n in enumerate(names) if n != "warmup/clock"]
    b.import_state(step, [names[i] for i in kept], [tensors[i] for i in kept])
    assert b.warmup_clock == 5
    with pytest.raises(ValueError, match="warmup/clock"):
        b.import_state(step, names, [t if n != "warmup/clock" else torch.tensor([9]) for n, t in zip(names, tensors)])


async def _train_swarm(man, steps: int):
    opts = NodeOptions(stall_step_s=1e9, averaging_timeout_s=15.0, compute=RuntimeOptions(curvature_budget=1.0))
    async with local_swarm(man, [0, 0, 1], opts) as (boot, peers, nodes):
        trainer = Trainer(man, boot, shard=None)
        await trainer.start()
        await wait_until(lambda: len(trainer.swarm[0]) == 2 and len(trainer.swarm[1]) == 1, 30, "all peers")
        data = random_batches(man.model.vocab_size, man.model.seq_len, 4, 4, 0)
        clocks = []
        for step in range(1, steps + 1):
            sent = await asyncio.gather(*(trainer.send(b) for b in data))
            assert all(x is not None for x in sent), sent
            await wait_until(lambda: all(n.step >= step and n.runtime.samples == 0 for n in nodes), 40, f"step {step}")
            heads = [n for n in nodes if n.stage_index == 0]
            await wait_until(lambda: all(h.sync.fingerprint_step == step for h in heads), 10, f"step {step} done")
            def same() -> bool:
                return all(torch.equal(pa, pb) for pa, pb in zip(heads[0].stage.parameters(),
                                                                  heads[1].stage.parameters()))

            if not same():
                # Under load hivemind can end a round partial ("all-reduce part failed: TimeoutError", CI once): a
                # replica counts a failed round and adopts the other's state at its next tick. Rounding alone
                # never splits them.
                assert sum(h.sync.rounds_failed for h in heads) > 0, f"step {step}: replicas differ, no round failed"
                await wait_until(same, 30, f"step {step}: the head's replicas to agree again")
            clocks.append([n.runtime.warmup_clock for n in nodes])
        trainer.close()
        metrics = [{f.name: f.samples[0].value for f in NodeCollector(n).collect() if f.name.startswith("agora_warmup")}
                   for n in nodes]
        return clocks, nodes, metrics


def test_in_a_swarm_every_replica_of_every_stage_holds_the_same_steps():
    """Every stage measures every step (curvature_every 1) and the limit is tiny: from step 3 on (a measurement
    two steps old exists), a step is held whenever some stage's reading is not zero. Both head replicas and the
    tail take the same decisions (same clock at every step), the head replicas stay bit-identical, and the clock
    does fall behind the step."""
    man = _curvature(1e-6, every=1, m=TINY.with_overrides(**{"optimizer.total_steps": 20}))
    clocks, nodes, metrics = asyncio.run(_train_swarm(man, steps=6))
    assert all(len(set(c)) == 1 for c in clocks), clocks
    assert [c[0] for c in clocks][:2] == [1, 2]  # no measurement two steps old yet: the clock advances
    held = [n.sync.warmup_brake.held_steps for n in nodes]
    assert len(set(held)) == 1 and held[0] > 0, held
    assert clocks[-1][0] + held[0] == 6
    for n in nodes:  # every decision read both stages' records
        assert n.sync.warmup_brake.decisions and all(v is not None for v in n.sync.warmup_brake.decisions.values())
    for n, got in zip(nodes, metrics):  # /metrics
        assert got == {"agora_warmup_active_blocks": n.runtime.stage.active_depth,
                       "agora_warmup_clock": clocks[-1][0], "agora_warmup_held_steps": held[0]}, got
