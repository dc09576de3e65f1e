"""Attack injection: spec parsing, each kind's effect, and wrapping a real StageNode without editing node.py."""

import asyncio
import math
from types import SimpleNamespace

import pytest
import torch

from agora.config import load_manifest
from agora.lab.attacks import (
    ATTACK_KINDS,
    AttackSpec,
    AttackSpecError,
    AttackState,
    apply_attack,
    attack_filter,
    install_attack,
    parse_attack,
)
from agora.server.node import StageNode
from agora.wire import compress

MAN = load_manifest("tiny")


def test_parse_attack():
    assert parse_attack("scale:4") == AttackSpec("scale", 4.0, "both")
    assert parse_attack("gaussian:0.5@bwd") == AttackSpec("gaussian", 0.5, "bwd")
    assert parse_attack("nan").strength == 1.0
    assert parse_attack("Sign-Flip").kind == "sign_flip"
    for bad, words in [("explode:3", "unknown attack kind"), ("scale:x", "not a number"), ("zero:2", "fraction"),
                       ("replay:0.5", "integer"), ("scale:4@sideways", "target"), ("gaussian:-1", ">= 0")]:
        with pytest.raises(AttackSpecError, match=words):
            parse_attack(bad)


@pytest.mark.parametrize("kind", ATTACK_KINDS)
def test_each_kind_keeps_shape_and_dtype(kind):
    x = torch.randn(2, 8, 4, dtype=torch.bfloat16)
    out = apply_attack(kind, parse_attack(kind).strength, x, torch.Generator().manual_seed(0), AttackState())
    assert out.shape == x.shape and out.dtype == x.dtype


def test_kinds_do_what_they_say():
    g, x = torch.Generator().manual_seed(0), torch.randn(16, 32, 8)
    rms = x.pow(2).mean().sqrt()
    noise = apply_attack("gaussian", 0.5, x, g, AttackState()) - x
    assert abs(noise.std() / rms - 0.5) < 0.05
    assert torch.equal(apply_attack("sign_flip", 1.0, x, g, AttackState()), -x)
    half = apply_attack("sign_flip", 0.5, x, g, AttackState())
    flipped = (half == -x).all(-1)
    assert flipped.float().mean() == 0.5 and ((half == x).all(-1) | flipped).all()  # whole tokens flip
    assert torch.equal(apply_attack("scale", 4.0, x, g, AttackState()), 4 * x)
    assert apply_attack("zero", 1.0, x, g, AttackState()).abs().sum() == 0
    assert (apply_attack("zero", 0.25, x, g, AttackState()) == 0).all(-1).float().mean() == 0.25
    shift = apply_attack("bias", 0.5, x, g, AttackState()) - x
    assert torch.allclose(shift, shift[0, 0].expand_as(shift)) and abs(shift.pow(2).mean().sqrt() / rms - 0.5) < 1e-4
    nan = apply_attack("nan", 0.001, x, g, AttackState())
    assert 1 <= int(nan.isnan().sum()) <= math.ceil(0.001 * x.numel())


def test_replay_resends_and_stale_sends_unsent_messages():
    g, st = torch.Generator().manual_seed(0), AttackState()
    msgs = [torch.full((2, 3), float(i)) for i in range(4)]
    st.remember(msgs[0])
    sent = [apply_attack("replay", 1, m, g, st) for m in msgs[1:]]
    assert all(torch.equal(s, msgs[0]) for s in sent)  # a lazy peer re-sends what it sent before
    st = AttackState()
    st.remember(msgs[0])  # sent: a stale attacker never sends it again
    st.spare(torch.full((2, 3), -1.0))  # computed on its own data and kept
    stale = [apply_attack("stale", 1, m, g, st) for m in msgs[1:]]
    assert [float(s[0, 0]) for s in stale] == [-1.0, 1.0, 2.0]  # then the previous microbatch's real message
    # Without a spare, the first stale message is the microbatch's sequences in another order (never sent).
    x = torch.arange(12.0).reshape(3, 2, 2)
    first = apply_attack("stale", 1, x, g, AttackState())
    assert torch.equal(first, torch.roll(x, 1, dims=0)) and not torch.equal(first, x)


