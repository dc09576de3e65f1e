"""SENTINEL on real boundary traffic of the tiny preset: attackers are banned fast, honest senders never."""

import math

import pytest
import torch

from agora.bench.sentinel_eval import (DRIFT_CLEAN, EVAL_STRENGTHS, evaluate, format_report, make_drift_trace, make_pool,
                                     run_drift_stream, run_stream)
from agora.sentinel import LossMonitor, SentinelConfig, SentinelMonitor

# "stale" (a real message of another microbatch, never sent before) is statistically honest: fingerprints cannot
# see it (see docs/SENTINEL.md); it is reported by the evaluation, not asserted here.
DETECTABLE = [k for k in EVAL_STRENGTHS if k != "stale"]
MAX_DELAY = 20


@pytest.fixture(scope="module")
def pool():
    torch.set_num_threads(1)
    return make_pool("tiny", n_sequences=240, seed=0, train_steps=50)


@pytest.fixture(scope="module")
def trace():
    """Traffic recorded while tiny trains for 120 steps (loss ~8.3 -> ~6): the honest statistics drift by many
    per-message spreads, fastest in the first 30 steps (what banned honest peers in live runs)."""
    torch.set_num_threads(1)
    return make_drift_trace("tiny", steps=120, senders=3, seed=0)


@pytest.mark.parametrize("direction", ["fwd", "bwd"])
@pytest.mark.parametrize("senders,per_step", DRIFT_CLEAN)
def test_clean_stream_while_training_bans_nobody(trace, senders, per_step, direction):
    assert trace.losses[-1] < trace.losses[0] - 1.5  # the model really trained under the monitor
    res = run_drift_stream(trace, direction, None, senders=senders, messages_per_step=per_step, seed=1)
    assert res.tn + res.fp == trace.steps * per_step
    assert res.honest_banned == 0, res
    assert res.honest_flag_rate <= 0.1, res  # dropped honest messages (most in the fastest early drift)


@pytest.mark.parametrize("direction", ["fwd", "bwd"])
@pytest.mark.parametrize("kind", DETECTABLE)
def test_attacker_banned_while_training(trace, kind, direction):
    """The attack starts a third of the way into training; the reference keeps following the honest drift."""
    res = run_drift_stream(trace, direction, kind, EVAL_STRENGTHS[kind][1], senders=3, messages_per_step=1)
    assert res.attacker_banned, (kind, direction, res)
    assert res.delay is not None and res.delay <= MAX_DELAY, (kind, direction, res.delay, res.first_reasons)
    assert res.honest_banned == 0


@pytest.mark.parametrize("direction", ["fwd", "bwd"])
def test_clean_stream_bans_nobody(pool, direction):
    res = run_stream(pool, direction, None, rounds=100, attack_start=100, seed=1)  # 300 messages, 3 honest
    assert res.tn + res.fp == 300
    assert res.honest_banned == 0 and not res.attacker_banned
    assert res.fp / 300 <= 0.01


@pytest.mark.parametrize("direction", ["fwd", "bwd"])
@pytest.mark.parametrize("kind", DETECTABLE)
def test_attacker_banned_within_bound(pool, kind, direction):
    strength = EVAL_STRENGTHS[kind][1]  # the moderate strength
    res = run_stream(pool, direction, kind, strength, rounds=50, attack_start=20, seed=0)
    assert res.attacker_banned, (kind, direction, res)
    assert res.delay is not None and res.delay <= MAX_DELAY, (kind, direction, res.delay, res.first_reasons)
    assert res.honest_banned == 0
    assert res.honest_flag_rate <= 0.02  # honest messages dropped: the METHODS target is < 1 % on clean runs


@pytest.mark.parametrize("kind,strength", [("scale", 4.0), ("gaussian", 1.0), ("sign_flip", 1.0)])
def test_attacker_present_from_the_start_is_caught_after_warmup(pool, kind, strength):
    """Warm-up statistics are median/MAD and warm-up messages are re-scored, so a sender corrupting from its first
    message is banned when warm-up ends instead of being learnt as normal."""
    cfg = SentinelConfig()
    res = run_stream(pool, "fwd", kind, strength, cfg, rounds=40, attack_start=0, seed=2)
    assert res.attacker_banned and res.honest_banned == 0
    assert res.delay <= cfg.warmup // 3 + MAX_DELAY


