"""Optimizer and schedule shared by the centralized baseline and every stage server.

Both must build the optimizer identically: a swarm stage that steps with other hyper-parameters than the
baseline would make every swarm-vs-centralized comparison meaningless.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import nn

from agora.config import OptimizerConfig


def lr_at(cfg: OptimizerConfig, step: int) -> float:
    """Linear warm-up to ``lr``, then cosine decay to ``min_lr_ratio * lr`` at ``total_steps``."""
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.total_steps - cfg.warmup_steps))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


OPTIMIZER_KERNELS = ("auto", "single", "fused")


def use_fused_kernel(kernel: str, optimizer: str, step_device: torch.device) -> bool:
    """Whether an optimizer steps with torch's fused AdamW kernel: ``kernel`` is a peer's ``--optimizer-kernel``
    (``single``: the single-tensor loop, bit-identical to ``train-local`` on a CPU; ``fused``; ``auto``: fused when
    ``optimizer`` is adamw and it steps on a CUDA device, where the loop launches a dozen kernels per tensor)."""
    if kernel not in OPTIMIZER_KERNELS:
        raise ValueError(f"--optimizer-kernel {kernel!r}: use one of {', '.join(OPTIMIZER_KERNELS)}")
    if kernel == "fused":
        if optimizer != "adamw":
            raise ValueError(f"--optimizer-kernel fused: there is a fused kernel for adamw only (the manifest's "
                             f"optimizer is {optimizer!r}); use --optimizer-kernel single")
        return True
    return kernel == "auto" and optimizer == "adamw" and step_device.type == "cuda"


def build_optimizer(module: nn.Module, cfg: OptimizerConfig, delay: int = 0, names: Optional[list[str]] = None,
                    seed: int = 0, fused: bool = False) -> torch.optim.Optimizer:
    """AdamW, delay-aware NAdam, Muon or NuMuon, with weight decay on matrices only (norm gains and 1-d tensors are
    not decayed).

    ``delay`` is the stage's pipeline staleness in optimizer steps; only NAdam with ``lookahead`` uses it. ``names``:
    the parameters' names when ``module`` names them otherwise (host copies); Muon tells block matrices from the
    embedding and LM head by name. ``seed``: Muon's sketch seed (the run's seed: replicas must agree). ``fused``:
    torch's fused AdamW kernel (one kernel for every tensor; adamw only) instead of the single-tensor loop. Both
    compute the same update, rounded differently: replicas with different kernels agree within the averaging
    scheme's tolerance, not bit for bit.
    """
    if fused and cfg.name != "adamw":
        raise ValueError(f"a fused optimizer kernel exists for adamw only (optimizer.name is {cfg.name!r})")
    named = list(module.named_parameters())
    if names is not None:
        if len(names) != len(named):
            raise ValueError(f"{len(names)} names for {len(named)} parameters")
        named = [(n, p) for n, (_, p) in zip(names, named)]
    trainable = [(n, p) for n, p in named if p.requires_grad]
    if cfg.name in ("muon", "numuon"):
        from agora.optim.muon import Muon

        matrices = [p for n, p in trainable if is_block_matrix(n, p)]
        rest = [(n, p) for n, p in trainable if not is_block_matrix(n, p)]
        groups = [{"params": matrices, "weight_decay": cfg.weight_decay, "kind": "matrix"},
                  {"params": [p for _, p in rest if p.dim() >= 2], "weight_decay": cfg.weight_decay},
                  {"params": [p for _, p in rest if p.dim() < 2], "weight_decay": 0.0}]
        mc = cfg.muon
        return Muon([g for g in groups if g["params"]], lr=lr_at(cfg, 0), betas=tuple(cfg.betas),
                    momentum=mc.momentum, nesterov=mc.nesterov, rms_scale=mc.rms_scale,
                    rank=mc.rank if cfg.name == "numuon" else None, rank_final=mc.rank_final,
                    rank_schedule=mc.rank_schedule, total_steps=cfg.total_steps, krylov_iters=mc.krylov_iters,
                    oversample=mc.oversample, ns_steps=mc.ns_steps, seed=seed)
    decay = [p for _, p in trainable if p.dim() >= 2]
    no_decay = [p for _, p in trainable if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    if cfg.name == "nadam":
        from agora.optim.nadam import DelayedNAdam

        return DelayedNAdam(groups, lr=lr_at(cfg, 0), betas=tuple(cfg.betas), momentum_decay=cfg.momentum_decay,
                            delay=delay if cfg.lookahead else 0)
    if fused:
        return torch.optim.AdamW(groups, lr=lr_at(cfg, 0), betas=tuple(cfg.betas), fused=True)
    return torch.optim.AdamW(groups, lr=lr_at(cfg, 0), betas=tuple(cfg.betas), foreach=False)


def is_block_matrix(name: str, p: torch.Tensor) -> bool:
    """A 2-D weight inside a transformer block: what Muon orthogonalises. The embedding and LM head are lookup and
    read-out tables (their rows are tokens, not directions of a linear map between hidden spaces) and use AdamW."""
    return p.dim() == 2 and "embed_tokens" not in name and "lm_head" not in name


def set_lr(optimizer: torch.optim.Optimizer, cfg: OptimizerConfig, step: int) -> float:
    lr = lr_at(cfg, step)
    for group in optimizer.param_groups:
        group["lr"] = lr
    return lr
