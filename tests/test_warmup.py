"""Architecture warm-up (METHODS section 10): bypassed blocks are frozen and out of the optimizer, join in depth
order with zeroed output projections (the function does not change when they join), and every peer agrees."""

import pytest
import torch

from agora.config import ManifestError, load_manifest
from agora.lab.train_local import train_model
from agora.model import PipelineModel, active_depth, join_step, ramp_steps, write_scale
from agora.server.observers import Observers
from agora.server.runtime import Counters, RuntimeOptions, StageRuntime

TINY = load_manifest("tiny")
WARM = TINY.with_overrides(**{"training.warmup_depth": {"until": 0.3, "start_depth": 1}})


def test_the_schedule_adds_one_block_at_a_time_until_the_given_share_of_training():
    # tiny: 4 blocks, total_steps 200, until 0.3: all active from step 60, a block joins every 20 steps
    assert [active_depth(WARM, s) for s in (0, 19, 20, 39, 40, 59, 60, 199)] == [1, 1, 2, 2, 3, 3, 4, 4]
    assert active_depth(TINY, 0) == 4


def test_a_joined_block_writes_at_a_scale_that_ramps_to_one_over_the_steps_between_joins():
    # tiny: joins at steps 20, 40, 60 (above); by default a block reaches full size when the next one joins
    assert [join_step(WARM, layer) for layer in range(4)] == [0, 20, 40, 60]
    assert ramp_steps(WARM) == 20 and ramp_steps(TINY) == 1
    assert [write_scale(WARM, 1, s) for s in (0, 19, 20, 21, 38, 39, 500)] == [1.0, 1.0, 1 / 20, 2 / 20, 19 / 20, 1.0,
                                                                                1.0]
    assert all(write_scale(WARM, 0, s) == 1.0 for s in range(100))  # active from the start: never ramped
    once = WARM.with_overrides(**{"training.warmup_depth.ramp_steps": 1})
    assert all(write_scale(once, layer, s) == 1.0 for layer in range(4) for s in range(100))
    # join_step agrees with active_depth on awkward schedules too
    for total, until, start, n in [(7, 0.9, 1, 4), (1000, 0.37, 2, 4), (3, 1.0, 1, 4), (10, 0.05, 1, 4)]:
        m = TINY.with_overrides(**{"optimizer.total_steps": total,
                                   "training.warmup_depth": {"until": until, "start_depth": start}})
        for layer in range(start, n):
            j = join_step(m, layer)
            assert active_depth(m, j) > layer and (j == 0 or active_depth(m, j - 1) <= layer), (total, until, layer)


@pytest.mark.parametrize("mode", ["subspace", "dense"])
def test_training_through_ramped_joins_keeps_the_function_at_each_join_and_scales_the_writes(mode):
    m = WARM.with_overrides(**{"optimizer.total_steps": 20, "training.warmup_depth": {"until": 0.6, "ramp_steps": 3}})
    if mode == "dense":
        m = m.with_overrides(**{"residual": {"mode": "dense", "wire_dtype": "fp32"}})
    model = PipelineModel(m)
    tokens = torch.randint(0, m.model.vocab_size, (2, m.model.seq_len), generator=torch.Generator().manual_seed(0))
    opt = torch.optim.AdamW([p for p in model.parameters()], lr=1e-2)
    scales_seen = []
    for step in range(14):
        for stage in model.stages:  # bypassed blocks: frozen
            for p in stage.inactive_parameters():
                p.grad = None
        opt.zero_grad()
        model.loss(tokens[:, :-1], tokens[:, 1:]).backward()
        for stage in model.stages:
            for p in stage.inactive_parameters():
                p.grad = None
        opt.step()
        with torch.no_grad():
            before = model(tokens)
            joined = model.grow_for_step(step + 1)
            after = model(tokens)
        if joined:
            assert (after - before).abs().max().item() < 1e-5, (step, joined)  # the zero write: same function
        scales_seen.append({k: v for stage in model.stages for k, v in stage.write_scales.items()})
    assert scales_seen[3] == {"1": 1 / 3} and scales_seen[4] == {"1": 2 / 3}  # block 1 joined at step 4
    assert all(stage.write_scales == {} for stage in model.stages)  # step 14: every block at full size


