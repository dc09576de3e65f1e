"""``agora bench training``'s curvature section end to end at a tiny size: every warm-up variant runs on equal
tokens, the curvature-driven one reports the steps it held, and the table has a row per variant."""

import json

from agora.bench.training import TrainingOptions, run


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
    no, steps, curv = runs[1], runs[2], runs[3]
    assert no["depth"] == [4] * 8 and no["all_blocks_at_step"] == 1
    assert steps["depth"][0] == 1 and steps["all_blocks_at_step"] == 4  # tiny: 4 blocks, all active at 0.5 x 8
    # the curvature-driven warm-up is the steps schedule, slowed by the steps it held: never deeper, and the same
    # before its first decision (a measurement two steps old exists from step 4 on)
    assert all(c <= d for c, d in zip(curv["depth"], steps["depth"])) and curv["depth"][:4] == steps["depth"][:4]
    if curv["held_steps"] == 0:
        assert curv["depth"] == steps["depth"]
    md = (tmp_path / "result.md").read_text()
    assert "steps held" in md and "error vs 10 more products" in md and md.count(f"| {runs[1]['lr']:.3g} |") == 3
    assert json.loads((tmp_path / "result.json").read_text())["curvature_runs"][3]["warmup"] == "curvature"
