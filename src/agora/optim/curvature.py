"""Online tracking of the largest preconditioned Hessian eigenvalue, lambda_max(P^-1/2 H P^-1/2).

Why: Adam-type optimizers with momentum ``beta1`` stay stable only while ``lr * lambda <= (2 + 2 beta1) / (1 - beta1)``
("Taming Curvature", arXiv 2606.16768), where ``lambda`` is the top Hessian eigenvalue seen through the optimizer's
own preconditioner ``P = diag(sqrt(v_hat) + eps)``. The eigenvalue drifts slowly between steps, so a few
Hessian-vector products per measurement, started from the previous measurement's vector, track it cheaply: by
default as a Lanczos (Krylov) estimate, which from the same products gets much closer than power iteration.
"""

from __future__ import annotations

import math
import time
from typing import Callable, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

__all__ = [
    "METHODS", "CurvatureTracker", "alarm_threshold", "tracked_parameters", "warm_lanczos", "warm_power_iteration",
    "warmup_holds",
]

MAX_HVPS = 5
METHODS = ("lanczos", "power")


def tracked_parameters(named: Sequence[Tuple[str, torch.nn.Parameter]]) -> List[torch.nn.Parameter]:
    """The parameters whose curvature is tracked: all trainable ones but token embeddings. An embedding row gets a
    gradient only when its token occurs, so Adam's second moment of a rare token's row is tiny and ``P^-1/2`` of it
    huge (``1/sqrt(eps)``); measured on a few sequences that contain such a token, the preconditioned curvature is
    that row's artefact (``small``, dense: 2e7-2e8 at a learning rate that trains smoothly)."""
    return [p for n, p in named if p.requires_grad and "embed_tokens" not in n]


def alarm_threshold(beta1: float) -> float:
    """Largest stable ``lr * lambda`` for EMA momentum ``beta1``: 2 for plain GD, 38 for ``beta1 = 0.9``.

    Why this value: on a quadratic of curvature ``lambda``, heavy-ball momentum is stable iff
    ``step * lambda < 2 (1 + beta1)``; Adam's EMA momentum ``m = beta1 m + (1 - beta1) g`` scales the effective step
    by ``1 - beta1``, hence ``lr * lambda < (2 + 2 beta1) / (1 - beta1)``.
    """
    if not 0.0 <= beta1 < 1.0:
        raise ValueError(f"beta1 must be in [0, 1), got {beta1}")
    return (2.0 + 2.0 * beta1) / (1.0 - beta1)


def warmup_holds(lr_lambda: Optional[float], hold_above: float, beta1: float) -> bool:
    """Whether a curvature-driven architecture warm-up holds its clock on the measurement ``lr * lambda``: above
    ``hold_above`` x the stability threshold in magnitude (a negative value: a negative eigenvalue dominated the power
    iteration, and the curvature is no smaller for it). No measurement (None, NaN): it does not hold."""
    return lr_lambda is not None and math.isfinite(lr_lambda) and abs(lr_lambda) > hold_above * alarm_threshold(beta1)


def warm_power_iteration(matvec: Callable[[Tensor], Tensor], u: Tensor, iters: int) -> Tuple[float, Tensor]:
    """Run ``iters`` power iterations on a symmetric operator from the unit vector ``u``; return ``(lambda, u_new)``.

    Why warm: started from the previous measurement's vector, already close to the top eigenvector of a slowly
    drifting matrix, one to three products suffice; a random start has overlap ~1/sqrt(n) with it and needs many more.
    ``lambda = <u, A u>`` for the last input ``u``, so its error is quadratic in u's angle error. On an indefinite
    matrix the iteration finds the eigenvalue of largest magnitude, which may be negative. If ``A u = 0`` the result
    is 0 and ``u`` is kept. Non-finite values are propagated, not handled: the caller decides what to do.
    """
    if iters < 1:
        raise ValueError(f"iters must be >= 1, got {iters}")
    lam = torch.zeros((), dtype=u.dtype, device=u.device)
    for _ in range(iters):
        w = matvec(u)
        lam = torch.dot(u, w)
        norm = torch.linalg.vector_norm(w)
        # One host sync per product (negligible next to it); in place, because the vectors are parameter-sized and
        # every extra pass over them costs (measured on `small`, 15M parameters: ~20 ms each on 2 CPU cores).
        if float(norm) > 0:
            u = w.div_(norm)
    return float(lam), u


