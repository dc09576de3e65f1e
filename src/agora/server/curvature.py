"""A stage's own curvature: the top preconditioned Hessian eigenvalue of its parameters, measured on the compute
thread every N optimizer steps within a share of its compute time (agora.optim.curvature; docs/ARCHITECTURE.md
says what a stage's measurement sees and misses)."""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from agora.optim import lr_at
from agora.optim.curvature import CurvatureTracker, alarm_threshold, tracked_parameters

_SDPA_FLAGS = threading.Lock()  # held while the attention kernel flags are switched to the math kernel


@dataclass
class _Sample:
    """The last training microbatch this stage saw: its input, and either the gradient its output received (head,
    body) or its next-token targets (tail)."""

    coords: Optional[torch.Tensor]
    tokens: torch.Tensor
    grad_out: Optional[torch.Tensor] = None
    targets: Optional[torch.Tensor] = None


class StageCurvature:
    """Measures ``lambda_max(P^-1/2 H P^-1/2)`` of one stage after every ``every``-th optimizer step.

    H is the Hessian, over this stage's parameters, of ``<output, g>`` where g is the gradient the stage's output
    received for the last microbatch (held fixed), or of the loss itself on the tail; P is the stage's own Adam
    second moment (identity for Muon-stepped matrices). A measurement is skipped while measurements have used more
    than ``budget`` of the compute time so far, so a slow stage spends at most that share on it.

    :param runtime: the ``StageRuntime`` that owns it (not imported here: the runtime imports this module)
    """

    def __init__(self, runtime: Any, every: int, hvps: int = 3, budget: float = 0.05,
                 sequences: int = 2):
        self.rt = runtime
        self.every, self.budget = every, budget
        # Measured on the first few sequences of a microbatch: a Hessian-vector product costs about two backward
        # passes, so on a whole microbatch 3 of them every 10 steps would cost ~15% of a 4-microbatch step.
        self.sequences = sequences
        self.params = tracked_parameters(list(runtime.stage.named_parameters()))
        self.tracker = CurvatureTracker(self.params, hvps=hvps, seed=runtime.manifest.seed * 1009 + runtime.stage_index)
        self.sample: Optional[_Sample] = None
        self.alarms = 0
        self.skipped = 0
        self.seconds = 0.0
        self.lr_times_value = float("nan")
        self.last: Optional[tuple[int, float]] = None  # (step, lr x lambda) of the last finite measurement
        self.threshold = alarm_threshold(runtime.manifest.optimizer.betas[0])

    def keep(self, coords: Optional[torch.Tensor], tokens: torch.Tensor, grad_out: Optional[torch.Tensor] = None,
             targets: Optional[torch.Tensor] = None) -> None:
        """Remember a training microbatch to measure on (references only: it costs nothing until measured)."""
        n = self.sequences
        self.sample = _Sample(None if coords is None else coords.detach()[:n], tokens[:n],
                              None if grad_out is None else grad_out[:n], None if targets is None else targets[:n])

    def after_step(self, step: int, compute_s: float) -> Optional[float]:
        """Compute thread, after optimizer step ``step``: measure when due and within the budget; the value or None."""
        if self.every <= 0 or step % self.every or self.sample is None:
            return None
        if self.seconds > self.budget * (compute_s + self.seconds):  # its share of all compute, itself included
            self.skipped += 1
            return None
        # Fused attention kernels have no second derivative; the math kernel computes the same function and has.
        # sdpa_kernel sets process-wide flags: with several nodes in one process (as tests run them), another
        # compute thread leaving its own block would turn the fused kernels back on in the middle of ours.
        with _SDPA_FLAGS, sdpa_kernel(SDPBackend.MATH):
            value = self.tracker.measure(self._loss, *self._second_moments())
        self.seconds += self.tracker.last_seconds
        lr = lr_at(self.rt.manifest.optimizer, step)
        self.lr_times_value = lr * value
        if math.isfinite(self.lr_times_value):
            self.last = (step, self.lr_times_value)
        if self.tracker.alarm(lr, self.rt.manifest.optimizer.betas[0]):
            self.alarms += 1
        return value

    def _loss(self) -> torch.Tensor:
        rt, s = self.rt, self.sample
        assert s is not None
        _, out = rt.forward_from(s.coords, s.tokens)
        if rt.is_tail:
            return rt.stage.loss(out, s.targets) * s.tokens.shape[0]  # the scale the stage's gradients have
        basis = rt.stage.basis if rt.manifest.residual.mode == "subspace" else None
        sent = out @ basis if basis is not None else out
        return (sent.float() * rt._in(s.grad_out).float()).sum()

    def _second_moments(self) -> tuple[list, float, int]:
        moments, step = [], 0
        tracked = {id(p) for p in self.params}
        for p, q in zip(self.rt.stage.parameters(), self.rt.trained_parameters()):
            if id(p) not in tracked:
                continue
            st = self.rt.optimizer.state.get(q, {})
            moments.append(st.get("exp_avg_sq"))
            if "exp_avg_sq" in st:
                step = int(st["step"])
        return moments, self.rt.manifest.optimizer.betas[1], step

    def summary(self) -> dict:
        value = self.tracker.value
        return {"value": value if math.isfinite(value) else None, "every": self.every,
                "lr_times_value": self.lr_times_value if math.isfinite(self.lr_times_value) else None,
                "threshold": self.threshold, "alarms": self.alarms, "measurements": self.tracker.measurements,
                "seconds": self.seconds, "skipped_for_budget": self.skipped}
