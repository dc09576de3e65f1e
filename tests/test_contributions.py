"""Verified contribution accounting: a peer's work counts only as far as the peers that received it vouch for it."""

from __future__ import annotations

import math

from agora.ops.status import acknowledged_counts, annotate_contributions, render_status

H = "hash1"


def _stages(forward_by_peer: dict[str, int]) -> list[dict]:
    return [{"stage": 0, "capacity_tokens_per_s": 1.0,
             "peers": [{"peer_id": p, "short_id": p[-8:], "state": "serving", "throughput": 1.0, "step": 3,
                        "samples": 0, "queue": 0, "metrics": {"forward": f}} for p, f in forward_by_peer.items()]}]


def test_acknowledged_counts_sum_over_other_receivers():
    tables = {
        "trainerA": {"manifest_hash": H, "acks": {"head1": 10, "head2": 4}},
        "trainerB": {"manifest_hash": H, "acks": {"head1": 5}},
        "head1": {"manifest_hash": H, "acks": {"tail1": 15}},
    }
    assert acknowledged_counts(tables, H) == {"head1": 15, "head2": 4, "tail1": 15}


def test_self_vouching_and_inflated_claims_change_nothing():
    honest = {
        "trainerA": {"manifest_hash": H, "acks": {"cheat": 3, "head2": 7}},
        "cheat": {"manifest_hash": H, "acks": {"tail1": 3}},
    }
    baseline = acknowledged_counts(honest, H)
    # The cheater vouches for itself in its own table (under its own subkey) with a huge count ...
    inflated = dict(honest, cheat={"manifest_hash": H, "acks": {"tail1": 3, "cheat": 10**9}})
    assert acknowledged_counts(inflated, H) == baseline == {"cheat": 3, "head2": 7, "tail1": 3}
    # ... and claims a huge forward count in its own stage record: its claim grows, its acknowledged count does not.
    stages = _stages({"cheat": 10**9, "head2": 7})
    annotate_contributions(stages, inflated, H)
    by_id = {p["peer_id"]: p for p in stages[0]["peers"]}
    assert by_id["cheat"]["claimed"] == 10**9 and by_id["cheat"]["acknowledged"] == 3
    assert by_id["head2"]["claimed"] == 7 and by_id["head2"]["acknowledged"] == 7


def test_foreign_and_malformed_tables_are_ignored():
    tables = {
        "other_run": {"manifest_hash": "other", "acks": {"head1": 100}},
        "junk1": "not a dict",
        "junk2": {"manifest_hash": H, "acks": ["head1"]},
        "junk3": {"manifest_hash": H, "acks": {"head1": -50, "head2": math.nan, "head3": "7", "head4": True}},
        "ok": {"manifest_hash": H, "acks": {"head1": 2.0}},
    }
    assert acknowledged_counts(tables, H) == {"head1": 2}


def test_render_status_shows_claimed_and_acknowledged():
    stages = _stages({"peerAAAAAAAA": 9})
    annotate_contributions(stages, {"t": {"manifest_hash": H, "acks": {"peerAAAAAAAA": 8}}}, H)
    snap = {"run_id": "r", "manifest_hash": H, "stages": stages, "bottleneck_stage": 0, "trainers": [],
            "tokens": 0, "microbatches": {}}
    table = render_status(snap)
    headers = [c.header for c in table.columns]
    assert "claimed" in headers and "acked" in headers
    assert list(table.columns[headers.index("claimed")].cells) == ["9"]
    assert list(table.columns[headers.index("acked")].cells) == ["8"]