def test_warmup_settings_are_validated_and_manifests_without_them_keep_their_hash():
    assert TINY.with_overrides(**{"training.warmup_depth": None}).hash == TINY.hash
    assert WARM.hash != TINY.hash
    with pytest.raises(ManifestError, match="start_depth"):
        TINY.with_overrides(**{"training.warmup_depth": {"start_depth": 4}})
    with pytest.raises(ManifestError):
        TINY.with_overrides(**{"training.warmup_depth": {"mode": "hessian"}})
    with pytest.raises(ManifestError, match="hold_above"):
        TINY.with_overrides(**{"training.warmup_depth": {"mode": "curvature", "hold_above": float("inf")}})
    with pytest.raises(ManifestError, match="curvature_every"):
        TINY.with_overrides(**{"training.warmup_depth": {"mode": "curvature", "curvature_every": 0}})
    with pytest.raises(ManifestError, match="ramp_steps"):
        TINY.with_overrides(**{"training.warmup_depth": {"ramp_steps": 0}})
    with pytest.raises(ManifestError):
        TINY.with_overrides(**{"training.warmup_depth": {"until": 0.0}})


@pytest.mark.parametrize("mode", ["subspace", "dense"])
def test_a_block_that_joins_leaves_the_logits_unchanged(mode):
    m = WARM if mode == "subspace" else WARM.with_overrides(**{"residual": {"mode": "dense", "wire_dtype": "fp32"}})
    model = PipelineModel(m)
    tokens = torch.randint(0, m.model.vocab_size, (2, m.model.seq_len), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        for depth in range(2, m.model.n_layers + 1):
            before = model(tokens)
            joined = [n for stage in model.stages for n in stage.grow_to(depth)]
            assert joined == [str(depth - 1)]
            after = model(tokens)
            assert (after - before).abs().max().item() < 1e-5, depth
    # ... and once trained, a block changes the function (the check above is not vacuous):
    full = PipelineModel(m.with_overrides(**{"training.warmup_depth": None}))
    with torch.no_grad():
        assert (full(tokens) - model(tokens)).abs().max().item() > 1e-3


def test_bypassed_blocks_are_frozen_out_of_the_optimizer_and_train_once_they_join():
    m = WARM.with_overrides(**{"optimizer.total_steps": 10, "training.warmup_depth.until": 0.3})
    # 4 blocks, full at step 3: block 1 joins after step 1, block 2 after step 2, block 3 after step 3
    initial = PipelineModel(m).state_dict()
    seen = {}

    def after_step(model, opt, step):
        seen[step] = {n: p.detach().clone() for n, p in model.named_parameters() if ".layers.3." in n}
        seen[step]["state"] = sum(1 for p in model.stages[1].layers["3"].parameters() if p in opt.state)

    _, model = train_model(m, 5, val_batches=1, after_step=after_step)
    layer3 = [n for n in initial if ".layers.3." in n]
    for step in (0, 1):  # block 3 bypassed during steps 0..2: untouched (no decay either), no optimizer state
        assert seen[step]["state"] == 0
        for n in layer3:
            assert torch.equal(seen[step][n], initial[n]), n
    # it joined after step 2 (grow_for_step(3)): output projections zeroed, nothing else changed yet
    for n in layer3:
        if n.endswith("o_proj.weight") or n.endswith("down_proj.weight"):
            assert torch.count_nonzero(seen[2][n]) == 0, n
        else:
            assert torch.equal(seen[2][n], initial[n]), n
    assert seen[4]["state"] > 0 and any(not torch.equal(seen[4][n], seen[2][n]) for n in layer3)


def test_a_stage_runtime_joins_blocks_at_its_steps_and_a_state_import_keeps_the_depth():
    m = WARM.with_overrides(**{"optimizer.total_steps": 10, "stages": [1, 3]})
    tail = StageRuntime(m, 1, Counters(), Observers(), options=RuntimeOptions())
    joined = []
    tail.observers.subscribe("blocks_joined", lambda stage, step, names: joined.append((step, names)))
    block3 = [p.detach().clone() for p in tail.stage.layers["3"].parameters()]
    for step in range(3):
        # gradients of every parameter, bypassed blocks included (as averaging hands them over): ignored there
        tail.apply_step([torch.full(p.shape, 0.01, dtype=torch.float64) for p in tail.stage.parameters()])
    assert joined == [(1, ["1"]), (2, ["2"]), (3, ["3"])]
    assert tail.stage.active_depth == 4
    for before, p, (name, _) in zip(block3, tail.stage.layers["3"].parameters(),
                                    tail.stage.layers["3"].named_parameters()):
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            assert torch.count_nonzero(p) == 0
        else:
            assert torch.equal(before, p), name  # frozen until it joined: no step, no weight decay
    other = StageRuntime(m, 1, Counters(), Observers(), options=RuntimeOptions())
    assert other.stage.active_depth == 1
    other.import_state(*tail.export_state())
    assert other.stage.active_depth == 4
    for a, b in zip(tail.stage.parameters(), other.stage.parameters()):
        assert torch.equal(a, b)


def test_rebalancing_waits_for_the_warmup_to_end():
    """Stage costs change as blocks join: no stage move is planned until the network is whole (a move made on
    transient costs would be undone when the next blocks join)."""
    import asyncio
    from types import SimpleNamespace

    from agora.server.rebalance import Rebalancer

    async def never(*args):
        raise AssertionError("the swarm was read during the warm-up")

    node = SimpleNamespace(manifest=WARM, step=10, run_io=never, dht=None)
    reb = Rebalancer(node)
    assert asyncio.run(reb.maybe_move()) is None and reb.waiting_for_depth
    node.step = 60  # every block active: the rebalancer reads the swarm again
    with pytest.raises(AssertionError, match="swarm was read"):
        asyncio.run(reb.maybe_move())


@pytest.mark.parametrize("mode", ["subspace", "dense"])
def test_an_export_during_or_after_the_warmup_computes_what_the_run_computed(mode, tmp_path):
    """An exported model has no warm-up: bypassed blocks are written as identities and a dense block's ramp is
    folded into its weights, so the loaded model computes what the stages computed at their step. A subspace
    block still ramping cannot be folded: refused, naming the step to export from."""
    from agora.ops.model_io import ModelFolderError, export_model, load_model, merge_stages, run_tokenizer

    m = WARM.with_overrides(**{"optimizer.total_steps": 20, "stages": [2, 2],
                               "training.warmup_depth": {"until": 0.6, "ramp_steps": 3}})
    if mode == "dense":
        m = m.with_overrides(**{"residual": {"mode": "dense", "wire_dtype": "fp32"}})
    tokens = torch.randint(0, m.model.vocab_size, (2, m.model.seq_len), generator=torch.Generator().manual_seed(0))
    model = PipelineModel(m)
    with torch.no_grad():  # stand-in for training: every weight moved, joined output projections included
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.01)
    # joins at steps 4, 8, 12. 5: block 1 (head stage: a subspace write) at 2/3; 9: block 1 at full size, block 2
    # (tail: a dense write even in subspace runs) at 2/3, block 3 bypassed; 14: the warm-up is over
    for step in (5, 9, 14):
        for stage in model.stages:
            stage.grow_for_step(step)
            for name, block in stage.layers.items():  # and trained since they joined
                if int(name) < stage.active_depth:
                    with torch.no_grad():
                        block.self_attn.o_proj.weight.add_(0.01)
                        block.mlp.down_proj.weight.add_(0.01)
        with torch.no_grad():
            expected = model(tokens)
        stages = list(model.stages)
        if mode == "subspace" and step == 5:
            with pytest.raises(ModelFolderError, match="block 1 .* from clock step 6 or later"):
                merge_stages(m, stages)
            continue
        export_model(merge_stages(m, stages), tmp_path / f"out{step}", run_tokenizer(m))
        loaded = load_model(tmp_path / f"out{step}")
        assert loaded.manifest.training.warmup_depth is None
        with torch.no_grad():
            got = loaded.model(tokens)
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
        assert model.stages[1].active_depth == {5: 2, 9: 3, 14: 4}[step]  # the run's stages were not changed
