"""NAdam's look-ahead in the swarm's runtime (``optimizer.lookahead``): a forward that runs while its stage's step
is pending (gradients taken, the round averaging) runs on the weights one predicted update ahead, and its gradient
is the gradient at those weights; the master weights never move outside a step."""

import pytest
import torch

from agora.config import load_manifest
from agora.optim import set_lr
from agora.server.node import NodeOptions, StageNode
from agora.server.observers import Observers
from agora.server.runtime import Counters, StageRuntime

NADAM = {"optimizer.name": "nadam", "optimizer.betas": (0.99, 0.999), "optimizer.warmup_steps": 0}
BASE = load_manifest("tiny").with_overrides(stages=[1, 2, 1], **NADAM)
AHEAD = BASE.with_overrides(**{"optimizer.lookahead": True})


def _runtimes(manifest):
    return [StageRuntime(manifest, s, Counters(), Observers()) for s in range(manifest.n_stages)]


def _batch(manifest, seed):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, manifest.model.vocab_size, (4, manifest.model.seq_len), generator=g, dtype=torch.int32)
    last = torch.randint(0, manifest.model.vocab_size, (4,), generator=g, dtype=torch.int32)
    return tokens, last


def _microbatch(runtimes, tokens, last):
    """Forward through every stage, then the backward chain; the loss."""
    pendings, sent, loss = [], [tokens, last], None
    for rt in runtimes:
        pending, loss = rt.forward(sent, True, rt.generation)
        pendings.append(pending)
        if not rt.is_tail:
            sent = [rt.boundary(pending).coords, tokens, last]
    grad = runtimes[-1].finish_tail(pendings[-1])
    for rt, pending in zip(reversed(runtimes[:-1]), reversed(pendings[:-1])):
        grad = rt.backward(pending, grad)
    return loss


def _trained_steps(runtimes, steps=2):
    for i in range(steps):
        _microbatch(runtimes, *_batch(BASE, 100 + i))
        for rt in runtimes:
            rt.apply_step(rt.take_gradients()[1])


def _values(rt):
    return [p.detach().clone() for p in rt.stage.parameters()]


def test_a_forward_during_a_pending_step_runs_on_the_lookahead_weights():
    ahead = _runtimes(AHEAD)
    _trained_steps(ahead)
    _microbatch(ahead, *_batch(BASE, 6))  # the batch fills on the live weights (each stage keeps their snapshot)
    masters = [_values(rt) for rt in ahead]
    for rt in ahead:
        rt.take_gradients()  # the step is pending now: the round would be averaging these
    # What the look-ahead should be: the optimizer's prediction of the pending step, at that step's learning rate.
    expected = []
    for rt in ahead:
        set_lr(rt.optimizer, rt.manifest.optimizer, rt.step)
        expected.append(rt.optimizer.lookahead_weights(delay=1, params=list(rt.stage.parameters())))
    assert any(not torch.equal(a, b) for rt_m, rt_e in zip(masters, expected) for a, b in zip(rt_m, rt_e))

    # The same microbatch on runtimes that hold those weights as their own (no look-ahead, nothing pending).
    plain = _runtimes(BASE)
    for rt, values in zip(plain, expected):
        rt.load_parameters(values)
    tokens, last = _batch(BASE, 7)
    loss_ahead = _microbatch(ahead, tokens, last)
    loss_plain = _microbatch(plain, tokens, last)
    assert loss_ahead == pytest.approx(loss_plain, rel=1e-6)
    for rt_a, rt_p, before in zip(ahead, plain, masters):
        assert rt_a.counters.lookahead_forwards == 1 and rt_p.counters.lookahead_forwards == 0
        for p, q, w in zip(rt_a.stage.parameters(), rt_p.stage.parameters(), before):
            assert torch.equal(p.detach(), w)  # the master weights did not move
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7)  # the gradient at the look-ahead


def test_after_the_step_forwards_run_on_the_stepped_weights_again():
    ahead = _runtimes(AHEAD)
    _trained_steps(ahead)
    for rt in ahead:
        rt.apply_step(rt.take_gradients()[1])
    assert not any(rt.step_pending for rt in ahead)
    reference = _runtimes(BASE)
    for rt, src in zip(reference, ahead):
        rt.load_parameters(_values(src))
    tokens, last = _batch(BASE, 8)
    assert _microbatch(ahead, tokens, last) == _microbatch(reference, tokens, last)
    assert all(rt.counters.lookahead_forwards == 0 for rt in ahead)


def test_before_the_first_step_there_is_nothing_to_extrapolate():
    ahead = _runtimes(AHEAD)
    for rt in ahead:
        rt.take_gradients()  # step 0 pending: no momentum yet, so the forwards run on the live weights
    twin = _runtimes(BASE)
    tokens, last = _batch(BASE, 10)
    assert _microbatch(ahead, tokens, last) == _microbatch(twin, tokens, last)
    assert all(rt.counters.lookahead_forwards == 0 for rt in ahead)


def test_without_lookahead_a_pending_step_changes_nothing():
    runtimes = _runtimes(BASE)
    _trained_steps(runtimes)
    twin = _runtimes(BASE)
    for rt, src in zip(twin, runtimes):
        rt.load_parameters(_values(src))
    for rt in runtimes:
        rt.take_gradients()
    tokens, last = _batch(BASE, 9)
    assert _microbatch(runtimes, tokens, last) == _microbatch(twin, tokens, last)


def test_sentinel_audits_refuse_a_lookahead_run():
    with pytest.raises(ValueError, match="lookahead"):
        StageNode(AHEAD, 0, dht=None, options=NodeOptions(sentinel=True))
