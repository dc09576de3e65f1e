"""Factored gossip DiLoCo's arithmetic (METHODS §8): mixing graphs, their weights on a live graph, the outer step.

A mixing matrix ``W`` (n x n) says what each replica's new parameters are made of: ``theta_i <- sum_j W_ij
theta_j``. It must be symmetric and doubly stochastic, so that mixing keeps the replicas' mean (no drift of the
model as a whole) and contracts their spread. Metropolis-Hastings weights ``W_ij = 1 / (1 + max(deg_i, deg_j))``
on the edges that are alive keep both properties whatever edges died, which is why gossip degrades gracefully.

Two graphs: the one-peer exponential graph (round ``r`` pairs ``i`` with ``i XOR 2^(r mod log2 n)``; over
``log2 n`` rounds the product of its matrices is the exact average) for Mix1, which overlaps the next inner phase;
and the ring ``(I + S + S^T) / 3`` for Mix2's ``q`` blocking rounds (``q = 0``: no blocking at all; ``q -> inf``:
exact DiLoCo).
"""

from __future__ import annotations

import math
from typing import Iterable, Optional

import torch

from agora.optim.outer import nesterov_outer_step

Edge = tuple[int, int]


def ring_edges(n: int) -> list[Edge]:
    """The ring's edges ``(i, i + 1 mod n)``, each once (none for n = 1, one for n = 2)."""
    if n < 2:
        return []
    return sorted({tuple(sorted((i, (i + 1) % n))) for i in range(n)})


def exponential_edges(n: int, round_index: int) -> list[Edge]:
    """The one-peer exponential graph of round ``round_index``: ``i`` with ``i XOR 2^k``, ``k = round mod
    ceil(log2 n)``; a replica whose partner would be ``>= n`` (n not a power of two) sits the round out."""
    if n < 2:
        return []
    k = round_index % max(1, math.ceil(math.log2(n)))
    return sorted({tuple(sorted((i, i ^ (1 << k)))) for i in range(n) if (i ^ (1 << k)) < n})


def metropolis_hastings(n: int, edges: Iterable[Edge], dead: Iterable[Edge] = ()) -> torch.Tensor:
    """The mixing matrix of ``edges`` minus ``dead`` ones, in float64: ``1 / (1 + max(deg_i, deg_j))`` on every live
    edge, the rest of each row on the diagonal. Symmetric and doubly stochastic for any set of live edges."""
    gone = {tuple(sorted(e)) for e in dead}
    live = sorted({tuple(sorted(e)) for e in edges if e[0] != e[1]} - gone)
    for i, j in live:
        if not (0 <= i < n and 0 <= j < n):
            raise ValueError(f"edge {(i, j)} outside {n} replicas")
    degree = [0] * n
    for i, j in live:
        degree[i] += 1
        degree[j] += 1
    w = torch.zeros(n, n, dtype=torch.float64)
    for i, j in live:
        w[i, j] = w[j, i] = 1.0 / (1 + max(degree[i], degree[j]))
    w += torch.diag(1.0 - w.sum(dim=1))
    return w


def mixing_error(w: torch.Tensor) -> float:
    """``||W - 11^T / n||_2``: how much one mix leaves of the replicas' disagreement (0: the exact average)."""
    n = w.shape[0]
    return float(torch.linalg.matrix_norm(w - torch.full_like(w, 1.0 / n), ord=2))


def consensus_distance(thetas: torch.Tensor) -> float:
    """Relative spread of replicas' parameters (rows of ``thetas``): mean ``||theta_i - mean||`` over ``||mean||``."""
    mean = thetas.mean(dim=0)
    return float((thetas - mean).norm(dim=1).mean() / mean.norm().clamp_min(1e-30))


def gossip_outer_step(start: torch.Tensor, end: torch.Tensor, momentum: torch.Tensor, w1: Optional[torch.Tensor],
                      lr: float, mu: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One outer step of every replica (rows), factored gossip DiLoCo's step 2: ``Delta_i = start_i - end_i``,
    ``u_i <- mu u_i + Delta_i``, ``theta_i <- sum_j W1_ij start_j - lr (Delta_i + mu u_i)``. ``w1=None`` is exact
    DiLoCo (every replica mixes with the exact average and steps on the averaged pseudo-gradient and momentum).
    Returns (new parameters, new momentum)."""
    if w1 is None:  # every replica at the averages: averaging the end is averaging the pseudo-gradient
        start, end, momentum = (t.mean(dim=0, keepdim=True).expand_as(t) for t in (start, end, momentum))
        return nesterov_outer_step(start, momentum, end, lr, mu)
    return nesterov_outer_step(start, momentum, end, lr, mu, mixed_start=w1.to(start.dtype) @ start)
