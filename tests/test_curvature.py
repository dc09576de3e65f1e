"""Tests for agora.optim.curvature: warm power iteration, warm Lanczos and the preconditioned-curvature tracker."""

from __future__ import annotations

import math
import statistics
from typing import Callable, Iterator, List, Tuple

import pytest
import torch
from torch import nn
from torch.func import functional_call

from agora.optim.curvature import CurvatureTracker, alarm_threshold, warm_lanczos, warm_power_iteration

pytestmark = pytest.mark.usefixtures("one_torch_thread")


# --- 1. Warm start on a drifting matrix ------------------------------------------------------------------------


Matvec = Callable[[torch.Tensor], torch.Tensor]


def _drifting_problems(n: int = 400, steps: int = 300) -> Iterator[Tuple[Matvec, float]]:
    """Yield ``(matvec, exact top eigenvalue)`` of ``D_t H_t D_t``, ``H_t = Q_t diag(s_t) Q_t^T``, ``D_t = P_t^-1/2``.

    Drift per step: ``Q_t`` turns every vector by ~1% (a fixed small rotation), the top of the spectrum oscillates by
    +-30% and the diagonal preconditioner ``P_t`` (in ~[1, 1.5]) wobbles by +-5%. The spectrum has a clear top (10
    over 6 over a bulk below 5), so a warm vector stays near the top eigenvector while a random one starts nearly
    orthogonal to it.
    """
    g = torch.Generator().manual_seed(0)
    q, _ = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=torch.float64))
    a = torch.randn(n, n, generator=g, dtype=torch.float64)
    rotation = torch.linalg.matrix_exp((a - a.T) * (0.01 / math.sqrt(2 * n)))
    top = torch.tensor([10.0, 6.0], dtype=torch.float64)
    bulk = torch.cat([top, 5.0 * torch.rand(n - 2, generator=g, dtype=torch.float64)])
    pre_level = 1.0 + 0.5 * torch.rand(n, generator=g, dtype=torch.float64)
    pre_phase = 2 * math.pi * torch.rand(n, generator=g, dtype=torch.float64)
    for t in range(steps):
        spectrum = bulk * (1.0 + 0.2 * math.sin(2 * math.pi * t / steps))
        spectrum[0] = 10.0 + 3.0 * math.sin(2 * math.pi * t / 150)
        d = (pre_level + 0.05 * torch.sin(pre_phase + 2 * math.pi * t / 100)).rsqrt()
        h = (q * spectrum) @ q.T
        exact = torch.linalg.eigvalsh(d[:, None] * h * d[None, :])[-1].item()
        yield (lambda x, h=h, d=d: d * (h @ (d * x))), exact
        q = rotation @ q


def _unit(n: int, g: torch.Generator) -> torch.Tensor:
    u = torch.randn(n, generator=g, dtype=torch.float64)
    return u / u.norm()


def test_warm_start_tracks_drifting_eigenvalue_cold_start_does_not():
    n = 400
    g = torch.Generator().manual_seed(1)
    warm = _unit(n, g)
    warm_errors, cold_errors = [], []
    for matvec, exact in _drifting_problems(n):
        lam, warm = warm_power_iteration(matvec, warm, 3)
        warm_errors.append(abs(lam - exact) / exact)
        lam, _ = warm_power_iteration(matvec, _unit(n, g), 5)
        cold_errors.append(abs(lam - exact) / exact)
    warm_median, cold_median = statistics.median(warm_errors), statistics.median(cold_errors)
    assert warm_median < 1e-4, warm_median  # measured 1.3e-6 (1 iteration per step: 1.6e-4)
    assert cold_median > 1e-2, cold_median  # measured 0.17: 5 iterations from a random vector are not enough
    assert abs(warm.norm().item() - 1.0) < 1e-12


def test_warm_lanczos_tracks_the_drifting_eigenvalue_closer_than_power_iteration_from_the_same_products():
    n = 400
    g = torch.Generator().manual_seed(1)
    lanczos, power = _unit(n, g), None
    lanczos_errors, power_errors = [], []
    for matvec, exact in _drifting_problems(n):
        power = lanczos.clone() if power is None else power
        lam, lanczos = warm_lanczos(matvec, lanczos, 2)
        lanczos_errors.append(abs(lam - exact) / exact)
        assert lam <= exact * (1 + 1e-9)  # a Ritz value never exceeds the top eigenvalue
        lam, power = warm_power_iteration(matvec, power, 2)
        power_errors.append(abs(lam - exact) / exact)
    lanczos_median, power_median = statistics.median(lanczos_errors), statistics.median(power_errors)
    # measured 4.3e-6 vs 9.3e-6: with a clear top (10 over 6) power iteration is good already; the gain grows as the
    # top clusters (the MLP and micro-transformer measurements)
    assert lanczos_median < 0.6 * power_median, (lanczos_median, power_median)
    assert abs(lanczos.norm().item() - 1.0) < 1e-12


