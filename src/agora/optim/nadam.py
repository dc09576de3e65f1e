"""Staleness-aware optimizer for the asynchronous pipeline (METHODS.md §2) and a bounded weight stash.

Why: in PipeDream-style asynchronous 1F1B, stage ``s`` of ``P`` applies gradients that are ``tau_s = P-1-s``
optimizer steps stale. NAdam with decoupled weight decay and a high ``beta1`` (0.99) extrapolates along the momentum
and lets the stale gradient in with weight ~0.01, so staleness hurts far less than with Adam (measured on CPU toys).

* :class:`DelayedNAdam`: exactly ``torch.optim.NAdam(..., decoupled_weight_decay=True, momentum_decay=0.004)``,
  plus two optional, flag-guarded additions: a weight look-ahead by the delay (off by default, ``delay=0``) and a
  per-stage ``beta1`` (:func:`beta1_for_delay`). State layout is torch's plus ``mu_product``.
* :class:`WeightStash`: keeps the weights a microbatch's forward used, for its backward (bounded versions).

``agora.optim.build_optimizer`` builds it for ``optimizer.name: nadam``. The look-ahead's definition, the measured
losses and how the stage runtime stashes weights: docs/OPTIMIZER.md.
"""

from __future__ import annotations

import contextlib
import functools
from collections import OrderedDict
from typing import Callable, Hashable, Iterable, Iterator, List, Optional, Sequence, Tuple

import torch

__all__ = ["DelayedNAdam", "WeightStash", "beta1_for_delay", "nadam_mu", "nadam_mu_product"]


def nadam_mu(beta1: float, step: int, momentum_decay: float) -> float:
    """NAdam's momentum schedule ``mu_t = beta1 * (1 - 0.5 * 0.96 ** (t * psi))`` (same as torch.optim.NAdam)."""
    return beta1 * (1.0 - 0.5 * 0.96 ** (step * momentum_decay))


@functools.lru_cache(maxsize=64)
def nadam_mu_product(beta1: float, step: int, momentum_decay: float) -> float:
    """``prod_{i=1..step} mu_i``; used to rebuild state that was imported without ``mu_product``."""
    product = 1.0
    for i in range(1, step + 1):
        product *= nadam_mu(beta1, i, momentum_decay)
    return product


def beta1_for_delay(beta1: float, delay: int, num_stages: int, target: float = 0.99) -> float:
    """METHODS §2.4 per-stage momentum boost: ``beta1 + delay * (target - beta1) / num_stages``.

    Stages with more staleness (earlier stages) get more momentum. Returns ``beta1`` unchanged when
    ``beta1 >= target`` (the boost never lowers momentum).
    """
    if num_stages <= 0 or delay < 0:
        raise ValueError(f"need num_stages > 0 and delay >= 0, got {num_stages}, {delay}")
    if beta1 >= target:
        return beta1
    return beta1 + delay * (target - beta1) / num_stages


