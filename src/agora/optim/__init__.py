"""Optimizer and schedule shared by the centralized baseline and every stage server.

Both must build the optimizer identically: a swarm stage that steps with other hyper-parameters than the
baseline would make every swarm-vs-centralized comparison meaningless.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from agora.config import OptimizerConfig


def lr_at(cfg: OptimizerConfig, step: int) -> float:
    """Linear warm-up to ``lr``, then cosine decay to ``min_lr_ratio * lr`` at ``total_steps``."""
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.total_steps - cfg.warmup_steps))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def build_optimizer(module: nn.Module, cfg: OptimizerConfig, delay: int = 0) -> torch.optim.Optimizer:
    """AdamW or delay-aware NAdam, with weight decay on matrices only (norm gains and 1-d tensors are not decayed).

    ``delay`` is the stage's pipeline staleness in optimizer steps; only NAdam with ``lookahead`` uses it.
    """
    decay, no_decay = [], []
    for _, p in module.named_parameters():
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    if cfg.name == "nadam":
        from agora.optim.nadam import DelayedNAdam

        return DelayedNAdam(groups, lr=lr_at(cfg, 0), betas=tuple(cfg.betas), momentum_decay=cfg.momentum_decay,
                            delay=delay if cfg.lookahead else 0)
    return torch.optim.AdamW(groups, lr=lr_at(cfg, 0), betas=tuple(cfg.betas), foreach=False)


def set_lr(optimizer: torch.optim.Optimizer, cfg: OptimizerConfig, step: int) -> float:
    lr = lr_at(cfg, step)
    for group in optimizer.param_groups:
        group["lr"] = lr
    return lr
