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
