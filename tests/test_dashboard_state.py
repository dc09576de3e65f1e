"""The dashboard's bookkeeping (no network): events from snapshot diffs, tokens/s, JSON safety."""

from __future__ import annotations

import json
import math

from agora.ops.dashboard.server import DashboardState, diff_events


def _snap(peers: list[tuple[str, int, str]], trainers=(), bans=()) -> dict:
    stages = [{"stage": s, "capacity_tokens_per_s": 1.0, "peers": []} for s in range(2)]
    for pid, stage, state in peers:
        stages[stage]["peers"].append({"peer_id": pid, "short_id": pid[-8:], "state": state, "throughput": 1.0,
                                       "step": 0, "samples": 0, "queue": 0, "metrics": {}})
    return {"run_id": "r", "manifest_hash": "h", "stages": stages, "bottleneck_stage": 0,
            "trainers": list(trainers), "tokens": sum(t["tokens"] for t in trainers), "microbatches": {},
            "bans": list(bans)}


def test_events_from_snapshot_diffs():
    a = _snap([("p0", 0, "serving"), ("p1", 1, "syncing"), ("p2", 1, "serving")])
    b = _snap([("p0", 0, "leaving"), ("p1", 1, "serving"), ("p3", 1, "joining")],
              bans=[{"publisher": "p0", "peer": "p3", "reason": "non_finite"}])
    events = diff_events(a, b, 1.0)
    kinds = [(e["kind"], e.get("peer")) for e in events]
    assert any("stage 0 has no serving peer" in e["text"] and e["level"] == "bad" for e in events)
    assert ("join", "p3") in kinds and ("leave", "p2") in kinds and ("ban", "p3") in kinds
    assert ("state", "p0") in kinds and ("state", "p1") in kinds
    c = _snap([("p1", 1, "serving")])
    texts = [e["text"] for e in diff_events(b, c, 2.0)]
    assert any("p0 left stage 0" in t for t in texts)  # it announced leaving first: a graceful leave
    assert diff_events(c, c, 3.0) == []


def test_tokens_per_second_survives_trainer_leaving_and_payload_is_json():
    st = DashboardState(layout=[2, 2])
    for i in range(12):
        trainers = [{"peer_id": "t", "tokens": 1000 * i, "loss": math.nan if i == 0 else 5.0 - i * 0.1}]
        st.update(_snap([("p0", 0, "serving")], trainers if i < 11 else []), now=100.0 + i)
    assert st.history[10]["tokens_per_s"] == 1000.0
    assert st.history[11]["tokens"] == 10_000  # the trainer's record vanished; its tokens still count
    payload = st.payload()
    json.dumps(payload, allow_nan=False)  # NaN loss became null
    assert payload["history"][0]["loss"] is None and payload["ready"] is True
    assert payload["events"][0]["kind"] == "trainer"  # newest first: the trainer left