def test_lanczos_finds_the_top_algebraic_eigenvalue_under_a_dominant_negative_one():
    """On ``diag(-10, 3, 1, 0.5)`` power iteration converges to -10; three Lanczos products span the space of the
    start's components enough to give the top positive eigenvalue, and a 4-dimensional space gives it exactly."""
    a = torch.tensor([-10.0, 3.0, 1.0, 0.5], dtype=torch.float64)
    u = torch.tensor([0.5, 0.5, 0.5, 0.5], dtype=torch.float64)
    lam, x = warm_lanczos(lambda v: a * v, u, 4)
    assert lam == pytest.approx(3.0, rel=1e-9) and abs(abs(x[1].item()) - 1.0) < 1e-6
    power, _ = warm_power_iteration(lambda v: a * v, u, 4)
    assert power < 0
    lam, _ = warm_lanczos(lambda v: a * v, torch.tensor([0.0, 1.0, 0.0, 0.0], dtype=torch.float64), 3)
    assert lam == pytest.approx(3.0)  # an exact eigenvector: the space closes after one product, no division by 0


@pytest.mark.parametrize("iterate", [warm_lanczos, warm_power_iteration])
def test_iterations_reject_zero_products_and_survive_a_zero_operator(iterate):
    with pytest.raises(ValueError):
        iterate(lambda x: x, torch.ones(3), 0)
    u = torch.tensor([0.6, 0.8])
    lam, v = iterate(torch.zeros_like, u, 3)
    assert lam == 0.0 and torch.equal(v, u)


# --- 2. The tracker on a small MLP trained with AdamW -----------------------------------------------------------


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 128), nn.Tanh(), nn.Linear(128, 4))  # 4740 parameters


def _exact_top_eigenvalue(model: nn.Module, x: torch.Tensor, y: torch.Tensor, optimizer: torch.optim.AdamW) -> float:
    """``eigvalsh(P^-1/2 H P^-1/2)[-1]`` in float64, ``H`` from ``torch.autograd.functional.hessian``."""
    names, params = zip(*model.named_parameters())
    shapes, sizes = [p.shape for p in params], [p.numel() for p in params]
    x64, y64 = x.double(), y.double()

    def loss(flat: torch.Tensor) -> torch.Tensor:
        tensors = {name: c.view(s) for name, c, s in zip(names, flat.split(sizes), shapes)}
        return nn.functional.mse_loss(functional_call(model, tensors, (x64,)), y64)

    flat = torch.cat([p.detach().reshape(-1) for p in params]).double()
    hessian = torch.autograd.functional.hessian(loss, flat)
    group = optimizer.param_groups[0]
    step = int(optimizer.state[params[0]]["step"])
    exp_avg_sq = torch.cat([optimizer.state[p]["exp_avg_sq"].reshape(-1) for p in params]).double()
    v_hat = exp_avg_sq / (1 - group["betas"][1] ** step)
    d = (v_hat.sqrt() + group["eps"]).rsqrt()
    return torch.linalg.eigvalsh(d[:, None] * hessian * d[None, :])[-1].item()


@pytest.mark.parametrize("method", ["lanczos", "power"])
def test_tracker_matches_exact_preconditioned_eigenvalue_during_adamw_training(method):
    model = _mlp()
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(64, 32, generator=g), torch.randn(64, 4, generator=g)
    params = list(model.parameters())
    optimizer = torch.optim.AdamW(params, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, foreach=False)
    tracker = CurvatureTracker(params, hvps=3, eps=1e-8, seed=0, method=method)

    def loss_fn() -> torch.Tensor:
        return nn.functional.mse_loss(model(x), y)

    estimates: List[float] = []
    for _ in range(25):
        optimizer.zero_grad()
        loss_fn().backward()
        optimizer.step()
        moments = [optimizer.state[p]["exp_avg_sq"] for p in params]
        step = int(optimizer.state[params[0]]["step"])
        estimates.append(tracker.measure(loss_fn, moments, beta2=0.95, step=step))

    exact = _exact_top_eigenvalue(model, x, y, optimizer)
    assert abs(estimates[-1] - exact) / exact < 0.01, (estimates[-1], exact)  # measured 1.8e-3 (other seeds: <3e-4)
    assert all(math.isfinite(e) for e in estimates)
    assert tracker.value == estimates[-1] and tracker.measurements == 25
    assert tracker.last_seconds > 0.0  # recorded, not bounded: its cost is reported, not asserted


# --- 3. Threshold, alarm, validation, .grad, NaN recovery, state ------------------------------------------------


