"""``agora bench training``'s curvature section end to end at a tiny size: every warm-up variant runs on equal
tokens, the curvature-driven one reports the steps it held, and the table has a row per variant."""

import json

import pytest
import torch

from agora.bench.training import TrainingOptions, exact_top_eigenvalue, run
from agora.optim.curvature import CurvatureTracker


def test_the_curvature_section_runs_every_warmup_variant_on_equal_tokens(tmp_path):
    opts = TrainingOptions(preset="tiny", steps=8, seeds=(0,), sections=("curvature",), curvature_every=2,
                           val_batches=1, warmup_until=0.5, curvature_reference_hvps=10)
    result = run(tmp_path, opts, log=lambda _: None)
    runs = result["curvature_runs"]
    assert [(r["factor"], r["warmup"]) for r in runs] == [(1.0, "no"), (10.0, "no"), (10.0, "steps"),
                                                          (10.0, "curvature")]
    for r in runs:
        assert len(r["train_loss"]) == 8 and [v["step"] for v in r["curvature"]] == [2, 4, 6, 8]
        assert r["tracker_s"] > 0 and 0 < r["tracker_share"] < 10
        assert r["reference"]["hvps"] == 10 and r["reference"]["relative_error"] >= 0
        assert r["reference_s"] > 0  # timed apart: neither the tracker's cost nor training time
        assert [x["step"] for x in r["references"]] == [8] and r["references"][0]["tracker"] == r["curvature"][-1]["lambda"]
    no, steps, curv = runs[1], runs[2], runs[3]
    assert no["depth"] == [4] * 8 and no["all_blocks_at_step"] == 1
    assert steps["depth"][0] == 1 and steps["all_blocks_at_step"] == 4  # tiny: 4 blocks, all active at 0.5 x 8
    # the curvature-driven warm-up is the steps schedule, slowed by the steps it held: never deeper, and the same
    # before its first decision (a measurement two steps old exists from step 4 on)
    assert all(c <= d for c, d in zip(curv["depth"], steps["depth"])) and curv["depth"][:4] == steps["depth"][:4]
    if curv["held_steps"] == 0:
        assert curv["depth"] == steps["depth"]
    md = (tmp_path / "result.md").read_text()
    assert "steps held" in md and "error vs 10 Lanczos products from the tracker's vector, at steps 8" in md and md.count(f"| {runs[1]['lr']:.3g} |") == 3
    assert json.loads((tmp_path / "result.json").read_text())["curvature_runs"][3]["warmup"] == "curvature"


def test_exact_eigenvalue_is_that_of_the_preconditioned_hessian():
    """``loss = 0.5 * sum(c_i p_i^2) + p_0 p_1`` has Hessian ``[[c0, 1], [1, c1]]`` (and c2 alone); with v_hat = 4
    on every coordinate (P = 2) the preconditioned matrix is that / 2."""
    p = torch.nn.Parameter(torch.ones(3))
    c = torch.tensor([3.0, 1.0, -2.0])
    loss = lambda: 0.5 * (c * p * p).sum() + p[0] * p[1]  # noqa: E731
    tracker = CurvatureTracker([p], hvps=3, eps=0.0)
    top, bottom = exact_top_eigenvalue(tracker, loss, [torch.full((3,), 4.0 * (1 - 0.95))], 0.95, 1)
    expected = torch.linalg.eigvalsh(torch.tensor([[3.0, 1.0, 0.0], [1.0, 1.0, 0.0], [0.0, 0.0, -2.0]],
                                                  dtype=torch.float64) / 2)
    assert top == pytest.approx(float(expected[-1])) and bottom == pytest.approx(float(expected[0]))


def test_the_tracker_section_scores_every_method_against_dense_eigvalsh(tmp_path):
    opts = TrainingOptions(preset="tiny", seeds=(0,), sections=("tracker",), tracker_steps=12, curvature_every=4,
                           val_batches=1)
    result = run(tmp_path, opts, log=lambda _: None)
    (r,) = result["tracker_runs"]
    assert 2000 < r["tracked_parameters"] < 6000
    assert [x["step"] for x in r["measurements"]] == [4, 8, 12]
    for x in r["measurements"]:
        assert x["exact_min"] <= x["exact"]
        assert x["lanczos"] <= x["exact"] * (1 + 1e-4)  # a Ritz value never exceeds the top eigenvalue
        assert x["lanczos_error"] >= 0 and x["power_error"] >= 0 and x["lanczos_s"] > 0
    assert set(r["lanczos"]) == {"median_error", "second_half_max_error", "second_half_median_error",
                                 "within_1pct_from_step"}
    md = (tmp_path / "result.md").read_text()
    assert "Tracker against the exact eigenvalue" in md and md.count("| 0 | 8 |") == 1


def test_reference_steps_must_be_measurement_steps(tmp_path):
    from typer.testing import CliRunner

    from agora.cli import app

    result = CliRunner().invoke(app, ["bench", "training", "--preset", "tiny", "--sections", "curvature", "--steps", "20",
                                      "--curvature-reference", "10", "--curvature-reference-steps", "10,15",
                                      "--out", str(tmp_path)])
    assert result.exit_code == 2 and "must be measurement steps" in result.output