def test_replay_is_flagged_but_a_retry_is_not():
    mon = SentinelMonitor(SentinelConfig(warmup=1000))
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 16, 8, generator=g)
    tok_a, tok_b = torch.randint(0, 100, (4, 16), generator=g), torch.randint(0, 100, (4, 16), generator=g)
    assert not mon.observe("p", 0, "fwd", x, tokens=tok_a).flagged
    assert not mon.observe("p", 0, "fwd", x.clone(), tokens=tok_a).flagged  # same microbatch again: a retry
    v = mon.observe("p", 0, "fwd", x + 1e-3 * torch.randn(x.shape, generator=g), tokens=tok_b)
    assert v.flagged and v.reasons[0].startswith("replay")
    assert not mon.observe("q", 0, "fwd", torch.randn(4, 16, 8, generator=g), tokens=tok_b).flagged


def test_nonfinite_bans_at_once_and_bans_persist():
    mon = SentinelMonitor()
    x = torch.randn(2, 8, 8)
    x[0, 0, 0] = float("nan")
    v = mon.observe("bad", 1, "bwd", x)
    assert v.flagged and v.banned and v.reasons == ["non_finite"] and math.isinf(v.score)
    later = mon.observe("bad", 1, "bwd", torch.randn(2, 8, 8))
    assert later.banned and later.flagged and later.reasons == ["banned"]
    assert mon.banned_peers() == {"bad"}
    mon.unban("bad")
    assert not mon.banned("bad")


def test_features_absent_during_warmup_are_not_scored(pool):
    """pair_align needs the forward message the receiver sent; a caller that starts passing it late must not get
    flags from a feature that has no honest reference."""
    mon = SentinelMonitor(SentinelConfig(warmup=12))
    g = torch.Generator().manual_seed(0)
    for i in range(30):
        idx = torch.randint(0, pool.fwd.shape[0], (8,), generator=g)
        v = mon.observe(f"p{i % 3}", 0, "bwd", pool.bwd[idx], tokens=pool.tokens[idx],
                        paired=pool.fwd[idx] if i >= 12 else None)
        # (a 12-message warm-up is a rough reference, so an occasional flag on another feature may happen; what
        # must never happen is a verdict from the feature that had no reference)
        assert not any("pair_align" in r for r in v.reasons), v.reasons
        assert not v.banned


def test_monitor_is_deterministic(pool):
    a = run_stream(pool, "bwd", "bias", 0.5, rounds=30, attack_start=20, seed=3)
    b = run_stream(pool, "bwd", "bias", 0.5, rounds=30, attack_start=20, seed=3)
    assert a == b


def test_loss_monitor_blames_the_attacker_not_its_path_mates():
    rng = torch.Generator().manual_seed(0)
    mon = LossMonitor()
    heads, tails = ["h0", "h1", "h2"], ["t0", "t1", "bad"]
    banned = []
    for i in range(400):
        h = heads[int(torch.randint(0, 3, (1,), generator=rng))]
        t = tails[int(torch.randint(0, 3, (1,), generator=rng))]
        loss = 3.0 + 0.05 * float(torch.randn(1, generator=rng))
        if t == "bad" and i >= 100:
            loss += 1.0  # e.g. sign-flipped activations: the loss jumps on paths through it
        v = mon.observe(loss, [h, t])
        banned += v.banned
    assert banned == ["bad"]
    assert mon.path_excess(1, "bad") > 3 and abs(mon.path_excess(0, "h0")) < 3


def test_evaluate_report_smoke(pool):
    report = evaluate(pool=pool, strengths={"scale": (4.0,)}, rounds=30, attack_start=20, clean_rounds=20)
    assert {r["direction"] for r in report["attacks"]} == {"fwd", "bwd"}
    assert all(r["attacker_banned"] for r in report["attacks"])
    assert "scale" in format_report(report)


