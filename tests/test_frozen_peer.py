"""A frozen peer (SIGSTOP of its whole process group, as a closed laptop lid looks from outside) stalls nobody for
long: calls to it are hedged to its other replica, and when it wakes it drops what it held (server/freeze.py)."""

from __future__ import annotations

from swarm_util import run_chaos_demo


def test_a_frozen_replica_is_hedged_around_and_drops_its_in_flight_work_when_it_wakes(tmp_path):
    from agora.lab.demo import ChaosOptions

    summary = run_chaos_demo(tmp_path / "frozen", ChaosOptions(every_s=12.0, fault="stop", stop_s=14.0), 30)
    assert summary["finished"]
    freezes = summary["chaos_kills"]
    assert freezes and all(k["fault"] == "stop" for k in freezes), freezes
    nodes = {n["name"]: n for n in summary["nodes"]}
    # The first victim (frozen the full 14 s; later ones may be thawed early, when training ends) noticed its
    # freeze when it woke: the monotonic clock ran on while it was stopped.
    first = nodes[freezes[0]["killed"]]
    assert first["freezes"] >= 1 and first["frozen_s"] >= 10.0, first
    # Calls to the frozen peer were hedged (the trainer's to a head, or a head's to a tail) instead of waiting for
    # the 30 s timeout, so the pipeline went on. Not below 10 s (the target) here: a replica frozen in the
    # middle of an all-reduce holds its partner in the round for hivemind's sender + reducer timeouts (15 s).
    mb = summary["microbatches"]
    hedged = mb["hedged"] + sum(n["hedges_downstream"] for n in summary["nodes"])
    assert hedged >= 1, (mb, nodes)
    train_end = summary["train_started_s"] + 30.0
    done = [c[1] for c in summary["completions"] if freezes[0]["t"] - 2.0 < c[1] <= train_end]
    gaps = [b - a for a, b in zip(done, done[1:])] + [train_end - done[-1]]
    assert max(gaps) < 25.0, (gaps, freezes)
    assert mb["abandoned"] <= mb["completed"] // 5, mb
    div = summary["replica_divergence"]
    compared = [v for v in div["stages"].values() if v["replicas"] >= 2]
    assert div["settled"] and all(v["max_abs_diff"] < 1e-6 for v in compared), div
