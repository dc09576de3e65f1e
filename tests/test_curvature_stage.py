"""A stage measures its own curvature on the compute thread: the Hessian of <output, received gradient> (the loss on
the tail), preconditioned by its Adam moments, within a budget, without touching its gradients."""

import math

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from agora.config import load_manifest
from agora.server.observers import Observers
from agora.server.runtime import Counters, RuntimeOptions, StageRuntime
from swarm_util import random_batches

MAN = load_manifest("tiny").with_overrides(**{"optimizer.warmup_steps": 0})


def _pipeline(every=1, hvps=3, budget=1.0):
    opts = RuntimeOptions(curvature_every=every, curvature_hvps=hvps, curvature_budget=budget)
    return [StageRuntime(MAN, s, Counters(), Observers(), options=opts) for s in range(MAN.n_stages)]


def _train_step(rts, batch):
    head, tail = rts
    tokens, last = batch[:, :-1], batch[:, -1]
    pending, _ = head.forward([tokens, last], True, head.generation)
    b = head.boundary(pending)
    tail_pending, loss = tail.forward([b.coords, tokens, last], True, tail.generation)
    upstream = tail.finish_tail(tail_pending)
    head.backward(pending, upstream)
    for rt in rts:
        _, grads = rt.take_gradients()
        rt.apply_step(grads)
    return loss


def test_every_stage_measures_after_its_steps_and_leaves_gradients_alone():
    rts = _pipeline(every=2)
    batches = random_batches(MAN.model.vocab_size, MAN.model.seq_len, 4, b=4)
    for step, batch in enumerate(batches, 1):
        _train_step(rts, batch)
        for rt in rts:
            assert rt.curvature.tracker.measurements == step // 2
            assert all(p.grad is None for p in rt.stage.parameters())  # take_gradients emptied them; still empty
    for rt in rts:
        s = rt.curvature.summary()
        # (The sign is the data's: early on a stage's Hessian can be dominated by a negative eigenvalue.)
        assert s["value"] is not None and math.isfinite(s["value"]) and s["measurements"] == 2, s
        assert s["threshold"] == pytest.approx(2 * 1.9 / 0.1)
        assert s["lr_times_value"] == pytest.approx(s["value"] * MAN.optimizer.lr, rel=0.05)


def test_the_head_measures_the_hessian_of_its_output_against_the_received_gradient():
    """Converge the head's vector on a fixed sample, then check its Rayleigh quotient independently: central finite
    differences of the gradient of <output, g> along P^-1/2 u."""
    rts = _pipeline(every=1, hvps=5)
    batches = random_batches(MAN.model.vocab_size, MAN.model.seq_len, 3, b=4, seed=3)
    for batch in batches:
        _train_step(rts, batch)
    head = rts[0]
    cur = head.curvature
    moments, beta2, step = cur._second_moments()
    with sdpa_kernel(SDPBackend.MATH):
        for _ in range(8):  # 40 more power iterations on the same sample and weights
            lam = cur.tracker.measure(cur._loss, moments, beta2, step)
    params = cur.params  # every parameter but the token embedding (tracked_parameters)
    scale = [(m / (1 - beta2 ** step)).sqrt().add(1e-8).rsqrt() if m is not None else torch.ones_like(p)
             for p, m in zip(params, moments)]
    direction = [s * u for s, u in zip(scale, cur.tracker.u)]

    eps = 1e-3 / max(float(d.abs().max()) for d in direction)  # no parameter moves by more than 1e-3

    def grad_at(sign: float):  # reads ``direction`` and ``eps`` when called
        with torch.no_grad():
            for p, d in zip(params, direction):
                p.add_(d, alpha=sign * eps)
        g = torch.autograd.grad(cur._loss(), params, allow_unused=True)
        with torch.no_grad():
            for p, d in zip(params, direction):
                p.sub_(d, alpha=sign * eps)
        return [x if x is not None else torch.zeros_like(p) for x, p in zip(g, params)]

    plus, minus = grad_at(1.0), grad_at(-1.0)
    quotient = sum(float((s * u * (a - b) / (2 * eps)).sum()) for s, u, a, b in zip(scale, cur.tracker.u, plus, minus))
    # float32 finite differences: measured 2.4% apart
    assert lam > 0 and math.isclose(quotient, lam, rel_tol=5e-2), (quotient, lam)
    # And the vector found is the top direction, not any direction: a random one has a far smaller quotient.
    g = torch.Generator().manual_seed(0)
    rand = [torch.randn(p.shape, generator=g) for p in params]
    norm = math.sqrt(sum(float((r ** 2).sum()) for r in rand))
    direction = [s * r / norm for s, r in zip(scale, rand)]
    eps = 1e-3 / max(float(d.abs().max()) for d in direction)
    plus, minus = grad_at(1.0), grad_at(-1.0)
    other = sum(float((s * r / norm * (a - b) / (2 * eps)).sum()) for s, r, a, b in zip(scale, rand, plus, minus))
    assert abs(other) < 0.2 * lam, (other, lam)


def test_measurements_stay_within_the_compute_budget():
    rts = _pipeline(every=1, budget=1e-6)
    for batch in random_batches(MAN.model.vocab_size, MAN.model.seq_len, 3, b=4):
        _train_step(rts, batch)
    for rt in rts:
        s = rt.curvature.summary()
        assert s["measurements"] == 1 and s["skipped_for_budget"] == 2, s


def test_curvature_options_are_validated_and_off_by_default():
    assert StageRuntime(MAN, 0, Counters(), Observers()).curvature is None
    for bad in ({"curvature_every": -1}, {"curvature_hvps": 6}, {"curvature_budget": 0.0}):
        with pytest.raises(ValueError, match="curvature"):
            RuntimeOptions(**bad)


def test_the_token_embedding_is_not_tracked():
    """Rare tokens' embedding rows have a tiny Adam second moment: preconditioned, they would dominate the value."""
    head = _pipeline()[0]
    names = {id(p): n for n, p in head.stage.named_parameters()}
    tracked = [names[id(p)] for p in head.curvature.params]
    assert tracked and not any("embed_tokens" in n for n in tracked)
    assert len(tracked) == len(names) - 1