def _warm_monitor(pool, senders=("a", "b", "c"), version=(7, 1.5), rounds=30):
    """A monitor past its warm-up on honest forward traffic of ``senders`` (all claiming ``version``), and a
    function giving honest microbatch ``i`` (message, tokens) from the pool's sequences."""
    mon = SentinelMonitor()
    B = pool.microbatch

    def microbatch(i: int):  # a seeded draw of sequences: a distinct microbatch per i
        idx = torch.randperm(pool.fwd.shape[0], generator=torch.Generator().manual_seed(1000 + i))[:B]
        return pool.fwd[idx], pool.tokens[idx]

    i = 0
    for _ in range(rounds):
        for who in senders:
            msg, tok = microbatch(i)
            i += 1
            assert not mon.observe(who, 0, "fwd", msg, step=version[0], tokens=tok, version=version).flagged
    return mon, microbatch, i


def test_a_flag_reproduced_exactly_by_another_replica_is_withdrawn(pool):
    """Replicas with the same weights compute bit-identical messages: when a receiver retries a flagged
    microbatch on another replica and gets the exact same content back, the flag was the reference's fault
    (here: the whole stage's output really changed scale), so neither sender is struck and the message is used."""
    mon, microbatch, i = _warm_monitor(pool)
    msg, tok = microbatch(i)
    shifted = 3.0 * msg  # what every replica now computes
    first = mon.observe("a", 0, "fwd", shifted, step=8, tokens=tok, version=[8, 2.5])
    assert first.flagged and "log_rms" in first.reasons[0]
    again = mon.observe("b", 0, "fwd", shifted.clone(), step=8, tokens=tok, version=[8, 2.5])
    assert not again.flagged and "reproduced" in again.reasons[0]
    # The reference was re-anchored on the new output: the stage's next messages pass, nobody is struck.
    flags = 0
    for j in range(1, 31):
        msg, tok = microbatch(i + j)
        flags += mon.observe("abc"[j % 3], 0, "fwd", 3.0 * msg, step=8, tokens=tok, version=[8, 2.5]).flagged
    assert flags <= 3, flags
    struck = [r for st in mon.summary()["0/fwd"]["senders"].values() for r in st["struck"]]
    assert not any("log_rms" in r for r in struck), struck  # (an honest outlier may cost a strike, not the shift)
    assert not mon.banned_peers()


def test_a_flagged_message_the_same_weights_did_not_compute_is_struck(pool):
    """The other way round: the retry on a replica claiming the same weights returns a different, accepted
    message for the same input. The first sender's flag is confirmed at once, and three such bans it."""
    mon, microbatch, i = _warm_monitor(pool)
    for j in range(3):
        msg, tok = microbatch(i + j)
        assert mon.observe("a", 0, "fwd", 3.0 * msg, step=7, tokens=tok, version=[7, 1.5]).flagged
        assert mon.strikes("a") == j  # pending: not struck until compared
        assert not mon.observe("b", 0, "fwd", msg, step=7, tokens=tok, version=(7, 1.5)).flagged
        assert mon.strikes("a") == j + 1
    assert mon.banned("a") and not mon.banned("b") and not mon.banned("c")


def test_flags_of_a_replica_alone_on_its_weights_weigh_a_third(pool):
    """A replica whose parameters differ from its peers' at the same step (it missed an averaging round) is
    compared with nobody: its flags expire as a third of a strike each, so a short divergence bans nobody,
    while a sender that keeps claiming weights nobody else has is still banned after 9 flags."""
    mon, microbatch, i = _warm_monitor(pool)
    n = 0

    def honest_round():
        nonlocal i
        for who in ("b", "c"):
            msg, tok = microbatch(i)
            i += 1
            mon.observe(who, 0, "fwd", msg, step=7, tokens=tok, version=(7, 1.5))

    for n in range(1, 10):
        msg, tok = microbatch(i)
        i += 1
        assert mon.observe("a", 0, "fwd", 3.0 * msg, step=7, tokens=tok, version=(7, 9.9)).flagged
        for _ in range(7):  # past the flag's wait (``common_recent`` stream messages)
            honest_round()
        if n < 9:
            assert not mon.banned("a"), n
            assert mon.strikes("a") == pytest.approx(n / 3)
    assert mon.banned("a") and not mon.banned("b") and not mon.banned("c")