class DelayedNAdam(torch.optim.Optimizer):
    """NAdam with decoupled weight decay (torch semantics) plus an optional look-ahead of the weights by ``delay``.

    :param lr: learning rate (``set_lr`` may overwrite ``group["lr"]`` every step, as for AdamW)
    :param betas: ``(beta1, beta2)``; ``beta1 = 0.99`` is the async-pipeline default (METHODS §2)
    :param weight_decay: decoupled: ``w <- w * (1 - lr * weight_decay)`` before the NAdam update
    :param momentum_decay: NAdam's ``psi`` (0.004 as torch and node0)
    :param delay: staleness ``tau`` of the gradients this group receives; only used by :meth:`lookahead_weights`
      (0 disables the look-ahead: forwards then run on the master weights)
    :param lookahead_scale: multiplies ``tau`` in the look-ahead (ablation knob; 1.0 = extrapolate the full delay)
    """

    def __init__(
        self,
        params: Iterable,
        lr: float = 3e-4,
        betas: Tuple[float, float] = (0.99, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        momentum_decay: float = 0.004,
        delay: int = 0,
        lookahead_scale: float = 1.0,
    ):
        if lr < 0 or eps < 0 or weight_decay < 0 or momentum_decay < 0 or delay < 0:
            raise ValueError("lr, eps, weight_decay, momentum_decay and delay must be non-negative")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"betas must be in [0, 1), got {betas}")
        defaults = dict(
            lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, momentum_decay=momentum_decay,
            delay=delay, lookahead_scale=lookahead_scale,
        )
        super().__init__(params, defaults)

    def _state_for(self, p: torch.Tensor, group: dict) -> dict:
        state = self.state[p]
        if "exp_avg" not in state:
            state.clear()
            state["step"] = torch.tensor(0.0)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["mu_product"] = 1.0
        elif "mu_product" not in state:  # imported by StageRuntime.import_state, which does not carry it
            state["mu_product"] = nadam_mu_product(group["betas"][0], int(state["step"]), group["momentum_decay"])
        return state

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], float]] = None) -> Optional[float]:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, (beta1, beta2), eps = group["lr"], group["betas"], group["eps"]
            wd, psi = group["weight_decay"], group["momentum_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = p.grad
                if grad.is_sparse:
                    raise RuntimeError("DelayedNAdam does not support sparse gradients")
                state = self._state_for(p, group)
                state["step"] += 1
                t = int(state["step"].item())
                mu = nadam_mu(beta1, t, psi)
                mu_next = nadam_mu(beta1, t + 1, psi)
                mu_product = state["mu_product"] * mu
                state["mu_product"] = mu_product
                if wd != 0:
                    p.mul_(1.0 - lr * wd)
                exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
                exp_avg.lerp_(grad, 1.0 - beta1)
                exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)
                denom = (exp_avg_sq / (1.0 - beta2**t)).sqrt_().add_(eps)
                p.addcdiv_(grad, denom, value=-lr * (1.0 - mu) / (1.0 - mu_product))
                p.addcdiv_(exp_avg, denom, value=-lr * mu_next / (1.0 - mu_product * mu_next))
        return loss

    @torch.no_grad()
    def predicted_update(self, p: torch.Tensor, group: dict) -> Optional[torch.Tensor]:
        """The next step's update of ``p`` if the next gradient equalled the momentum ``m_t``; None before step 1.

        ``u = -lr * (c_m + c_g) * m_t / denom_t - lr * wd * w`` with the NAdam coefficients of step ``t + 1``:
        ``c_m = mu_{t+2} / (1 - prod_{<=t+2} mu)`` and ``c_g = (1 - mu_{t+1}) / (1 - prod_{<=t+1} mu)``.
        """
        state = self.state.get(p)
        if not state or "exp_avg" not in state or int(state["step"]) == 0:
            return None
        state = self._state_for(p, group)
        lr, (beta1, beta2), eps = group["lr"], group["betas"], group["eps"]
        wd, psi = group["weight_decay"], group["momentum_decay"]
        t = int(state["step"].item())
        mu1, mu2 = nadam_mu(beta1, t + 1, psi), nadam_mu(beta1, t + 2, psi)
        prod1 = state["mu_product"] * mu1
        prod2 = prod1 * mu2
        coef = mu2 / (1.0 - prod2) + (1.0 - mu1) / (1.0 - prod1)
        denom = (state["exp_avg_sq"] / (1.0 - beta2**t)).sqrt_().add_(eps)
        update = state["exp_avg"] / denom
        update.mul_(-lr * coef)
        if wd != 0:
            update.add_(p, alpha=-lr * wd)
        return update

    @torch.no_grad()
    def lookahead_weights(self, delay: Optional[float] = None,
                          params: Optional[Sequence[torch.Tensor]] = None) -> List[torch.Tensor]:
        """New tensors ``w + lookahead_scale * tau * u``, one per parameter; no side effects.

        :param delay: overrides every group's ``delay``. A parameter without optimizer state yet, or with
          ``tau == 0``, is returned as a plain clone.
        :param params: the order to return them in (e.g. ``module.parameters()``, the order a ``WeightStash`` was
          built with); default: param_groups order. ``build_optimizer`` groups decay/no-decay parameters, so the
          two orders differ: always pass the stash's ``params``.
        """
        group_of = {id(p): group for group in self.param_groups for p in group["params"]}
        order = self.params_in_order() if params is None else list(params)
        out: List[torch.Tensor] = []
        for p in order:
            group = group_of.get(id(p))
            if group is None:
                raise ValueError("lookahead_weights(params=...) got a tensor this optimizer does not hold")
            tau = group["delay"] if delay is None else delay
            w = p.detach().clone()
            if tau:
                update = self.predicted_update(p, group)
                if update is not None:
                    w.add_(update, alpha=float(tau) * group["lookahead_scale"])
            out.append(w)
        return out

    def params_in_order(self) -> List[torch.Tensor]:
        """All parameters in param_groups order (the default order of :meth:`lookahead_weights`)."""
        return [p for group in self.param_groups for p in group["params"]]

    @contextlib.contextmanager
    def extrapolated(self, delay: Optional[float] = None) -> Iterator[None]:
        """Temporarily swap the look-ahead weights into the parameters (for simple loops and tests).

        Forward *and* backward must happen inside; the master weights are restored on exit.
        """
        params = self.params_in_order()
        ahead = self.lookahead_weights(delay)
        master = [p.data for p in params]
        try:
            for p, w in zip(params, ahead):
                p.data = w
            yield
        finally:
            for p, m in zip(params, master):
                p.data = m