def _quadratic(curvatures: List[float]) -> Tuple[nn.Parameter, Callable[[], torch.Tensor]]:
    """A parameter and ``loss = 0.5 * sum(c_i p_i^2)``, whose Hessian is ``diag(c)``."""
    p = nn.Parameter(torch.ones(len(curvatures)))
    c = torch.tensor(curvatures)
    return p, lambda: 0.5 * (c * p * p).sum()


def test_alarm_threshold_values():
    assert alarm_threshold(0.9) == pytest.approx(38.0)
    assert alarm_threshold(0.0) == 2.0
    with pytest.raises(ValueError):
        alarm_threshold(1.0)


def test_alarm_flips_at_the_threshold():
    p, loss_fn = _quadratic([4.0])
    tracker = CurvatureTracker([p], hvps=1)
    assert not tracker.alarm(1e9, 0.9)  # nothing measured yet
    assert tracker.measure(loss_fn) == pytest.approx(4.0)
    for beta1 in (0.0, 0.9):
        lr = alarm_threshold(beta1) / tracker.value
        assert not tracker.alarm(lr * (1 - 1e-9), beta1)
        assert tracker.alarm(lr * (1 + 1e-9), beta1)


def test_preconditioner_is_bias_corrected_second_moment_and_identity_without_one():
    p, loss_fn = _quadratic([4.0])
    q, loss_q = _quadratic([1.0])
    tracker = CurvatureTracker([p, q], hvps=5)
    beta2, step = 0.95, 3
    raw = torch.full((1,), 16.0 * (1 - beta2**step))  # v_hat = 16: P = 4, so 4 / 4 = 1 for p
    total = lambda: loss_fn() + loss_q()  # noqa: E731
    assert tracker.measure(total, [raw, None], beta2=beta2, step=step) == pytest.approx(1.0, rel=1e-6)
    assert tracker.measure(total, [raw, None], beta2=beta2, step=0) == pytest.approx(4.0, rel=1e-6)  # no moment yet
    assert tracker.measure(total) == pytest.approx(4.0, rel=1e-6)
    with pytest.raises(ValueError):
        tracker.measure(total, [raw], beta2=beta2, step=step)


def test_invalid_hvps_or_method_raises():
    p, _ = _quadratic([1.0])
    for hvps in (0, 6):
        with pytest.raises(ValueError, match="hvps"):
            CurvatureTracker([p], hvps=hvps)
    with pytest.raises(ValueError, match="method"):
        CurvatureTracker([p], method="arnoldi")


def test_measure_leaves_grad_untouched_and_handles_unused_params():
    model = _mlp()
    unused = nn.Parameter(torch.zeros(3))
    x = torch.randn(16, 32)
    params = list(model.parameters()) + [unused]
    model[0].weight.grad = torch.full_like(model[0].weight, 7.0)
    before = model[0].weight.grad.clone()
    tracker = CurvatureTracker(params, hvps=2)
    assert math.isfinite(tracker.measure(lambda: model(x).pow(2).mean()))
    assert torch.equal(model[0].weight.grad, before)
    assert all(p.grad is None for p in params[1:])


def test_nan_loss_returns_nan_then_recovers():
    p, loss_fn = _quadratic([5.0, 0.5, 0.5, 0.5])
    tracker = CurvatureTracker([p], hvps=5)
    assert math.isnan(tracker.measure(lambda: loss_fn() * float("nan")))
    assert math.isnan(tracker.value) and not tracker.alarm(1.0, 0.9)
    assert all(torch.isfinite(t).all() for t in tracker.u)
    for _ in range(3):
        lam = tracker.measure(loss_fn)
    assert lam == pytest.approx(5.0, rel=1e-5)


def test_same_seed_same_start_and_state_round_trip():
    model = _mlp()
    x = torch.randn(16, 32)
    params = list(model.parameters())
    loss_fn = lambda: model(x).pow(2).mean()  # noqa: E731
    a = CurvatureTracker(params, hvps=1, seed=5)
    assert all(torch.equal(s, t) for s, t in zip(a.u, CurvatureTracker(params, seed=5).u))
    assert not torch.equal(a.u[0], CurvatureTracker(params, seed=6).u[0])
    for _ in range(3):
        a.measure(loss_fn)
    saved = a.state()
    assert [t.shape for t in saved] == [p.shape for p in params] and all(t.dtype == torch.float32 for t in saved)
    restored, fresh = CurvatureTracker(params, hvps=1, seed=6), CurvatureTracker(params, hvps=1, seed=6)
    restored.load_state(saved)
    expected = a.measure(loss_fn)
    assert restored.measure(loss_fn) == pytest.approx(expected, rel=1e-6)
    assert fresh.measure(loss_fn) != pytest.approx(expected, rel=1e-3)  # the restored vector is what made it equal
    with pytest.raises(ValueError):
        restored.load_state(saved[:-1])


