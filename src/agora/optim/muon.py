"""Muon and NuMuon: orthogonalised momentum for a stage's weight matrices, AdamW for everything else.

Muon steps a matrix along the polar factor of its (Nesterov) momentum, ``U V^T`` over all singular directions;
NuMuon keeps only the top ``k`` of them, the linear minimisation oracle over ``{||D||_2 <= 1, ||D||_* <= k}``
(METHODS section 11), so every update has rank ``k`` and the weights stay more compressible. Embeddings, the LM head
and vectors (norm gains) step with AdamW, exactly as ``torch.optim.AdamW`` would. Background: docs/OPTIMIZER.md.
"""

from __future__ import annotations

import math
from typing import Iterable, Optional

import torch

# Quintic Newton-Schulz coefficients that push every singular value of a normalised matrix towards 1 in a few steps
# (Jordan et al.'s Muon): the iteration does not converge to exactly 1, it lands in roughly [0.7, 1.2], which is
# what "Muon" means in practice; ``polar_exact`` gives the exact factor where that matters (tests, small runs).
_NS_COEFFS = (3.4445, -4.7750, 2.0315)


def newton_schulz(m: torch.Tensor, steps: int = 5, eps: float = 1e-7) -> torch.Tensor:
    """An approximate polar factor ``U V^T`` of the 2-D ``m`` by ``steps`` quintic Newton-Schulz iterations (fp32)."""
    a, b, c = _NS_COEFFS
    x = m.float()
    transposed = x.shape[0] > x.shape[1]
    if transposed:  # iterate on the wide orientation: X X^T is the smaller Gram matrix
        x = x.T
    x = x / (x.norm() + eps)
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if transposed else x