def warm_lanczos(matvec: Callable[[Tensor], Tensor], u: Tensor, iters: int) -> Tuple[float, Tensor]:
    """Top Ritz pair of a symmetric operator on the Krylov space ``span{u, A u, ..., A^(iters-1) u}``: ``iters``
    products, ``(theta, x)`` with ``theta`` the largest eigenvalue of ``A`` restricted to that space and ``x`` its unit
    Ritz vector (the next measurement's start).

    Why not power iteration: the same products span the whole Krylov space, and Rayleigh-Ritz picks its best vector
    (the best polynomial in A of that degree) instead of the last iterate (its top power). Measured every 10 AdamW
    steps with 3 products against dense ``eigvalsh`` (``agora bench training --sections tracker``;
    docs/OPTIMIZER.md), it comes within 1% of the exact value sooner than power iteration and is closer at most
    measurements. It also
    targets the largest *algebraic* eigenvalue (``theta <= lambda_max`` always), so a dominant negative eigenvalue
    slows it but never takes it over. Cost: ``iters`` parameter-sized vectors are kept during the measurement
    (power iteration keeps two), and a few dot products per product, next to which the products themselves dominate.
    If the space closes early (``A u`` parallel to ``u``: an exact eigenvector), fewer products are used. Non-finite
    values are propagated, not handled.
    """
    if iters < 1:
        raise ValueError(f"iters must be >= 1, got {iters}")
    basis: List[Tensor] = [u]
    alphas: List[float] = []
    betas: List[float] = []
    for j in range(iters):
        w = matvec(basis[j])
        alpha = float(torch.dot(basis[j], w))
        alphas.append(alpha)
        if not math.isfinite(alpha):
            return alpha, w
        if j == iters - 1:
            break
        # Full re-orthogonalisation, twice: with at most MAX_HVPS vectors it is cheap, and it keeps the basis
        # orthonormal in fp32 where the three-term recurrence alone would lose it on a clustered spectrum.
        for _ in range(2):
            for v in basis:
                w.sub_(v, alpha=float(torch.dot(v, w)))
        beta = float(torch.linalg.vector_norm(w))
        if not beta > 1e-7 * max(abs(a) for a in alphas):  # the space closed (or A u = 0): the Ritz pair is exact
            break
        betas.append(beta)
        basis.append(w.div_(beta))
    n = len(alphas)
    tridiagonal = torch.diag(torch.tensor(alphas, dtype=torch.float64))
    for i, beta in enumerate(betas[: n - 1]):
        tridiagonal[i, i + 1] = tridiagonal[i + 1, i] = beta
    values, vectors = torch.linalg.eigh(tridiagonal)
    y = vectors[:, -1]
    if n == 1:
        return float(values[-1]), u
    x = torch.zeros_like(u)
    for coefficient, v in zip(y.tolist(), basis[:n]):
        x.add_(v, alpha=coefficient)
    norm = torch.linalg.vector_norm(x)
    return float(values[-1]), (x.div_(norm) if float(norm) > 0 else u)


