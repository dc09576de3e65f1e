"""``agora bench averaging``'s bookkeeping: every scheme maps to the swarm's averaging spec, and the table compares
each arm with ``full`` under the same condition (the swarm runs themselves are the benchmark, not a test)."""

import pytest

from agora.bench.averaging import SCHEMES, AveragingOptions, known_scheme, summarize
from agora.lab.demo_setup import averaging_section


def test_every_scheme_is_a_valid_averaging_spec():
    opts = AveragingOptions(every=5)
    specs = {s: opts.averaging_spec(s) for s in SCHEMES}
    assert specs["gossip_q3"] == "gossip,every=5,q=3" and specs["diloco"] == "diloco,every=5"
    for scheme, spec in specs.items():
        section = averaging_section(spec)
        assert section["scheme"] == scheme.split("_")[0], (scheme, section)
    with pytest.raises(ValueError, match="unknown scheme"):
        opts.averaging_spec("allreduce")
    # A codec after diloco or gossip; the manifest validates the combination.
    from agora.config import load_manifest
    assert opts.averaging_spec("diloco+uint8") == "diloco,every=5,codec=uint8"
    assert load_manifest("tiny").with_overrides(
        averaging=averaging_section(opts.averaging_spec("gossip_q1+float16"))).averaging.codec == "float16"
    assert known_scheme("diloco+float16") and not known_scheme("full+float16") and not known_scheme("diloco+int4")
    with pytest.raises(ValueError, match="only follows diloco or gossip"):
        opts.averaging_spec("powersgd+float16")


def test_the_summary_compares_with_full_under_the_same_condition():
    def arm(scheme, condition, val, train_s, seed=0):
        return {"seed": seed, "scheme": scheme, "condition": condition, "val_loss": val, "loss_ratio": val / 5.0,
                "train_s": train_s, "utilisation": 0.5, "averaging_bytes_per_step": 100.0,
                "consensus_distance": None, "longest_stall_s": 1.0, "kills": 0}

    rows = summarize([arm("full", "clean", 5.0, 100.0), arm("gossip_q1", "clean", 5.5, 25.0),
                      arm("full", "capped", 6.0, 400.0), arm("gossip_q1", "capped", 6.0, 100.0),
                      arm("gossip_q1", "capped", 6.6, 300.0, seed=1)])
    assert rows["clean/gossip_q1"]["vs_full_loss"] == pytest.approx(1.1)
    assert rows["clean/gossip_q1"]["full_time_over_this"] == pytest.approx(4.0)
    assert rows["capped/gossip_q1"]["val_loss"] == pytest.approx(6.3)  # median over seeds
    assert rows["capped/gossip_q1"]["full_time_over_this"] == pytest.approx(2.0)
    assert rows["capped/full"]["vs_full_loss"] == 1.0 and rows["clean/full"]["consensus_distance"] is None


def test_an_arm_stopped_at_its_timeout_is_a_bound_not_a_time(tmp_path):
    """A `full` arm that never finished (the issue's 4 Mbit/s case) gives a lower bound on its time, and so only a
    lower bound on how much sooner a finished arm was; the table says so instead of printing a time."""
    from agora.bench.averaging import AveragingOptions, _write

    def arm(scheme, train_s, bound=None, steps=12):
        return {"seed": 0, "scheme": scheme, "condition": "capped", "finished": bound is None,
                "val_loss": 6.0 if bound is None else None, "loss_ratio": None, "train_s": train_s,
                "train_s_at_least": bound, "steps_completed": steps, "utilisation": None,
                "averaging_bytes_per_step": 1.0, "consensus_distance": None, "longest_stall_s": 1.0, "kills": 0}

    arms = [arm("full", None, bound=1400.0, steps=3), arm("gossip_q1+uint8", 350.0)]
    rows = summarize(arms)
    assert rows["capped/full"]["unfinished"] == 1 and rows["capped/full"]["train_s"] is None
    assert rows["capped/gossip_q1+uint8"]["full_time_over_this"] is None
    assert rows["capped/gossip_q1+uint8"]["full_time_over_this_at_least"] == pytest.approx(4.0)
    _, md = _write(tmp_path, AveragingOptions(), arms)
    assert "> 1400 (unfinished: 3 steps)" in md and "| > 4.00 |" in md
    # one full seed finished, one did not: the median of time and bound (850), not the finished seed's 300 alone
    mixed = summarize([dict(arm("full", 300.0), seed=1), arm("full", None, bound=1400.0, steps=3),
                       arm("gossip_q1+uint8", 100.0)])
    assert mixed["capped/gossip_q1+uint8"]["full_time_over_this"] is None
    assert mixed["capped/gossip_q1+uint8"]["full_time_over_this_at_least"] == pytest.approx(8.5)