def top_k_svd(m: torch.Tensor, k: int, oversample: int = 8, iters: int = 3,
              generator: Optional[torch.Generator] = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The top ``k`` singular triplets ``(U_k, S_k, V_k)`` of the 2-D ``m`` by randomized block Krylov iteration.

    A Gaussian sketch of ``k + oversample`` columns is multiplied ``iters`` times by ``m m^T`` and every block is
    kept (the Krylov space, not only its last block, which is what makes a few iterations enough on a decaying
    spectrum); the SVD of ``m`` projected on that space gives the triplets. When the space would cover the smaller
    side anyway, an exact SVD is cheaper and is used. ``generator`` seeds the sketch: replicas that must take
    bit-identical steps pass generators seeded alike.
    """
    if m.dim() != 2:
        raise ValueError(f"top_k_svd needs a matrix, got shape {tuple(m.shape)}")
    rows, cols = m.shape
    small = min(rows, cols)
    if not 1 <= k <= small:
        raise ValueError(f"k = {k} must be in [1, {small}] for a {rows}x{cols} matrix")
    a = m.float()
    width = min(k + oversample, small)
    if (iters + 1) * width >= small:
        u, s, vh = torch.linalg.svd(a, full_matrices=False)
        return u[:, :k], s[:k], vh[:k].T
    sketch = torch.randn(cols, width, generator=generator, dtype=torch.float32).to(a.device)
    block = torch.linalg.qr(a @ sketch).Q
    blocks = [block]
    for _ in range(iters):
        block = torch.linalg.qr(a @ (a.T @ block)).Q  # re-orthonormalised each time: powers of m m^T lose rank fast
        blocks.append(block)
    basis = torch.linalg.qr(torch.cat(blocks, dim=1)).Q
    ub, s, vh = torch.linalg.svd(basis.T @ a, full_matrices=False)
    return basis @ ub[:, :k], s[:k], vh[:k].T


def rank_fraction(start: float, final: float, schedule: str, step: int, total_steps: int) -> float:
    """NuMuon's rank fraction r(t): constant, or linear / cosine from ``start`` to ``final`` over ``total_steps``."""
    if schedule == "constant" or total_steps <= 0:
        return start
    progress = min(1.0, max(0.0, step / total_steps))
    if schedule == "linear":
        return start + (final - start) * progress
    if schedule == "cosine":
        return final + (start - final) * 0.5 * (1 + math.cos(math.pi * progress))
    raise ValueError(f"unknown rank schedule {schedule!r}: constant, linear or cosine")


class Muon(torch.optim.Optimizer):
    """Muon (``rank=None``) or NuMuon (``rank`` = the fraction of singular directions kept) on the groups marked
    ``"kind": "matrix"``; AdamW, identical to ``torch.optim.AdamW(foreach=False)``, on groups marked ``"adamw"``.

    Matrix state is ``momentum_buffer`` (an exponential moving average of gradients) and ``step``; AdamW state is
    ``exp_avg``, ``exp_avg_sq`` and ``step`` as in torch, so checkpoints, state downloads and sparse averaging read
    both by name. Every matrix update is scaled by ``rms_scale * sqrt(max(rows, cols))``: a full-rank polar factor
    then has the RMS of a typical AdamW update (``rms_scale``), so one learning rate and schedule serve both kinds.

    :param seed: seeds the Krylov sketches, per (step, parameter): replicas of a stage that step with the same
      averaged gradient must draw the same sketch to stay bit-identical
    """

    def __init__(self, params: Iterable, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.95),
                 eps: float = 1e-8, weight_decay: float = 0.0, momentum: float = 0.95, nesterov: bool = True,
                 rms_scale: float = 0.2, rank: Optional[float] = None, rank_final: Optional[float] = None,
                 rank_schedule: str = "constant", total_steps: int = 1000, krylov_iters: int = 3,
                 oversample: int = 8, ns_steps: int = 5, seed: int = 0):
        if rank is not None and not 0.0 < rank <= 1.0:
            raise ValueError(f"rank {rank} must be a fraction in (0, 1]")
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, momentum=momentum,
                        nesterov=nesterov, rms_scale=rms_scale, kind="adamw")
        super().__init__(params, defaults)
        self.rank, self.rank_final = rank, (rank if rank_final is None else rank_final)
        self.rank_schedule, self.total_steps = rank_schedule, total_steps
        self.krylov_iters, self.oversample, self.ns_steps, self.seed = krylov_iters, oversample, ns_steps, seed
        rank_fraction(self.rank or 1.0, self.rank_final or 1.0, rank_schedule, 0, total_steps)  # validates the name
        for group in self.param_groups:
            if group["kind"] not in ("matrix", "adamw"):
                raise ValueError(f"param group kind {group['kind']!r}: 'matrix' or 'adamw'")
            if group["kind"] == "matrix" and any(p.dim() != 2 for p in group["params"]):
                raise ValueError("Muon's matrix groups take 2-D parameters only; put the others in an adamw group")

    def rank_for(self, shape: torch.Size, step: int) -> int:
        """How many singular directions a ``shape`` matrix keeps at (1-based) ``step``; all of them for Muon."""
        small = min(shape)
        if self.rank is None:
            return small
        r = rank_fraction(self.rank, self.rank_final, self.rank_schedule, step - 1, self.total_steps)
        return max(1, min(small, math.ceil(r * small)))

    def direction(self, m: torch.Tensor, step: int, index: int) -> torch.Tensor:
        """The orthogonalised update direction for momentum ``m`` (2-D) of the ``index``-th matrix at ``step``."""
        if self.rank is None:
            return newton_schulz(m, self.ns_steps)
        k = self.rank_for(m.shape, step)
        gen = torch.Generator().manual_seed((self.seed * 1_000_003 + step) * 10_007 + index)
        u, _, v = top_k_svd(m, k, self.oversample, self.krylov_iters, gen)
        return u @ v.T

    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        index = 0
        for group in self.param_groups:
            for p in group["params"]:
                if group["kind"] == "matrix":
                    index += 1
                if p.grad is None:
                    continue
                if group["kind"] == "matrix":
                    self._matrix_step(p, group, index)
                else:
                    self._adamw_step(p, group)
        return loss

    def _matrix_step(self, p: torch.Tensor, group: dict, index: int) -> None:
        state = self.state[p]
        if not state:
            state["step"] = torch.tensor(0.0)
            state["momentum_buffer"] = torch.zeros_like(p, dtype=torch.float32)
        state["step"] += 1
        step = int(state["step"].item())
        beta = group["momentum"]
        grad = p.grad.float()
        buf = state["momentum_buffer"]
        buf.lerp_(grad, 1 - beta)
        m = grad.lerp(buf, beta) if group["nesterov"] else buf
        d = self.direction(m, step, index)
        scale = group["rms_scale"] * math.sqrt(max(p.shape))
        p.mul_(1 - group["lr"] * group["weight_decay"])
        p.add_(d.to(p.dtype), alpha=-group["lr"] * scale)

    def _adamw_step(self, p: torch.Tensor, group: dict) -> None:
        # torch.optim.AdamW's single-tensor path, operation for operation (a test holds it to bit equality).
        state = self.state[p]
        if not state:
            state["step"] = torch.tensor(0.0)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        beta1, beta2 = group["betas"]
        lr, grad = group["lr"], p.grad
        state["step"] += 1
        step = state["step"].item()
        p.mul_(1 - lr * group["weight_decay"])
        state["exp_avg"].lerp_(grad, 1 - beta1)
        state["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        bias_correction1 = 1 - beta1 ** step
        bias_correction2 = 1 - beta2 ** step
        denom = (state["exp_avg_sq"].sqrt() / bias_correction2 ** 0.5).add_(group["eps"])
        p.addcdiv_(state["exp_avg"], denom, value=-lr / bias_correction1)
