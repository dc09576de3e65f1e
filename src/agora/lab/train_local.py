"""Centralized baseline: the whole model in one process, same manifest, data and optimizer as the swarm.

Every swarm benchmark is reported as a ratio against this run, so it counts tokens and CPU time the same way.
"""

from __future__ import annotations

import json
import math
import resource
import time
from pathlib import Path
from typing import Callable, Optional

import torch

from agora.config import Manifest
from agora.data import build_datasets
from agora.devices import autocast, check_precision, memory_report, resolve_device
from agora.model import PipelineModel, count_parameters, flops_per_token, warmup_end, warmup_measurement
from agora.optim import build_optimizer, lr_at, set_lr, use_fused_kernel
from agora.optim.curvature import CurvatureTracker, alarm_threshold, tracked_parameters, warmup_holds


def cpu_seconds() -> float:
    """CPU time of this process and its finished children (user + system)."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


@torch.no_grad()
def tokens_per_step(manifest: Manifest) -> int:
    """Tokens of one optimizer step: whole microbatches of the target batch (at least one), as this baseline and
    every stage count them, so a swarm and the baseline trained the same number of steps saw the same tokens."""
    b = manifest.batch
    return max(1, b.target_batch_size // b.microbatch_size) * b.microbatch_size * manifest.model.seq_len


def evaluate(model: PipelineModel, batches: list[torch.Tensor], precision: str = "fp32") -> float:
    model.eval()
    device = next(model.parameters()).device
    with torch.no_grad(), autocast(device, precision):
        losses = [model.loss(b[:, :-1].to(device), b[:, 1:].to(device)).item() for b in batches]
    model.train()
    return float(sum(losses) / len(losses))


def train_local(manifest: Manifest, steps: int, out_dir: Optional[Path] = None, **options) -> dict:
    """Train ``steps`` optimizer steps of ``batch.target_batch_size`` sequences; return (and write) the summary.
    ``options``: those of :func:`train_model`."""
    return train_model(manifest, steps, out_dir, **options)[0]


def train_model(
    manifest: Manifest,
    steps: int,
    out_dir: Optional[Path] = None,
    val_batches: int = 8,
    eval_every: int = 0,
    threads: Optional[int] = None,
    on_step: Optional[Callable[[dict], None]] = None,
    shard: Optional[tuple[int, int]] = None,
    after_step: Optional[Callable[[PipelineModel, torch.optim.Optimizer, int], None]] = None,
    curvature_every: int = 0,
    curvature_hvps: int = 3,
    curvature_sequences: int = 2,
    curvature_reference_hvps: int = 0,
    curvature_reference_steps: tuple[int, ...] = (),
    curvature_method: str = "lanczos",
    device: str = "cpu",
    precision: str = "fp32",
    checkpoint_blocks: bool = False,
    reverse_accumulation: bool = False,
    optimizer_kernel: str = "auto",
    wire_boundaries: bool = False,
) -> tuple[dict, PipelineModel]:
    """Train ``steps`` optimizer steps of ``batch.target_batch_size`` sequences: (summary, trained model); the
    summary is also written to ``out_dir``.

    ``shard``: train on shard (index, count) of the training split in the order a swarm trainer of that shard
    streams it (``agora train --shard``), so a one-trainer swarm and this run see the very same microbatches
    (None: the whole split). ``after_step(model, optimizer, step)`` runs after every optimizer step (``agora bench
    upm`` rotates frames there).

    ``curvature_every``: measure the whole model's top preconditioned Hessian eigenvalue after every N-th step
    (``ModelCurvature``; a curvature-driven warm-up measures at its manifest's cadence whatever this says);
    ``curvature_reference_hvps``: after the measurement at each of ``curvature_reference_steps`` (default: the last
    step), one Lanczos run of that many products from the tracker's vector at the same point, for the tracker's
    error against a (nearly) converged value; ``curvature_method``:
    the tracker's (``CurvatureTracker``).

    ``device``, ``precision``, ``checkpoint_blocks``: as a node's ``--device``, ``--precision`` (bf16: autocast
    over fp32 weights), ``--checkpoint-blocks`` and ``--optimizer-kernel`` (``auto``: torch's fused AdamW on CUDA);
    the defaults are the bit-exact CPU baseline.
    ``reverse_accumulation``: each step's microbatches are backpropagated in reverse order: the same gradient sum,
    rounded differently (``agora bench convergence``'s noise-floor row).
    ``wire_boundaries``: every boundary (training and validation) rounds as a swarm's does (``PipelineModel``): the
    computation of a one-replica, one-in-flight swarm, to compare it with bit for bit."""
    dev = resolve_device(device)
    check_precision(dev, precision)
    fused = use_fused_kernel(optimizer_kernel, manifest.optimizer.name, dev)
    if threads:
        torch.set_num_threads(threads)
    torch.manual_seed(manifest.seed)
    train, val, _ = build_datasets(manifest)
    if shard is not None:
        train = train.shard(manifest.seed, *shard)
    model = PipelineModel(manifest, wire_boundaries=wire_boundaries).to(dev)
    for stage in model.stages:
        stage.checkpoint_blocks = checkpoint_blocks
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    opt = build_optimizer(model, manifest.optimizer, seed=manifest.seed, fused=fused)
    mb, target = manifest.batch.microbatch_size, manifest.batch.target_batch_size
    accum = max(1, target // mb)
    batches = train.batches(mb, seed=manifest.seed)
    val_set = val.fixed_batches(mb, val_batches)
    step_tokens = tokens_per_step(manifest)

    warm = manifest.training.warmup_depth
    by_curvature = warm is not None and warm.mode == "curvature"
    every = warm.curvature_every if by_curvature else curvature_every
    curvature = None
    if every:
        sample = next(train.batches(mb, seed=manifest.seed + 1))[:curvature_sequences]  # its own stream
        curvature = ModelCurvature(manifest, model, sample.to(dev), every, curvature_hvps,
                                   reference=((tuple(curvature_reference_steps) or (steps,)), curvature_reference_hvps)
                                   if curvature_reference_hvps else None,
                                   method=curvature_method)
    clock, held = 0, 0  # the architecture warm-up's clock (agora.model.active_depth) and the steps it was held

    history: list[dict] = []
    evals: list[dict] = []
    t0, c0 = time.perf_counter(), cpu_seconds()
    tokens = 0
    for step in range(steps):
        lr = set_lr(opt, manifest.optimizer, step)
        total = train_step(model, opt, batches, accum, manifest.optimizer.grad_clip, precision, reverse_accumulation)
        hold = by_curvature and clock < warmup_end(manifest) and curvature.holds(warmup_measurement(manifest, step))
        clock, held = clock + (not hold), held + hold
        model.grow_for_step(clock)  # architecture warm-up (training.warmup_depth): blocks due now join
        if curvature is not None:
            curvature.after_step(opt, step + 1)
        if after_step is not None:
            after_step(model, opt, step)
        tokens += step_tokens
        rec = {"step": step, "loss": total, "lr": lr, "tokens": tokens, "wall_s": time.perf_counter() - t0,
               "depth": model.stages[-1].active_depth, "warmup_clock": clock}
        if eval_every and (step + 1) % eval_every == 0 and step + 1 < steps:
            evals.append({"step": step, "tokens": tokens, "val_loss": evaluate(model, val_set, precision)})
        history.append(rec)
        if on_step:
            on_step(rec)
    wall, cpu = time.perf_counter() - t0, cpu_seconds() - c0
    val_loss = evaluate(model, val_set, precision)
    evals.append({"step": steps - 1, "tokens": tokens, "val_loss": val_loss})
    summary = _summary(manifest, steps, tokens, wall, cpu, history, evals)
    summary["wire_boundaries"] = wire_boundaries
    summary["curvature"] = curvature.summary() if curvature is not None else None
    summary["warmup"] = {"mode": warm.mode, "clock": clock, "held_steps": held} if warm is not None else None
    summary["compute"] = {**memory_report(dev), "precision": precision, "checkpoint_blocks": checkpoint_blocks,
                          "optimizer_kernel": "fused" if fused else "single"}
    if out_dir is not None:
        _write(summary, Path(out_dir))
    return summary, model


class ModelCurvature:
    """The whole model's ``lambda_max(P^-1/2 H P^-1/2)`` (token embeddings left out: ``tracked_parameters``) after
    every ``every``-th optimizer step, on fixed training sequences, with the optimizer's own second moments."""

    def __init__(self, manifest: Manifest, model: PipelineModel, sample: torch.Tensor, every: int, hvps: int,
                 reference: Optional[tuple[tuple[int, ...], int]] = None, method: str = "lanczos"):
        self.manifest, self.model, self.sample, self.every = manifest, model, sample, every
        # (steps, products): after the measurement at each of these steps, a nearly converged value to score the
        # tracker's against (CurvatureTracker.reference; not counted as the tracker's cost)
        self.reference = reference
        self.references: list[dict] = []
        self.reference_seconds = 0.0  # inside the run's wall time, but neither training nor the tracker's cost
        self.threshold = alarm_threshold(manifest.optimizer.betas[0])
        self.params = tracked_parameters(list(model.named_parameters()))
        self.tracker = CurvatureTracker(self.params, hvps=hvps, seed=manifest.seed, method=method)
        self.values: list[dict] = []  # {"step", "lambda", "lr_x_lambda"} per measurement
        self.by_step: dict[int, float] = {}  # step -> lr x lambda
        self.seconds = 0.0
        self.alarms = 0

    def after_step(self, opt: torch.optim.Optimizer, step: int) -> None:
        """After optimizer step ``step`` (1-based count of steps taken): measure when due."""
        from torch.nn.attention import SDPBackend, sdpa_kernel

        if step % self.every:
            return
        moments = [opt.state.get(p, {}).get("exp_avg_sq") for p in self.params]
        taken = next((int(opt.state[p]["step"]) for p in self.params if "step" in opt.state.get(p, {})), 0)
        tokens = self.sample
        loss = lambda: self.model.loss(tokens[:, :-1], tokens[:, 1:])  # noqa: E731
        beta2 = self.manifest.optimizer.betas[1]
        with sdpa_kernel(SDPBackend.MATH):  # fused attention has no second derivative
            value = self.tracker.measure(loss, moments, beta2, taken)
            if self.reference is not None and step in self.reference[0]:
                started = time.perf_counter()
                exact = self.tracker.reference(loss, moments, beta2, taken, self.reference[1])
                self.reference_seconds += time.perf_counter() - started
                self.references.append({"step": step, "hvps": self.reference[1], "lambda": exact, "tracker": value,
                                        "relative_error": abs(value - exact) / abs(exact) if exact else math.inf})
        self.seconds += self.tracker.last_seconds
        lr = lr_at(self.manifest.optimizer, step)
        self.values.append({"step": step, "lambda": value, "lr_x_lambda": lr * value})
        self.by_step[step] = lr * value
        self.alarms += int(self.tracker.alarm(lr, self.manifest.optimizer.betas[0]))

    def holds(self, measured_at: Optional[int]) -> bool:
        """Whether the measurement after step ``measured_at`` holds a curvature-driven warm-up's clock."""
        value = self.by_step.get(measured_at) if measured_at is not None else None
        return warmup_holds(value, self.manifest.training.warmup_depth.hold_above, self.manifest.optimizer.betas[0])

    def summary(self) -> dict:
        out = {"every": self.every, "hvps": self.tracker.hvps, "method": self.tracker.method, "sequences": int(self.sample.shape[0]),
               "values": self.values, "alarms": self.alarms, "threshold": self.threshold, "seconds": self.seconds,
               "reference_seconds": self.reference_seconds}
        if self.references:
            out["references"] = self.references
            out["reference"] = self.references[-1]
        return out


def train_step(model: PipelineModel, opt, batches, accum: int, grad_clip: float, precision: str = "fp32",
               reverse: bool = False) -> float:
    """One optimizer step over ``accum`` microbatches; returns the step's mean training loss. ``reverse``: take the
    step's microbatches first and backpropagate them last to first (the same sum of gradients, rounded
    differently)."""
    total = 0.0
    device = next(model.parameters()).device
    step_batches = [next(batches) for _ in range(accum)]
    for b in reversed(step_batches) if reverse else step_batches:
        b = b.to(device)
        with autocast(device, precision):
            loss = model.loss(b[:, :-1], b[:, 1:]) / accum
        loss.backward()
        total += loss.item()
    torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return total


def _summary(manifest: Manifest, steps: int, tokens: int, wall: float, cpu: float, history: list[dict],
             evals: list[dict]) -> dict:
    return {
        "kind": "train-local",
        "run_id": manifest.run_id,
        "manifest_hash": manifest.hash,
        "residual": manifest.residual.mode,
        "steps": steps,
        "tokens": tokens,
        "wall_s": wall,
        "cpu_s": cpu,
        "tokens_per_s": tokens / wall,
        "tokens_per_cpu_s": tokens / max(cpu, 1e-9),
        "threads": torch.get_num_threads(),
        "train_loss": [r["loss"] for r in history],
        "history": history,
        "evals": evals,
        "val_loss": evals[-1]["val_loss"],
        "parameters": count_parameters(manifest)["total"],
        "flops_per_token": flops_per_token(manifest),
    }


def _write(summary: dict, out_dir: Path) -> None:
    from agora.lab.report import write_local_report

    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    write_local_report(summary, out_dir)
