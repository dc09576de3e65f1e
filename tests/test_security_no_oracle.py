"""SENTINEL's evaluation without an oracle (``agora.bench.sentinel_audits``), on real ``tiny`` training traffic:
auditors are real recomputations by replicas that may be a step off, absent or lying; held-out attacks have their
own rows; a colluding pair is not reported as caught for free."""

import pytest
import torch

from agora.bench.sentinel_audits import AuditedEvalOptions, Row, evaluate_audited
from agora.bench.sentinel_traffic import TrafficSize

STEPS = 36
HELD_OUT = {"rotate", "evade", "sub_tolerance"}


@pytest.fixture(scope="module")
def report():
    torch.set_num_threads(1)
    start = STEPS // 3
    rows = [
        Row("scale:4", "standard", "scale", 4.0, start),
        Row("stale:1", "standard", "stale", 1.0, start),
        Row("rotate:0.1", "held-out", "rotate", 0.1, start),
        Row("evade:0.8", "held-out", "evade", 0.8, start),
        Row("sub_tolerance:0.9", "held-out", "sub_tolerance", 0.9, start),
        Row("sleeper", "held-out", "bias", 0.5, 2 * STEPS // 3),
        Row("collude", "held-out", "stale", 1.0, start, colluding=True),
        Row("clean", "clean", None, 0.0, STEPS),
    ]
    return evaluate_audited(TrafficSize("tiny", STEPS, 4, 32), rows, AuditedEvalOptions(seed=0))


def _rows(report, **match):
    return [r for r in report["rows"] if all(r[k] == v for k, v in match.items())]


def test_the_traffic_is_real_training_and_recomputations_are_not_all_bitwise(report):
    t = report["traffic"]
    assert t["corpus"] == "sotu" and t["loss_last"] < t["loss_first"] - 1.0  # the model trained on real text
    # Odd replicas round differently: their recomputations differ from the message, but within the tolerance.
    assert t["same_version_nonbitwise"] > 0
    assert 0 < t["same_version_max_diff"] < t["audit_tolerance"]
    # Another step's weights compute something else, far beyond the tolerance (a version mix-up is not rounding).
    assert t["other_version_min_diff"] > 10 * t["audit_tolerance"]


def test_audits_are_not_always_possible_and_the_report_says_how_often(report):
    s = report["summary"]["standard, audits"]
    a = s["audits"]
    assert a["attempted"] > 20
    # Absent replicas and replicas a step off: not every audit is answered at the sender's version.
    assert a["usable"] < a["answered"] <= a["attempted"]
    assert 0.3 < s["audit_usable"] < 1.0 and s["audit_answered"] <= 1.0
    for r in _rows(report, setting="audits"):
        assert r["audits"]["attempted"] > 0 and r["audits"]["usable"] <= r["audits"]["attempted"], r
    for r in _rows(report, setting="statistics only"):
        assert r["audits"]["attempted"] == 0  # a middle stage's messages: nobody recomputes them


def test_held_out_attacks_have_their_own_rows(report):
    held = _rows(report, group="held-out")
    assert {r["kind"] for r in held} >= HELD_OUT | {"bias", "stale"}
    assert {(r["setting"], r["direction"]) for r in held} == {(s, d) for s in ("audits", "statistics only")
                                                              for d in ("fwd", "bwd")}
    assert all(r["corrupt_sent"] > 0 for r in held)  # they did attack
    summary = report["summary"]
    assert "held-out, audits" in summary and "held-out, statistics only" in summary
    assert summary["standard, audits"]["attackers"] == 4  # held-out rows are not mixed into the design set's


def test_a_colluding_pair_and_lying_auditors_are_not_reported_as_perfect(report):
    collude = _rows(report, label="collude", setting="audits")
    audits = [r["audits"] for r in collude]
    # The colluders vouch for each other: audits "confirmed" corrupted messages.
    assert sum(a["cleared_corrupt"] for a in audits) > 0, audits
    # They lie about honest messages, and two agreeing lies convict an honest sender.
    assert sum(a["lies"] for a in audits) > 0
    assert sum(a["convicted_honest"] for a in audits) + sum(r["honest_banned"] for r in collude) > 0, collude
    assert not all(r["attacker_banned"] for r in collude)
    assert report["summary"]["held-out, audits"]["f1"] < 1.0


def test_stale_messages_are_never_replays(report):
    # Forward only: a flagged gradient is retried on another tail, so the receiver may later see a stale gradient's
    # content once already (a replay it rightly catches); activations are retried out of its sight.
    for r in _rows(report, kind="stale", direction="fwd"):
        assert not any("replay" in reason for reason in r["first_reasons"]), r
    stats_only = _rows(report, label="stale:1", setting="statistics only")
    assert all(r["corrupt_sent"] > 10 for r in stats_only)
