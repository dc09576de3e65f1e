"""DiLoCo's outer step (METHODS §8): Nesterov SGD on the pseudo-gradient ``start - local`` of an inner phase.

One function for every place that takes it: the ``diloco`` scheme (each replica's proposal), the ``gossip`` scheme
(from a start mixed with partners) and the offline gossip benchmark (rows of replicas). Elementwise, in float64.
"""

from __future__ import annotations

from typing import Optional

import torch


def nesterov_outer_step(start: torch.Tensor, momentum: torch.Tensor, local: torch.Tensor, lr: float, mu: float,
                        mixed_start: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``delta = start - local``, ``v = mu momentum + delta``, new parameters ``(mixed_start or start) - lr (delta +
    mu v)``: what ``torch.optim.SGD(lr, momentum=mu, nesterov=True)`` does to ``start`` given the gradient
    ``delta`` (gossip steps from a ``mixed_start`` instead). Returns (new parameters, new momentum), float64."""
    delta = start.double() - local.double()
    velocity = mu * momentum.double() + delta
    base = start if mixed_start is None else mixed_start
    return base.double() - lr * (delta + mu * velocity), velocity