def test_a_dominant_negative_eigenvalue_shifts_later_measurements_to_the_top_positive_one():
    """Power iteration finds the largest magnitude; after it meets a dominant negative eigenvalue the tracker
    iterates on H + shift * I and reports the largest positive eigenvalue (what the stability bound needs)."""
    diag = torch.tensor([-10.0, 3.0, 1.0, 0.5])
    w = torch.nn.Parameter(torch.tensor([0.3, 0.2, 0.1, 0.4]))
    tracker = CurvatureTracker([w], hvps=5, seed=0, method="power")
    loss = lambda: 0.5 * (diag * w * w).sum()  # noqa: E731
    first = tracker.measure(loss)
    assert first < 0 and tracker.shift >= 10.0
    for _ in range(20):
        value = tracker.measure(loss)
    assert abs(value - 3.0) < 1e-2, value


def test_the_lanczos_tracker_reports_the_top_positive_eigenvalue_without_a_shift():
    diag = torch.tensor([-10.0, 3.0, 1.0, 0.5])
    w = torch.nn.Parameter(torch.tensor([0.3, 0.2, 0.1, 0.4]))
    tracker = CurvatureTracker([w], hvps=4, seed=0)
    loss = lambda: 0.5 * (diag * w * w).sum()  # noqa: E731
    assert tracker.measure(loss) == pytest.approx(3.0, rel=1e-4) and tracker.shift == 0.0


def test_tracker_every_tenth_step_lanczos_beats_power_iteration_against_eigvalsh():
    """The bench's setting on METHODS' MLP: 3 products every 10 AdamW steps from a 10-steps-stale vector. Once its
    vector has warmed up (from step 40), Lanczos from the same products is within 1% of the exact value and closer
    than power iteration at every measurement (measured: 0.25%, 0.33%, 0.08% against 0.65%, 0.97%, 0.38%)."""
    model = _mlp()
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(64, 32, generator=g), torch.randn(64, 4, generator=g)
    params = list(model.parameters())
    optimizer = torch.optim.AdamW(params, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, foreach=False)
    trackers = {m: CurvatureTracker(params, hvps=3, eps=1e-8, seed=0, method=m) for m in ("lanczos", "power")}
    loss_fn = lambda: nn.functional.mse_loss(model(x), y)  # noqa: E731
    errors = {m: [] for m in trackers}
    for step in range(1, 61):
        optimizer.zero_grad()
        loss_fn().backward()
        optimizer.step()
        if step % 10:
            continue
        moments = [optimizer.state[p]["exp_avg_sq"] for p in params]
        values = {m: t.measure(loss_fn, moments, beta2=0.95, step=step) for m, t in trackers.items()}
        if step >= 40:  # the exact value (a dense 4740 x 4740 Hessian) only where the comparison is made
            exact = _exact_top_eigenvalue(model, x, y, optimizer)
            for m, value in values.items():
                errors[m].append(abs(value - exact) / exact)
    assert len(errors["lanczos"]) == 3 and max(errors["lanczos"]) < 0.01, errors
    assert all(a < b for a, b in zip(errors["lanczos"], errors["power"])), errors


def test_reference_converges_to_eigvalsh_and_leaves_the_tracker_as_it_was():
    """The bench's yardstick where eigvalsh is out of reach: one unrestarted Lanczos run from the tracker's vector.
    On the MLP after 20 AdamW steps, 40 products reach the dense value within 1e-4 (never above it), while the
    tracker's own 3-product estimate from a cold vector is far off; the tracker's vector and value are untouched."""
    model = _mlp()
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(64, 32, generator=g), torch.randn(64, 4, generator=g)
    params = list(model.parameters())
    optimizer = torch.optim.AdamW(params, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, foreach=False)
    loss_fn = lambda: nn.functional.mse_loss(model(x), y)  # noqa: E731
    for _ in range(20):
        optimizer.zero_grad()
        loss_fn().backward()
        optimizer.step()
    moments = [optimizer.state[p]["exp_avg_sq"] for p in params]
    tracker = CurvatureTracker(params, hvps=3, eps=1e-8, seed=0)
    estimate = tracker.measure(loss_fn, moments, beta2=0.95, step=20)
    before = [t.clone() for t in tracker.u]
    reference = tracker.reference(loss_fn, moments, beta2=0.95, step=20, products=40)
    exact = _exact_top_eigenvalue(model, x, y, optimizer)
    assert reference <= exact * (1 + 1e-6) and (exact - reference) / exact < 1e-4, (reference, exact)
    assert (exact - estimate) / exact > 1e-2, (estimate, exact)  # one cold measurement: the yardstick must see it
    assert tracker.value == estimate and tracker.measurements == 1
    assert all(torch.equal(a, b) for a, b in zip(before, tracker.u))
    with pytest.raises(ValueError):
        tracker.reference(loss_fn, moments, beta2=0.95, step=20, products=0)