class CurvatureTracker:
    """Tracks ``lambda_max(P^-1/2 H P^-1/2)`` for a fixed list of parameters, keeping the iteration's vector.

    ``u`` is a unit vector over all parameters (fp32, on the parameters' device) that persists across measurements:
    that warm start is what makes ``hvps`` (1..5) products enough. Its initial value depends only on ``seed``, so
    replicas with the same seed start from the same vector. ``method``: ``lanczos`` (default, :func:`warm_lanczos`)
    or ``power`` (:func:`warm_power_iteration`, which keeps two vectors instead of ``hvps``).
    """

    def __init__(self, params: Sequence[torch.nn.Parameter], hvps: int = 3, eps: float = 1e-8, seed: int = 0,
                 method: str = "lanczos") -> None:
        if not 1 <= hvps <= MAX_HVPS:
            raise ValueError(f"hvps must be between 1 and {MAX_HVPS}, got {hvps}")
        if method not in METHODS:
            raise ValueError(f"method must be one of {', '.join(METHODS)}, got {method!r}")
        self.method = method
        self.params: List[torch.nn.Parameter] = list(params)
        if not self.params:
            raise ValueError("CurvatureTracker needs at least one parameter")
        if not all(p.requires_grad for p in self.params):
            raise ValueError("every tracked parameter must require grad")
        devices = {p.device for p in self.params}
        if len(devices) != 1:
            raise ValueError(f"tracked parameters must share one device, got {sorted(map(str, devices))}")
        self.device: torch.device = devices.pop()
        self.hvps = hvps
        self.eps = eps
        self._shapes = [p.shape for p in self.params]
        self._sizes = [p.numel() for p in self.params]
        self._generator = torch.Generator().manual_seed(seed)  # CPU generator: same draws on every device
        self._u: Tensor = self._random_unit()
        self.value: float = float("nan")
        # Power iteration finds the eigenvalue of largest magnitude; the stability bound needs the largest positive
        # one. A stage's Hessian (of <output, gradient>, or of the loss away from a minimum) is indefinite, so once a
        # negative one dominates, later measurements iterate on H' + shift * I (shift >= |lambda_min|, H' + shift
        # * I is then PSD, and its top eigenvalue is lambda_max + shift). Lanczos needs none (its Krylov space is
        # the same for H and H + shift * I), so the shift stays 0 there.
        self.shift: float = 0.0
        self.measurements: int = 0
        self.last_seconds: float = 0.0

    @property
    def u(self) -> List[Tensor]:
        """The current vector, as views shaped like the parameters."""
        return self._unflatten(self._u)

    def measure(
        self,
        loss_fn: Callable[[], Tensor],
        second_moments: Optional[Sequence[Optional[Tensor]]] = None,
        beta2: float = 0.95,
        step: int = 0,
    ) -> float:
        """Estimate the top eigenvalue of ``P^-1/2 H P^-1/2`` from ``hvps`` warm-started products; return it.

        ``loss_fn`` returns the scalar whose Hessian is wanted (for a pipeline stage: ``<stage output, fixed boundary
        gradient>``; for the last stage, the loss). ``second_moments`` are Adam's raw ``exp_avg_sq`` per parameter,
        bias-corrected here with ``beta2`` and ``step``; ``None`` entries (e.g. Muon-stepped matrices), a missing list
        or ``step < 1`` (no second moment yet) mean the identity for those coordinates. Gradients are taken with
        ``torch.autograd.grad``, so ``.grad`` is untouched. A non-finite result resets ``u`` and returns NaN.
        """
        start = time.perf_counter()
        shift = self.shift
        with torch.enable_grad():
            matvec = self._operator(loss_fn, second_moments, beta2, step, shift)
            iterate = warm_lanczos if self.method == "lanczos" else warm_power_iteration
            lam, u = iterate(matvec, self._u, self.hvps)
            lam -= shift
        self.measurements += 1
        if math.isfinite(lam) and bool(torch.isfinite(u).all()):
            self._u, self.value = u, lam
            if lam < 0 and self.method == "power":  # a negative eigenvalue dominates: shift the spectrum past it from now on
                self.shift = max(self.shift, 1.25 * -lam)  # lambda_min ~ lam; a margin for its estimate error
        else:
            self._u, self.value = self._random_unit(), float("nan")
        self.last_seconds = time.perf_counter() - start
        return self.value

    def reference(
        self,
        loss_fn: Callable[[], Tensor],
        second_moments: Optional[Sequence[Optional[Tensor]]] = None,
        beta2: float = 0.95,
        step: int = 0,
        products: int = 60,
    ) -> float:
        """A nearly converged value to score the tracker against where a dense ``eigvalsh`` is out of reach: one
        Lanczos run of ``products`` products (no restart), started from the tracker's current vector, at the same
        point as :meth:`measure`. The tracker's state is left as it was. Its Ritz value never exceeds
        ``lambda_max``, so the tracker's error against it is a lower bound on the true error. Memory: ``products``
        vectors the size of the tracked parameters (``small``: 60 MB each)."""
        if products < 1:
            raise ValueError(f"products must be >= 1, got {products}")
        with torch.enable_grad():
            value, _ = warm_lanczos(self._operator(loss_fn, second_moments, beta2, step), self._u.clone(), products)
        return value

    def _operator(self, loss_fn: Callable[[], Tensor], second_moments: Optional[Sequence[Optional[Tensor]]],
                  beta2: float, step: int, shift: float = 0.0) -> Callable[[Tensor], Tensor]:
        """``x -> P^-1/2 H P^-1/2 x + shift x`` at the current point, by double backward through one retained
        first-order graph (built here; call and use it with grad enabled)."""
        scale = self.inverse_sqrt_preconditioner(second_moments, beta2, step)
        loss = loss_fn()
        if loss.numel() != 1 or not loss.requires_grad:
            raise ValueError("loss_fn must return a scalar that depends on the tracked parameters")
        grads = torch.autograd.grad(loss.reshape(()), self.params, create_graph=True, allow_unused=True)
        # A gradient that is None or constant has a zero Hessian row (and, by symmetry, column): skip it.
        live = [i for i, g in enumerate(grads) if g is not None and g.requires_grad]

        def matvec(x: Tensor) -> Tensor:
            h = self._hvp(grads, live, scale * x).mul_(scale)
            return h.add_(x, alpha=shift) if shift else h

        return matvec

    def alarm(self, lr: float, beta1: float) -> bool:
        """True when the last estimate puts ``lr * lambda`` above the stability threshold for ``beta1``."""
        return math.isfinite(self.value) and lr * self.value > alarm_threshold(beta1)

    def state(self) -> List[Tensor]:
        """A copy of ``u`` (one fp32 tensor per parameter), for checkpoints or for handing to a replacement peer."""
        return [t.clone() for t in self.u]

    def load_state(self, tensors: Sequence[Tensor]) -> None:
        """Restore ``u`` from :meth:`state` (tensors may be on any device); it is renormalized to unit length."""
        if len(tensors) != len(self.params):
            raise ValueError(f"expected {len(self.params)} tensors, got {len(tensors)}")
        for t, shape in zip(tensors, self._shapes):
            if t.shape != shape:
                raise ValueError(f"tensor shape {tuple(t.shape)} does not match parameter shape {tuple(shape)}")
        flat = torch.cat([t.detach().to(self.device, torch.float32).reshape(-1) for t in tensors])
        norm = torch.linalg.vector_norm(flat)
        if not bool(torch.isfinite(norm)) or float(norm) == 0.0:
            raise ValueError("state vector must be finite and non-zero")
        self._u = flat / norm

    def _hvp(self, grads: Sequence[Optional[Tensor]], live: List[int], x: Tensor) -> Tensor:
        """Flat fp32 ``H x`` by double backward through the retained first-order graph."""
        if not live:
            return torch.zeros_like(x)
        chunks = self._unflatten(x)
        hv = torch.autograd.grad(
            [grads[i] for i in live],
            self.params,
            grad_outputs=[chunks[i].to(grads[i].dtype) for i in live],
            retain_graph=True,
            allow_unused=True,
        )
        return torch.cat([
            (h if h is not None else torch.zeros_like(p)).reshape(-1).float() for h, p in zip(hv, self.params)
        ])

    def inverse_sqrt_preconditioner(
        self, second_moments: Optional[Sequence[Optional[Tensor]]], beta2: float, step: int
    ) -> Tensor:
        """Flat ``diag(P)^-1/2`` with ``P = sqrt(v_hat) + eps``, and 1 where there is no second moment."""
        if not 0.0 <= beta2 < 1.0:
            raise ValueError(f"beta2 must be in [0, 1), got {beta2}")
        if second_moments is None or step < 1:
            return torch.ones(sum(self._sizes), dtype=torch.float32, device=self.device)
        if len(second_moments) != len(self.params):
            raise ValueError(f"expected {len(self.params)} second moments, got {len(second_moments)}")
        correction = 1.0 - beta2**step
        chunks = []
        for p, v in zip(self.params, second_moments):
            if v is None:
                chunks.append(torch.ones(p.numel(), dtype=torch.float32, device=self.device))
                continue
            if v.shape != p.shape:
                raise ValueError(f"second moment shape {tuple(v.shape)} does not match parameter {tuple(p.shape)}")
            v_hat = v.detach().to(self.device, torch.float32).reshape(-1) / correction
            chunks.append((v_hat.sqrt() + self.eps).rsqrt())
        return torch.cat(chunks)

    def _random_unit(self) -> Tensor:
        u = torch.randn(sum(self._sizes), generator=self._generator, dtype=torch.float32)
        return (u / torch.linalg.vector_norm(u)).to(self.device)

    def _unflatten(self, flat: Tensor) -> List[Tensor]:
        return [c.view(s) for c, s in zip(flat.split(self._sizes), self._shapes)]
