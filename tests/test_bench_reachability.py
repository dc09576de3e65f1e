"""``agora bench reachability``: a node behind a firewall against the same swarm with every peer open."""

import json

import pytest

from agora.bench.reachability import ReachabilityOptions, check_options, run
from agora.lab import netem
from agora.lab.demo import DemoOptions, LinkOptions, SwarmShape, run_demo


@pytest.mark.parametrize("bad", [dict(replicas=1), dict(firewalled=()), dict(firewalled=(3,)), dict(steps=0),
                                 dict(mbps=0.0), dict(mbps=float("nan")), dict(repeats=0)])
def test_bad_options_are_refused_before_anything_runs(bad):
    with pytest.raises(ValueError):
        check_options(ReachabilityOptions(**bad))


def test_a_firewalled_stage_that_does_not_exist_or_without_namespaces_is_refused(tmp_path):
    shape = SwarmShape(preset="tiny", stages=2)
    with pytest.raises(ValueError, match="not in 0..1"):
        run_demo(DemoOptions(out=tmp_path / "a", shape=shape, link=LinkOptions(mbps=20.0, refuse_inbound=(2,)),
                             live=False))
    with pytest.raises(RuntimeError, match="needs the netns link backend"):
        run_demo(DemoOptions(out=tmp_path / "b", shape=shape, live=False,
                             link=LinkOptions(mbps=20.0, backend="transport", refuse_inbound=(1,))))


fw_ok, fw_reason = netem.firewall_available()


@pytest.mark.skipif(not fw_ok, reason=f"cannot build a namespace that refuses inbound connections: {fw_reason}")
def test_tiny_swarm_with_a_firewalled_head_against_an_open_one(tmp_path):
    """The head's first replica behind a firewall: only the connection it opens to the trainer lets the trainer
    reach it. Both runs finish at exactly the same tokens and the watched replica does its share of the work."""
    steps = 3
    result = run(tmp_path, ReachabilityOptions(preset="tiny", stages=2, replicas=2, in_flight=2, mbps=50.0,
                                               firewalled=(0,), steps=steps, eval_every=steps, val_batches=1,
                                               repeats=1), log=lambda _: None)
    rows = {r["variant"]: r for r in result["rows"]}
    assert set(rows) == {"open", "firewalled"}
    for variant, row in rows.items():
        assert row["finished"] and row["tokens"] == result["tokens"] == steps * 16 * 64, variant
        assert set(row["steps_per_stage"].values()) == {steps}, row["steps_per_stage"]
        (watched,) = row["watched"]
        assert watched["stage"] == 0 and watched["firewalled"] == (variant == "firewalled")
        assert watched["reachability"] == ("unreachable" if variant == "firewalled" else "direct")
        assert watched["connection_samples"] >= 1
        assert watched["latency_s"] is not None and watched["sibling_latency_s"] is not None
        assert 0.0 < watched["forward_share"] < 1.0, watched  # both head replicas computed microbatches
    summary = result["summary"]
    assert summary["firewalled"]["reachability"] == ["unreachable"] and summary["open"]["reachability"] == ["direct"]
    assert summary["throughput_ratio"]["n"] == 1 and summary["val_loss_rel_diff"]["n"] == 1
    written = json.loads((tmp_path / "result.json").read_text())
    assert written["benchmark"] == "reachability"
    assert "Firewalled over open" in (tmp_path / "result.md").read_text()


def test_a_trainer_that_trained_its_whole_share_and_left_is_not_an_early_exit(tmp_path):
    """In an exact-token run a trainer exits after training its share. If the status the demo read last from the
    DHT did not show its final count yet (a store is not waited for at exit: CI, 2026-12-05, under a 50 Mbit/s
    namespace cap), it is still done, not "exited early"; training ends once every trainer is, and the stages'
    settle wait counts from when the last one finished."""
    import types

    from agora.lab.demo import DemoOptions, DemoRun, StopRule, SwarmShape

    run = DemoRun(DemoOptions(out=tmp_path, shape=SwarmShape(preset="tiny", stages=2),
                              stop=StopRule(steps=2, exact_tokens=True), live=False))

    def child(alive: bool, code, summary: dict):
        return types.SimpleNamespace(alive=alive, proc=types.SimpleNamespace(returncode=code),
                                     current=lambda: summary)

    done = child(False, 0, {"tokens": 1024, "max_tokens": 1024, "started_at": 100.0, "wall_s": 20.0})
    short = child(False, 0, {"tokens": 512, "max_tokens": 1024, "started_at": 100.0, "wall_s": 9.0})
    crashed = child(False, 1, {"tokens": 1024, "max_tokens": 1024, "started_at": 100.0, "wall_s": 5.0})
    running = child(True, None, {"tokens": 512, "max_tokens": 1024})
    assert run._trained_share(done) == 120.0
    assert run._trained_share(short) is None and run._trained_share(crashed) is None
    assert run._trained_share(running) is None
    for trainers, finished in (([done], 120.0), ([done, running], None), ([done, short], None), ([], None)):
        run.swarm = types.SimpleNamespace(trainers=lambda t=trainers: t)
        assert run._trainers_finished() == finished, trainers