def test_a_receiver_bans_at_most_a_minority_of_its_senders_on_statistics(pool):
    """Honest replicas are the majority (the premise of comparing a sender with its peers). Two of three senders
    going odd in different ways cannot both be banned on statistics (without the cap both are); one is. A hard
    verdict (NaN) still bans anyone."""
    mon, microbatch, i = _warm_monitor(pool)
    for j in range(30):
        msg, tok = microbatch(i + j)
        factor = {0: 3.0, 1: 0.3, 2: 1.0}[j % 3]  # a too loud, b too quiet, c honest
        mon.observe("abc"[j % 3], 0, "fwd", factor * msg, step=7, tokens=tok, version=(7, 1.5))
    assert len(mon.banned_peers()) == 1 and mon.banned_peers() <= {"a", "b"}, mon.banned_peers()
    nan = torch.full_like(microbatch(0)[0], float("nan"))
    for who in "abc":
        mon.observe(who, 0, "fwd", nan, step=7, tokens=microbatch(99)[1])
    assert mon.banned_peers() == {"a", "b", "c"}


def test_a_peer_is_dropped_swarm_wide_only_when_a_quorum_of_publishers_banned_it():
    from agora.net.records import BAN_QUORUM, quorate_bans

    h = "hash"
    published = {
        "p1": {"manifest_hash": h, "banned": ["evil", "victim"]},  # a liar (or a receiver with a broken reference)
        "p2": {"manifest_hash": h, "banned": ["evil", "p2"]},  # banning itself counts for nothing
        "p3": {"manifest_hash": "other run", "banned": ["evil", "victim"]},
        "p4": "garbage",
    }
    assert BAN_QUORUM == 2
    assert quorate_bans(published, h) == {"evil"}
    assert quorate_bans(published, h, quorum=1) == {"evil", "victim"}
    assert quorate_bans(published, h, publishers={"p1", "p3"}) == set()  # p2 does not serve: its vote is void


def test_an_audit_bans_what_no_statistic_sees_and_needs_two_agreeing_recomputations(pool):
    """``stale``: the real message of another microbatch is statistically honest. A recomputation of the same input
    by replicas with the same weights exposes it; one disagreeing auditor is not enough (it may be the liar), two
    that agree are; an auditor contradicted by another that confirms the message is struck itself; recomputations
    of other weights prove nothing."""
    mon, microbatch, i = _warm_monitor(pool)
    v = (7, 1.5)
    real, _ = microbatch(i)
    stale, tok = microbatch(i + 1)[0], microbatch(i)[1]  # another microbatch's real message, sent for this one
    mon.observe("a", 0, "fwd", stale, step=7, tokens=tok, version=v)  # an honest-looking message
    assert "second" in mon.recomputed("a", 0, "fwd", stale, v, [("b", real, v)]).reasons[0]
    assert "inconclusive" in mon.recomputed("a", 0, "fwd", stale, v, [("b", real, (7, 2.5)), ("c", real, (8, 1.5))]
                                            ).reasons[0]
    assert mon.strikes("a") == 0
    # ... unless statistics flagged the message too: then one disagreeing recomputation is a (whole) strike.
    assert mon.recomputed("z", 0, "fwd", stale, v, [("b", real, v)], suspected=True).flagged
    assert mon.strikes("z") == 1
    verdict = mon.recomputed("a", 0, "fwd", stale, v, [("b", real, v), ("c", real.clone(), [7, 1.5])])
    assert verdict.flagged and not verdict.banned and "differs" in verdict.reasons[0]
    assert mon.recomputed("a", 0, "fwd", stale, v, [("b", real, v), ("c", real, v)]).banned  # two failed audits
    # A sender claiming no fingerprint is held to what two agreeing replicas at its step compute.
    assert mon.recomputed("x", 0, "fwd", stale, [7, None], [("b", real, v), ("c", real, (7, 1.5))]).flagged
    assert not mon.recomputed("x", 0, "fwd", stale, [7, None], [("b", real, (8, 2.5))]).flagged
    # An honest message: one confirming auditor clears it; a lying auditor is struck only when two confirm.
    mon.recomputed("b", 0, "fwd", real, v, [("c", 2 * real, v), ("d", real, v)])
    assert mon.strikes("c") == 0 and mon.strikes("b") == 0
    mon.recomputed("b", 0, "fwd", real, v, [("c", 2 * real, v), ("d", real, v), ("e", real.clone(), v)])
    assert mon.strikes("c") == pytest.approx(1.5) and mon.strikes("b") == 0