class WeightStash:
    """Bounded, versioned copies of a set of parameters (PipeDream weight stashing).

    A version is any hashable key, normally the optimizer step count at forward time; acquire versions in
    non-decreasing order (an old key acquired after it was freed would be re-created from the *current* weights).
    ``acquire`` pins the version
    (creating its copy on first use), ``use`` swaps it into the parameters for a forward or a recompute+backward,
    ``release`` unpins it; a version is freed when its last microbatch releases it *and* a newer version exists.
    When more than ``max_versions`` versions are held, the oldest is evicted (a microbatch whose backward never
    arrived must not pin memory forever); ``use``/``get`` on an evicted version raise ``KeyError``.

    The stash stores independent tensors: later in-place updates of the parameters never reach a stashed version.
    """

    def __init__(self, params: Sequence[torch.Tensor], max_versions: int):
        if max_versions < 1:
            raise ValueError(f"max_versions must be >= 1, got {max_versions}")
        self.params = list(params)
        self.max_versions = max_versions
        self._versions: "OrderedDict[Hashable, List[torch.Tensor]]" = OrderedDict()
        self._refs: dict = {}
        self.evicted = 0  # versions dropped while still referenced (lost or too-late backwards)

    def __len__(self) -> int:
        return len(self._versions)

    def __contains__(self, version: Hashable) -> bool:
        return version in self._versions

    def versions(self) -> List[Hashable]:
        return list(self._versions)

    @torch.no_grad()
    def acquire(self, version: Hashable, make: Optional[Callable[[], Sequence[torch.Tensor]]] = None) -> Hashable:
        """Pin ``version`` for one more microbatch; on first use store ``make()`` (default: clones of the params).

        ``make`` must return fresh tensors shaped like the parameters (e.g. ``optimizer.lookahead_weights``).
        """
        if version not in self._versions:
            tensors = [p.detach().clone() for p in self.params] if make is None else list(make())
            if len(tensors) != len(self.params) or any(t.shape != p.shape for t, p in zip(tensors, self.params)):
                raise ValueError("make() must return one tensor per parameter with the parameter's shape")
            self._versions[version] = tensors
            self._refs[version] = 0
            while len(self._versions) > self.max_versions:
                old, _ = self._versions.popitem(last=False)
                if self._refs.pop(old, 0) > 0:
                    self.evicted += 1
        self._refs[version] += 1
        self._collect()
        return version

    def release(self, version: Hashable) -> None:
        """Unpin one microbatch of ``version``; frees it if unreferenced and not the newest version."""
        if version not in self._refs:
            return  # already evicted
        self._refs[version] = max(0, self._refs[version] - 1)
        self._collect()

    def _collect(self) -> None:
        newest = next(reversed(self._versions), None)
        for v in [v for v, refs in self._refs.items() if refs == 0 and v != newest]:
            del self._versions[v], self._refs[v]

    def get(self, version: Hashable) -> List[torch.Tensor]:
        """The stashed tensors of ``version`` (the exact objects; do not modify them in place)."""
        try:
            return self._versions[version]
        except KeyError:
            raise KeyError(f"weight version {version!r} is not stashed (evicted or never acquired)") from None

    @contextlib.contextmanager
    def use(self, version: Hashable) -> Iterator[List[torch.Tensor]]:
        """Swap ``version`` into the parameters (``p.data``) for the duration of the block, then restore.

        Gradients still accumulate into each parameter's ``.grad``. Not re-entrant; compute-thread only.
        """
        tensors = self.get(version)
        live = [p.data for p in self.params]
        try:
            for p, t in zip(self.params, tensors):
                p.data = t
            yield tensors
        finally:
            for p, t in zip(self.params, live):
                p.data = t

    def clear(self) -> None:
        """Drop every version (after a state download, the stashed weights belong to another history)."""
        self._versions.clear()
        self._refs.clear()
