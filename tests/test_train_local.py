"""The centralized baseline trains, and writes what benchmarks compare against."""

import json

import pytest

from agora.config import load_manifest
from agora.lab.train_local import train_local, train_model


def test_fifty_tiny_steps_lower_the_loss_and_write_outputs(tmp_path):
    summary = train_local(load_manifest("tiny"), steps=50, out_dir=tmp_path, val_batches=4)
    losses = summary["train_loss"]
    assert len(losses) == 50
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.5, (losses[:5], losses[-5:])
    written = json.loads((tmp_path / "summary.json").read_text())
    for key in ("tokens", "wall_s", "cpu_s", "tokens_per_s", "train_loss", "val_loss", "parameters",
                "flops_per_token"):
        assert key in written, key
    assert written["tokens"] == 50 * 16 * 64
    assert (tmp_path / "loss.png").stat().st_size > 1000
    html = (tmp_path / "report.html").read_text()
    assert html.count("data:image/png;base64") >= 2


def test_nadam_manifest_builds_the_delay_aware_optimizer_and_trains():
    from agora.model import PipelineModel
    from agora.optim import build_optimizer
    from agora.optim.nadam import DelayedNAdam

    m = load_manifest("tiny").with_overrides(**{"optimizer.name": "nadam", "optimizer.betas": [0.99, 0.999]})
    assert isinstance(build_optimizer(PipelineModel(m), m.optimizer), DelayedNAdam)
    losses = train_local(m, steps=20)["train_loss"]
    assert losses[-1] < losses[0] - 0.5


def test_checkpointed_blocks_train_bit_identically_and_bf16_stays_close():
    """``train-local --checkpoint-blocks`` recomputes blocks at backward time: the same losses bit for bit.
    ``--precision bf16`` (autocast) stays within 2% of fp32 and is not fp32 in disguise; so does the fused AdamW
    kernel, within 0.01%. The summary says how."""
    m = load_manifest("tiny")
    plain = train_local(m, steps=4, val_batches=2)
    checkpointed, model = train_model(m, steps=4, val_batches=2, checkpoint_blocks=True)
    assert all(stage.checkpoint_blocks for stage in model.stages)  # the option reached every stage
    bf16 = train_local(m, steps=4, val_batches=2, precision="bf16")
    assert checkpointed["train_loss"] == plain["train_loss"] and checkpointed["val_loss"] == plain["val_loss"]
    assert bf16["val_loss"] == pytest.approx(plain["val_loss"], rel=2e-2) and bf16["val_loss"] != plain["val_loss"]
    assert (checkpointed["compute"]["checkpoint_blocks"], bf16["compute"]["precision"]) == (True, "bf16")
    assert plain["compute"]["device"] == "cpu" and plain["compute"]["host_peak_rss_bytes"] > 0
    # torch's fused AdamW (the default on CUDA): the same update rounded otherwise, so close but not bit-identical
    fused = train_local(m, steps=4, val_batches=2, optimizer_kernel="fused")
    assert (plain["compute"]["optimizer_kernel"], fused["compute"]["optimizer_kernel"]) == ("single", "fused")
    assert fused["val_loss"] == pytest.approx(plain["val_loss"], rel=1e-4) and fused["val_loss"] != plain["val_loss"]
    with pytest.raises(ValueError, match="--precision"):
        train_local(m, steps=1, precision="fp16")


def test_train_local_refuses_a_device_or_precision_it_cannot_use(tmp_path):
    from typer.testing import CliRunner

    from agora.cli import app

    runner = CliRunner()
    res = runner.invoke(app, ["train-local", "--device", "gpu0", "--steps", "1", "--out", str(tmp_path)])
    assert res.exit_code == 2 and "use auto, cpu, cuda or cuda:N" in res.output, res.output
    res = runner.invoke(app, ["train-local", "--precision", "fp16", "--steps", "1", "--out", str(tmp_path)])
    assert res.exit_code == 2 and "--precision 'fp16'" in res.output, res.output
    res = runner.invoke(app, ["train-local", "--optimizer-kernel", "turbo", "--steps", "1", "--out", str(tmp_path)])
    assert res.exit_code == 2 and "--optimizer-kernel 'turbo'" in res.output, res.output
    nadam = tmp_path / "nadam.yaml"  # torch has a fused kernel for AdamW only
    nadam.write_text(load_manifest("tiny").with_overrides(**{"optimizer.name": "nadam"}).to_yaml())
    res = runner.invoke(app, ["train-local", "--manifest", str(nadam), "--optimizer-kernel", "fused", "--steps", "1",
                              "--out", str(tmp_path)])
    assert res.exit_code == 2 and "adamw only" in res.output, res.output
    assert not (tmp_path / "summary.json").exists()


def test_reversed_accumulation_is_the_same_sum_rounded_differently():
    """Each step's microbatches backpropagated last to first: the same gradients up to rounding, so the losses agree
    closely but not bit for bit (the noise-floor row of ``agora bench convergence``)."""
    m = load_manifest("tiny").with_overrides(**{"batch.microbatch_size": 4})  # 4 microbatches per step
    plain, a = train_model(m, steps=2, val_batches=2)
    reordered, b = train_model(m, steps=2, val_batches=2, reverse_accumulation=True)
    assert reordered["train_loss"][0] == pytest.approx(plain["train_loss"][0], rel=1e-6)  # same batches, same model
    assert reordered["val_loss"] == pytest.approx(plain["val_loss"], rel=1e-4)
    differences = [float((x - y).abs().max()) for x, y in zip(a.parameters(), b.parameters())]
    assert 0 < max(differences) < 1e-4, max(differences)


def test_wire_boundaries_round_each_boundary_as_a_swarm_and_the_cli_passes_the_switch(tmp_path):
    """``--wire-boundaries``: the same function, rounded at the boundaries (``small``'s bf16 wire): the losses move
    by float rounding only, and the summary says which baseline it is. (Bit for bit a swarm's computation:
    ``tests/test_convergence_parity.py``.)"""
    import json

    from typer.testing import CliRunner

    from agora.cli import app

    man = load_manifest("tiny").with_overrides(**{"residual.wire_dtype": "bf16"})
    plain = train_local(man, 3, val_batches=1)
    rounded = train_local(man, 3, val_batches=1, wire_boundaries=True)
    assert rounded["wire_boundaries"] and not plain["wire_boundaries"]
    assert rounded["train_loss"] != plain["train_loss"]
    assert max(abs(a - b) / b for a, b in zip(rounded["train_loss"], plain["train_loss"])) < 1e-4
    res = CliRunner().invoke(app, ["train-local", "--steps", "2", "--wire-boundaries", "--out", str(tmp_path)])
    assert res.exit_code == 0, res.output
    assert json.loads((tmp_path / "summary.json").read_text())["wire_boundaries"] is True
