"""What an attacking replica costs the model, with and without SENTINEL (``agora.bench.loss_impact``)."""

import pytest
import torch

from agora.bench.loss_impact import loss_impact, train_under_attack

STEPS = 60  # tiny: validation loss ~8.3 -> ~6.3; the attack runs from step 20


@pytest.fixture(scope="module")
def clean():
    torch.set_num_threads(1)
    return train_under_attack("tiny", None, steps=STEPS)


def test_a_sign_flipping_head_hurts_the_model_unless_sentinel_bans_it(clean):
    """A head that flips the sign of every activation it sends: left alone it costs several percent of validation
    loss at equal tokens; behind SENTINEL it is banned within a few steps, and the model ends within 2 % of the
    clean run (the issue's goal)."""
    assert clean["honest_banned"] == 0
    bare = train_under_attack("tiny", "sign_flip", 1.0, "fwd", steps=STEPS, defend=False)
    assert bare["val_loss"] > 1.03 * clean["val_loss"], (bare["val_loss"], clean["val_loss"])
    assert bare["corrupt_used"] > 0 and bare["corrupt_dropped"] == 0, bare  # undefended: every corruption trains
    defended = train_under_attack("tiny", "sign_flip", 1.0, "fwd", steps=STEPS)
    assert defended["attacker_banned_at_step"] is not None
    assert defended["attacker_banned_at_step"] <= STEPS // 3 + 10
    assert defended["honest_banned"] == 0
    assert defended["val_loss"] <= 1.02 * clean["val_loss"], (defended["val_loss"], clean["val_loss"])
    # What the defence let through before the ban is counted, and it is a small share of what the attacker sent.
    assert defended["corrupt_dropped"] > 0, defended
    assert defended["corrupt_used"] < 0.5 * bare["corrupt_used"], (defended, bare)
    # No corrupted message reached the optimizer: the defended run *is* the clean run (a ratio of 1 by construction).
    assert defended["corrupt_used"] == 0 and defended["val_loss"] == clean["val_loss"]


def test_loss_impact_reports_corruption_used_with_audits_and_on_statistics_alone():
    """A stale head (real messages of other microbatches) looks honest to every statistic: on statistics alone its
    messages reach the optimizer, the run is trained on its own, and the report says how many were used. A
    defended run is reported as the clean run exactly when it used no corrupted message."""
    torch.set_num_threads(1)
    report = loss_impact("tiny", strengths={"stale": (1.0,)}, steps=30, directions=("fwd",))
    rows = {r["audits"]: r for r in report["rows"]}
    assert set(rows) == {True, False} and set(report["worst_ratio"]) == {"audits", "statistics only"}
    for r in rows.values():
        assert r["same_as_clean"] == (r["corrupt_used"] == 0), r
        assert (r["ratio"] == 1.0) == r["same_as_clean"], r
        assert r["undefended_ratio"] is not None
    stats = rows[False]
    assert stats["corrupt_used"] > 0 and stats["attacker_banned_at_step"] is None, stats
