"""``agora bench efficiency`` compares equal work: the same tokens in both arms, and every swarm process's CPU."""

import json
import math

import pytest

from agora.bench.efficiency import EfficiencyOptions, run


def test_tiny_swarm_trains_the_centralized_tokens_and_counts_its_helpers_cpu(tmp_path):
    """In bf16 (both arms: the option reaches train-local and every node, as a GPU run needs it)."""
    steps = 4
    result = run(tmp_path, EfficiencyOptions(preset="tiny", steps=steps, stages=2, replicas=2, in_flight=2,
                                             repeats=1, precision="bf16"), log=lambda _: None)
    r = result["runs"][0]
    central, swarm = r["centralized"], r["swarm"]
    assert (result["device"], result["card"], result["precision"]) == ("cpu", "cpu", "bf16")
    demo = json.loads((tmp_path / "repeat1" / "swarm" / "summary.json").read_text())
    computed = demo["compute_per_node"]
    assert len(computed) == 4 and all(c["device"] == "cpu" and c["precision"] == "bf16" for c in computed.values())
    assert json.loads((tmp_path / "repeat1" / "centralized" / "summary.json").read_text())["compute"]["precision"] \
        == "bf16"

    # Equal tokens, exactly: the trainer never lets in-flight microbatches carry it past the budget.
    assert central["tokens"] == steps * 16 * 64
    assert swarm["tokens"] == central["tokens"]
    assert r["token_overshoot"] == 0 and result["summary"]["token_overshoot_max"] == 0
    assert swarm["microbatches"]["abandoned"] == 0
    # The trainer validated and left by itself (not stopped mid-way): its summary is whole.
    exits = json.loads((tmp_path / "repeat1" / "swarm" / "summary.json").read_text())["exits"]
    assert [e["returncode"] for name, e in exits.items() if name.startswith("train")] == [0], exits
    # Each replica took its share of every target batch: every stage stepped once per batch, as centralized did.
    assert set(swarm["steps_per_stage"].values()) == {steps}, swarm["steps_per_stage"]
    # Validated after the stages applied every sample, on all the held-out batches the baseline used.
    assert swarm["settled"] is True
    assert swarm["val_batches_done"] == [4]
    assert math.isfinite(swarm["val_loss"]) and math.isfinite(r["loss_ratio"])

    # The CPU window covers every role's process tree, hivemind's children included, taken before shutdown.
    window = swarm["cpu_window"]
    assert window["ended"]
    by_process = window["by_process"]
    nodes = [role for role in by_process if role.startswith("node")]
    assert len(nodes) == 4
    assert any(k.get("averager", 0.0) > 0 for k in by_process.values()), by_process
    assert all(by_process[n].get("dht", 0.0) > 0 and by_process[n].get("p2pd", 0.0) > 0 for n in nodes), by_process
    assert any(role.startswith("bootstrap") for role in by_process) and "observer" in by_process
    assert by_process["observer"].get("dht", 0.0) > 0, by_process["observer"]
    assert math.isclose(sum(window["by_role"].values()), window["total_s"], rel_tol=1e-9)
    assert math.isclose(sum(window["breakdown"].values()), window["total_s"], rel_tol=1e-9)
    assert window["breakdown"]["compute"] > 0 and len(window["compute_by_node"]) == 4
    assert swarm["tokens_per_cpu_s"] == swarm["tokens"] / window["total_s"]

    written = json.loads((tmp_path / "result.json").read_text())
    assert written["summary"]["loss_ratio"]["median"] == r["loss_ratio"]
    assert "Per role" in (tmp_path / "result.md").read_text()


def test_a_device_this_machine_lacks_is_refused_before_anything_runs(tmp_path):
    with pytest.raises(ValueError, match="--device 'gpu0'"):
        run(tmp_path, EfficiencyOptions(preset="tiny", device="gpu0"), log=lambda _: None)
    assert not any(tmp_path.iterdir())


def test_stages_settle_only_when_every_serving_replica_announced_nothing_pending_after_the_trainer_stopped():
    from agora.net.records import StageRecord, stages_settled

    def rec(stage, samples=0, averaging=-1, updated=10.0, state="serving"):
        return StageRecord("p", stage, state, "h", samples=samples, averaging_step=averaging, updated=updated)

    assert stages_settled([[rec(0), rec(0)], [rec(1), rec(1, state="joining", samples=3)]], since=5.0)
    assert not stages_settled([[rec(0), rec(0, samples=8)], [rec(1)]], since=5.0)  # a partial batch left
    assert not stages_settled([[rec(0)], [rec(1, averaging=3)]], since=5.0)  # a round still running
    assert not stages_settled([[rec(0)], [rec(1, updated=4.0)]], since=5.0)  # announced before the trainer stopped
    assert not stages_settled([[rec(0)], [rec(1, state="joining")]], since=5.0)  # nobody serves stage 1