def test_held_out_kinds():
    from agora.sentinel import SentinelConfig
    from agora.sentinel.features import relative_difference

    g, x = torch.Generator().manual_seed(0), torch.randn(4, 32, 8)
    rotated = apply_attack("rotate", 0.1, x, g, AttackState())
    assert torch.allclose(rotated.norm(dim=-1), x.norm(dim=-1), rtol=1e-4)  # per-token norms kept
    assert 0.01 < relative_difference(rotated, x) < 0.1
    faint = apply_attack("sub_tolerance", 0.9, x, g, AttackState())
    assert relative_difference(faint, x) == pytest.approx(0.9 * SentinelConfig().audit_tolerance, rel=1e-3)
    st, shifts = AttackState(), []
    for i in range(12):
        honest = torch.randn(4, 32, 8, generator=g)
        shifts.append(relative_difference(apply_attack("evade", 0.8, honest, g, st), honest))
    assert shifts[:8] == [0.0] * 8  # it learns its honest spread first
    assert all(0 < s < 1 for s in shifts[8:]), shifts  # then shifts, within bounds


def test_a_sleeper_behaves_for_its_first_messages():
    spec = parse_attack("scale:3@fwd,after=2")
    assert spec.after == 2 and str(spec) == "scale:3@fwd,after=2"
    corrupt = attack_filter(spec)
    one = torch.ones(2, 2)
    assert [float(corrupt("fwd", one)[0, 0]) for _ in range(4)] == [1.0, 1.0, 3.0, 3.0]
    assert float(corrupt("bwd", one)[0, 0]) == 1.0
    with pytest.raises(AttackSpecError, match="after"):
        parse_attack("scale:3,later=2")


def _node(stage):
    return StageNode(MAN, stage, SimpleNamespace(peer_id="peer-under-test"))


def _close(node):
    node._compute.shutdown(wait=True)
    node._io.shutdown(wait=True)


def test_install_attack_corrupts_a_real_nodes_outgoing_boundary():
    node = _node(0)
    try:
        seen = []
        spec = install_attack(node, "scale:4@fwd")
        assert node.attack == spec and any(e["kind"] == "attack_installed" for e in node.events)
        tokens = torch.randint(0, MAN.model.vocab_size, (2, 16), dtype=torch.int32)
        rt = node.runtime
        pending, _ = rt.forward([tokens, tokens[:, -1]], train=False, generation=rt.generation)
        clean = compress(pending.out.detach(), pending.tokens, node.stage.basis).coords.clone()
        seen.append(rt.boundary(pending).coords)  # what the node hands to its next hop (``Downstream.send``)
        assert torch.allclose(seen[0], 4 * clean)
    finally:
        _close(node)


def test_install_attack_corrupts_a_real_tails_returned_gradient():
    clean_node, bad_node = _node(1), _node(1)
    try:
        install_attack(bad_node, parse_attack("sign_flip@bwd"))
        g = torch.Generator().manual_seed(0)
        coords = torch.randn(2, 16, MAN.residual.k, generator=g)
        tokens = torch.randint(0, MAN.model.vocab_size, (2, 16), dtype=torch.int32, generator=g)
        grads = []
        for node in (clean_node, bad_node):
            rt = node.runtime
            pending, _ = rt.forward([coords, tokens, tokens[:, -1]], train=True, generation=rt.generation)
            grads.append(rt.finish_tail(pending))
        assert torch.allclose(grads[1], -grads[0])
    finally:
        _close(clean_node)
        _close(bad_node)


def test_install_attack_refuses_a_node_without_the_output_filter_hook():
    with pytest.raises(AttributeError, match="add_output_filter"):
        install_attack(SimpleNamespace(), "scale:2@fwd")
