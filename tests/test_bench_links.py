"""``agora bench links``: time to N steps and validation loss against wall-clock time over capped links."""

import json
import math

import pytest

from agora.bench.links import LinksOptions, check_links_options, run, step_times


def test_step_times_take_the_first_read_at_which_every_stage_had_the_step():
    timeline = [{"t": 5.0, "steps": [0, 0]}, {"t": 9.0, "steps": [1, 0]}, {"t": 12.0, "steps": [2, 1]},
                {"t": 20.0, "steps": [3, 3]}, {"t": 21.0, "steps": [2, 3]}]  # a replica re-synced: not a new step
    # Step 1 is reached when the slower stage has it (t=12), steps 2 and 3 together at t=20; times from t=4.
    assert step_times(timeline, 4.0, 4) == [8.0, 16.0, 16.0, None]
    assert step_times([], 0.0, 2) == [None, None]
    # Replicas of stage 1 steps apart: its most advanced one had step 2 at t=9, the slowest never gets there.
    apart = [{"t": 9.0, "steps": [2, 1], "steps_max": [2, 2]}, {"t": 15.0, "steps": [3, 1], "steps_max": [3, 3]}]
    assert step_times(apart, 0.0, 2) == [9.0, None]
    assert step_times(apart, 0.0, 2, key="steps_max") == [9.0, 9.0]


@pytest.mark.parametrize("bad", [dict(steps=0), dict(eval_every=0), dict(mbps=()), dict(mbps=(0.0,)),
                                 dict(mbps=(float("nan"),)), dict(boundaries=("sparse",)), dict(boundaries=())])
def test_bad_options_are_refused_before_anything_runs(bad):
    with pytest.raises(ValueError):
        check_links_options(LinksOptions(**bad))


def test_tiny_capped_swarm_reports_step_times_validation_curve_and_averaging(tmp_path):
    # Enough steps that the trainer reads some stage step from the DHT before its budget ends (CI once saw a 3-step
    # run of 7 s end before the in-training validation had a step to start from).
    steps = 6
    result = run(tmp_path, LinksOptions(preset="tiny", stages=2, replicas=2, in_flight=2, mbps=(50.0,),
                                        boundaries=("subspace",), steps=steps, eval_every=1, val_batches=2,
                                        link_backend="transport"), log=lambda _: None)
    assert result["link_backend"] == "transport"
    (row,) = result["rows"]
    assert row["finished"] and row["boundaries"] == "subspace" and row["mbps"] == 50.0
    # Exactly the run's tokens (the trainer stops at its budget), every stage stepped once per target batch.
    assert row["tokens"] == result["tokens"] == steps * 16 * 64
    assert set(row["steps_per_stage"].values()) == {steps}, row["steps_per_stage"]
    # Step k came after step k-1, all within the run; tokens/s divides by the time to the last step.
    times = row["time_to_step_s"]
    assert all(t is not None and t > 0 for t in times) and times == sorted(times)
    assert row["time_to_steps_s"] == times[-1] < row["wall_s"]
    assert row["tokens_per_s"] == row["tokens"] / times[-1]
    assert row["time_to_steps_any_replica_s"] <= times[-1]
    assert row["final_steps"] == [[steps, steps], [steps, steps]]  # replicas ended together
    # Validation while training (after some step before the last) and at the end on the final model, in time order,
    # each on every held-out batch.
    curve = row["val_curve"]
    assert curve[-1]["final"] and curve[-1]["step"] == steps and curve[-1]["val_loss"] == row["val_loss"]
    during = [p for p in curve if not p["final"]]
    assert during and all(1 <= p["step"] <= steps for p in during), curve
    assert [p["wall_s"] for p in curve] == sorted(p["wall_s"] for p in curve)
    assert all(p["batches"] == 2 and math.isfinite(p["val_loss"]) for p in curve)
    # The tiny model learns: the end is below the first validation taken before the last step.
    assert curve[-1]["val_loss"] < during[0]["val_loss"] or during[0]["step"] == steps
    # The replicas' averaging ran and is counted.
    assert row["rounds_ok"] > 0 and row["averaging_bytes_sent"] > 0
    assert (tmp_path / "links.png").stat().st_size > 10_000
    written = json.loads((tmp_path / "result.json").read_text())
    assert written["benchmark"] == "links" and written["rows"][0]["val_curve"] == curve
    assert f"s to {steps} steps" in (tmp_path / "result.md").read_text()
