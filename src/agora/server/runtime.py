"""One stage's compute: forward, backward, optimizer steps, weight stashing and state export/import.

Everything here runs on the node's single compute thread (``StageNode.run_compute``), so the stage's parameters are
only ever touched from one thread and an optimizer step never interleaves with half a backward. No networking: the
RPC handler (``handler.py``) and the replica sync (``averaging/``) call these methods. A stage move builds a new
``StageRuntime``; an in-flight microbatch of a runtime that is no longer active is refused with ``leaving``.

Weight stashing: forwards of one parameter version share one snapshot of the weights, so a backward that arrives
after an optimizer step still differentiates exactly the function its forward computed (no recompute); its
gradient is then moved to the live parameters. ``version`` counts every change of the parameters.
"""

from __future__ import annotations

import ctypes
import functools
import math
import os
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import torch

from agora.config import Manifest
from agora.devices import PRECISIONS, autocast, check_precision, memory_report, resolve_device
from agora.model import KVCache, Stage, tied_parameter
from agora.frames import FRAME_MAP, check_frame_map
from agora.server.upm import FRAME_EPOCHS, FrameLedger
from agora.net.transport import RpcError
from agora.optim import OPTIMIZER_KERNELS, build_optimizer, set_lr, use_fused_kernel
from agora.server.checkpoint import save_stage_checkpoint
from agora.server.curvature import StageCurvature
from agora.server.observers import Observers
from agora.wire import WIRE_DTYPES, Boundary, compress, decompress

# An output filter sees every message this stage sends before it leaves: (direction, tensor) -> tensor, where
# direction is "fwd" (the boundary to the next stage) or "bwd" (the gradient returned upstream). Production nodes
# have none; the attack simulator (``agora.lab.attacks``) registers one through ``add_output_filter``.
OutputFilter = Callable[[str, torch.Tensor], torch.Tensor]


@dataclass
class Counters:
    """Microbatch accounting of this peer (exported in the DHT record and /metrics)."""

    forward: int = 0
    backward: int = 0
    eval: int = 0
    tokens: int = 0
    retried: int = 0
    failed: int = 0
    rejected: int = 0
    busy_s: float = 0.0
    # Staleness: optimizer steps this stage took between a microbatch's forward and its backward (its gradient is
    # applied at the next step after that). Sum and count give the mean; the max bounds the pipeline's delay.
    staleness_sum: int = 0
    staleness_max: int = 0
    # NAdam look-ahead (``optimizer.lookahead``): training forwards that ran while their stage's step was pending, on
    # weights extrapolated one predicted update ahead
    lookahead_forwards: int = 0
    rejected_by_code: dict[str, int] = field(default_factory=dict)


# Runtimes of this process. hivemind starts its averager as a fork of the node; the child never touches the stage,
# yet it would keep a copy-on-write image of every parameter, gradient and optimizer moment the parent later
# rewrites (a full extra copy of the stage per node). The child drops them right after the fork.
_RUNTIMES: "weakref.WeakSet[StageRuntime]" = weakref.WeakSet()


def _drop_stage_tensors_in_forked_child() -> None:
    for rt in list(_RUNTIMES):
        rt.release_tensors()


os.register_at_fork(after_in_child=_drop_stage_tensors_in_forked_child)


def _glibc():
    """The C library when it is glibc (malloc tuning below), else None."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None
    except OSError:
        return None


# glibc raises its mmap threshold after every freed large block (up to 32 MiB), after which big buffers (gradients,
# averaging copies, state snapshot pieces) come from the heap and stay in the process when freed. A fixed threshold
# keeps every block over 8 MiB in its own mapping, returned to the system on free. Not lower: at 1 MiB every
# activation of a `small` microbatch was a fresh mapping, and page faults made forward+backward 60% slower.
# Two malloc arenas instead of one per thread (8 x cores): the compute thread, the DHT pool and the event loop free
# each other's blocks, and every extra arena keeps its own freed memory.
MMAP_THRESHOLD_BYTES = 8 << 20
MALLOC_ARENAS = 2
_M_MMAP_THRESHOLD, _M_ARENA_MAX = -3, -8  # mallopt's parameter numbers (malloc.h)


def return_freed_memory_to_the_system() -> bool:
    """Fix glibc's mmap threshold and arena count for this process (call it before starting threads); False where
    the C library is not glibc."""
    libc = _glibc()
    return libc is not None and bool(libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) and bool(
        libc.mallopt(_M_ARENA_MAX, MALLOC_ARENAS))


def trim_heap() -> None:
    """Give the freed part of the heap back to the system (glibc): after a state download or upload, whose
    stage-sized copies would otherwise stay in the process as free heap. Not per step: re-faulting the pages of
    every freed activation would cost more than it saves."""
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)


# The optimizer state a stage exports per parameter (``opt/<key>/<name>``): Adam's moments, Muon's momentum, the step.
OPTIMIZER_STATE_KEYS = ("exp_avg", "exp_avg_sq", "momentum_buffer", "step")
# Parameter values at this many seeded positions (the same on every replica of a stage) go into the peer's record:
# replicas' samples give the stage's consensus distance (ops.status, ReplicaSync) without moving parameters.
PARAMETER_SAMPLE = 128
SYNC_PREFIX = "sync/"  # names of the averaging scheme's own state in export_state (StageRuntime.sync_state)
BACKWARDS = ("stash", "recompute")


@dataclass(frozen=True)
class RuntimeOptions:
    """How this peer computes its stage; its own business, not the manifest's (replicas of one stage on different
    devices or precisions average together).

    :param device: ``auto``, ``cpu``, ``cuda`` or ``cuda:N``
    :param precision: ``fp32``, or ``bf16``: autocast for forward and backward, while master weights, gradients and
      optimizer moments stay fp32 (so averaging and steps are unchanged)
    :param backward: ``stash``: an in-flight microbatch keeps its autograd graph (activations) until its backward;
      ``recompute``: it keeps only its input, and the backward re-runs the forward on the same weight snapshot
      (same gradients, one microbatch's activations in memory at a time)
    :param offload_optimizer: the optimizer keeps fp32 master copies and its moments in host RAM and steps there;
      the device holds the weights and gradients only (3 of every 5 fp32 words of training state leave it)
    :param checkpoint_blocks: per-block activation checkpointing inside the stage: a training forward keeps only each
      block's input and the backward recomputes one block at a time (same gradients; ``agora plan`` says when a
      stage needs it)
    :param optimizer_kernel: ``single`` (the single-tensor AdamW loop: bit-identical to ``train-local`` on a CPU),
      ``fused`` (torch's fused AdamW kernel: one launch for every tensor, adamw only), or ``auto``: fused when the
      optimizer steps on a CUDA device with ``adamw``, single otherwise
    :param curvature_every: measure the stage's top preconditioned Hessian eigenvalue after every N-th optimizer
      step (0: never; server/curvature.py), with ``curvature_hvps`` Hessian-vector products, spending at most
      ``curvature_budget`` of the compute time on it
    """

    device: str = "cpu"
    precision: str = "fp32"
    backward: str = "stash"
    offload_optimizer: bool = False  # fp32 master weights, Adam moments and the step in host RAM
    checkpoint_blocks: bool = False
    optimizer_kernel: str = "auto"
    curvature_every: int = 0
    curvature_hvps: int = 3
    curvature_budget: float = 0.05

    def fused_kernel(self, optimizer: str) -> bool:
        """Whether this peer's optimizer (the manifest's ``optimizer``) runs the fused kernel: ``optimizer_kernel``
        for the device the step runs on (the host when the optimizer is offloaded)."""
        return use_fused_kernel(self.optimizer_kernel, optimizer,
                                resolve_device("cpu" if self.offload_optimizer else self.device))

    def __post_init__(self) -> None:
        if self.precision not in PRECISIONS:
            raise ValueError(f"--precision {self.precision!r}: use one of {', '.join(PRECISIONS)}")
        if self.backward not in BACKWARDS:
            raise ValueError(f"--backward {self.backward!r}: use one of {', '.join(BACKWARDS)}")
        if self.optimizer_kernel not in OPTIMIZER_KERNELS:
            raise ValueError(f"--optimizer-kernel {self.optimizer_kernel!r}: use one of "
                             f"{', '.join(OPTIMIZER_KERNELS)}")
        if self.curvature_every < 0 or not 1 <= self.curvature_hvps <= 5 or not 0 < self.curvature_budget <= 1:
            raise ValueError(f"curvature: every {self.curvature_every} must be >= 0, hvps {self.curvature_hvps} in "
                             f"1..5, budget {self.curvature_budget} in (0, 1]")


@dataclass
class Pending:
    """What a microbatch left on this stage between its forward and its backward."""

    tokens: torch.Tensor
    leaf: Optional[torch.Tensor]
    out: torch.Tensor
    step: int
    generation: int = 0  # the runtime's activation: a microbatch of a stage the node left is refused
    fwd_s: float = 0.0  # compute seconds of the forward (throughput counts forward + backward per microbatch)
    weights: Optional[dict] = None  # the stashed parameter snapshot the forward ran on
    coords: Optional[torch.Tensor] = None  # the received input, kept instead of the graph (``backward="recompute"``)
    version: Optional[list] = None  # ``sent_version`` of the weights the forward ran on (read on the compute thread)
    clock: int = 0  # the architecture warm-up's clock at the forward (its depth and write scales)
    # UPM (server/upm.py): the input frame epoch the forward ran in, the map taking our input gradient back to the
    # sender's frame (None: the same frame), and the boundary map the forward used (a recompute uses it again).
    frame_in: int = 0
    frame_back: Optional[torch.Tensor] = None
    frame_map: Optional[torch.Tensor] = None
    frame_out: Optional[int] = None  # the frame epoch of our output boundary at the forward (sent downstream)
    # The tail's parameter gradients of this microbatch (its backward runs in ``forward``), added to the accumulated
    # sums only by ``finish_tail``: a microbatch dropped at its point of no return must leave no gradient behind.
    tail_grads: Optional[list] = None


WARMUP_CLOCK = "warmup/clock"  # the architecture warm-up's clock in a stage's state (runs with a warm-up only)


def warmup_clock_of(step: int, by_name: dict) -> int:
    """The warm-up clock a state (``{name: tensor}``) was saved at: its own entry, or its step (a warm-up by steps,
    or a state saved before the clock existed)."""
    clock = by_name.get(WARMUP_CLOCK)
    if clock is None:
        return int(step)
    if clock.numel() != 1 or not 0 <= int(clock.reshape(-1)[0]) <= int(step):
        raise ValueError(f"{WARMUP_CLOCK} must be one integer between 0 and the step ({step})")
    return int(clock.reshape(-1)[0])


def next_token_targets(tokens: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
    """Next-token targets of a microbatch: its tokens shifted by one, then each sequence's following token."""
    return torch.cat([tokens[:, 1:], last[:, None]], dim=1)


class StageRuntime:
    """The parameters, optimizer and microbatch bookkeeping of one stage (compute thread only).

    :param counters: the node's counters, shared across the runtimes of its stage moves
    :param observers: where compute timings are published ("compute": kind, seconds, tokens)
    :param fingerprint_at: ``step -> fingerprint or None``: the replica sync's fingerprint of the parameters at that
      step, sent with every message (``sent_version``) so that SENTINEL compares replicas holding the same weights
    """

    def __init__(self, manifest: Manifest, stage_index: int, counters: Counters, observers: Observers,
                 checkpoint_dir: Optional[str] = None, checkpoint_every: int = 0,
                 options: RuntimeOptions = RuntimeOptions()):
        self.manifest = manifest
        self.stage_index = stage_index
        self.options = options
        self.device = resolve_device(options.device)
        check_precision(self.device, options.precision)
        self.stage = Stage(manifest, stage_index).to(self.device)
        self.stage.checkpoint_blocks = options.checkpoint_blocks
        self.is_head, self.is_tail = self.stage.spec.is_head, self.stage.spec.is_tail
        # What the optimizer steps: the stage's own parameters, or their host copies (offload). ``_master`` maps
        # each parameter to the tensor the optimizer holds state for.
        self._masters = _HostMasters(self.stage) if options.offload_optimizer else None
        self.fused_optimizer = options.fused_kernel(manifest.optimizer.name)
        self.optimizer = build_optimizer(self._masters or self.stage, manifest.optimizer, seed=manifest.seed,
                                         names=[n for n, _ in self.stage.named_parameters()],
                                         fused=self.fused_optimizer)
        self.counters = counters
        self.observers = observers
        upm = manifest.security.upm
        if upm is not None and options.offload_optimizer:
            raise ValueError("security.upm: rotations move the optimizer's moments on the stage's device; run this "
                             "peer without --offload-optimizer")
        # UPM: this stage's boundary frames and the rotations due (None: the run does not rotate)
        self.frames = (FrameLedger(self.stage, upm.v_mode, self._moments, upm.transforms) if upm is not None
                       else None)
        warm = manifest.training.warmup_depth
        # A curvature-driven warm-up needs every stage's measurements, at the manifest's cadence.
        every = warm.curvature_every if warm is not None and warm.mode == "curvature" else options.curvature_every
        self.curvature = (StageCurvature(self, every, options.curvature_hvps, options.curvature_budget)
                          if every else None)
        self.checkpoint_dir, self.checkpoint_every = checkpoint_dir, checkpoint_every
        self.step = 0
        # Architecture warm-up: the clock its depth and write scales follow. It is the step, but for steps a
        # curvature-driven warm-up held (``apply_step(hold_warmup=True)``).
        self.warmup_clock = 0
        self.version = 0  # bumped whenever the parameters change (optimizer step, state import, averaging)
        # State the averaging scheme keeps beside the optimizer (DiLoCo's outer parameters and momentum), named
        # SYNC_PREFIX + ...: it travels with the stage's state (downloads, checkpoints) so a joiner continues it.
        self.sync_state: dict[str, torch.Tensor] = {}
        self.generation = 0  # set by the node when it activates this runtime; pending microbatches must match
        self.active = True  # False once the node serves another runtime
        self.samples = 0  # samples whose gradients sit in .grad, waiting for the next step
        self.last_sample_time = time.monotonic()
        self.throughput = 0.0  # tokens/s of compute, EMA
        self.measured = 0  # microbatches measured since activation (the first is a cold start and not counted)
        self.loss_ema = float("nan")
        self.wire_dtype = WIRE_DTYPES[manifest.residual.wire_dtype]
        self.fingerprint_at: Callable[[int], Optional[float]] = lambda step: None
        self.output_filters: list[OutputFilter] = []
        self._stash_key: tuple = (-1, False)
        self._stash_weights: Optional[dict] = None
        # NAdam's look-ahead (``optimizer.lookahead``): forwards that run while this stage's step is pending (its
        # gradients taken, the round still averaging: ``batch.overlap_rounds``) have their gradients applied one step
        # late, so they run on the weights extrapolated one predicted update ahead (``DelayedNAdam``).
        self.lookahead = manifest.optimizer.lookahead  # the manifest allows it with nadam only
        self.step_pending = False  # between ``take_gradients`` and ``apply_step`` (or a round that failed)
        self._sample_at = self._sample_positions()
        # (step, values): taken together, so a record never pairs one step with another step's values
        self.parameter_sample: tuple[int, list[float]] = (self.step, self.sample_parameters())
        _RUNTIMES.add(self)

    def release_tensors(self) -> None:
        """Free the stage's parameters, gradients, optimizer state and weight stash; the runtime is unusable
        afterwards. Only for a process forked from the node (see ``_RUNTIMES``)."""
        self.active = False
        self.curvature = None  # its vector is the size of the stage
        if self.device.type != "cpu" and self._masters is None:
            return  # a forked child must not touch CUDA memory; the host holds nothing big here
        self.optimizer.state.clear()  # on the host: with a CPU device, or offloaded
        modules = [self._masters] if self.device.type != "cpu" else [self.stage, self._masters]
        if self.device.type == "cpu":
            self._stash_weights = None
        for module in modules:
            if module is not None:
                for p in module.parameters():
                    p.grad = None
                    p.data = torch.empty(0, dtype=p.dtype)

    # ------------------------------------------------------------------ activation (stage moves)
    def activate(self, generation: int) -> None:
        """Serve from this runtime under ``generation``: microbatches of earlier activations are refused, and
        gradients, samples and measurements of an earlier stint are dropped (they belong to a stage left)."""
        self.generation, self.active = generation, True
        self.version += 1
        self.step_pending = False
        for p in self.stage.parameters():
            p.grad = None
        self.samples = 0
        self.throughput = 0.0
        self.measured = 0
        self.loss_ema = float("nan")
        set_lr(self.optimizer, self.manifest.optimizer, self.step)

    def retire(self) -> None:
        """The node serves another runtime now: refuse this one's microbatches from here on."""
        self.active = False

    def check_generation(self, generation: int) -> None:
        if generation != self.generation or not self.active:
            raise RpcError("leaving", f"this peer moved to stage {self.stage_index}")

    def sent_version(self, step: int) -> list:
        """[step, fingerprint] of the weights a message computed at ``step`` came from (fingerprint None when the
        sync has none for that step, e.g. during a state download). Call on the compute thread."""
        return [int(step), self.fingerprint_at(step)]

    def filtered(self, direction: str, tensor: torch.Tensor) -> torch.Tensor:
        for fn in self.output_filters:
            tensor = fn(direction, tensor)
        return tensor

    # ------------------------------------------------------------------ forward / backward
    def forward(self, tensors: list[torch.Tensor], train: bool, generation: int,
                frame: Optional[int] = None) -> tuple[Pending, Optional[float]]:
        """The stage's forward for a microbatch (the tail also runs its backward here); returns what the backward
        needs and the loss (tail only). ``frame``: the UPM frame epoch the sender wrote the boundary in."""
        self.check_generation(generation)
        t0 = time.perf_counter()
        tokens, last = self._in(tensors[-2]).long(), self._in(tensors[-1]).long()
        coords = None if self.is_head else tensors[0]
        coords, back = self._into_frame(coords, frame)
        ahead = train and self._ahead()
        if ahead:
            self.counters.lookahead_forwards += 1
        stash = self._stashed() if train and not self.is_tail else None
        # recompute: the graph is not kept; the backward rebuilds it from the input on the same snapshot.
        keep_graph = train and (self.is_tail or self.options.backward == "stash")
        loss = None
        # The tail's backward runs right here: with the look-ahead its live parameters hold the extrapolated
        # weights for the forward and backward, and the master weights again before anything else runs.
        swapped = (self._swap_in({n: w.detach() for n, w in self._stashed().items()})
                   if ahead and self.is_tail else None)
        tail_grads = None
        try:
            with torch.set_grad_enabled(keep_graph):
                with self._autocast():
                    leaf, out = self.forward_from(coords, tokens, stash)
                    if self.is_tail:
                        loss_t = self.stage.loss(out, next_token_targets(tokens, last))
                if self.is_tail:
                    loss = float(loss_t.detach())
                    if train:
                        # Sum over sequences of per-sequence mean loss: gradients add up to samples x mean. (Outside
                        # autocast: the backward runs in the dtypes the forward chose.) Into buffers of this
                        # microbatch, not the parameters' .grad: the handler may still drop it (a hedge applied it
                        # elsewhere, its caller left) and only ``finish_tail`` counts it. Accumulating here once let
                        # a dropped hedge's gradient into the step uncounted (2026-12-05: 2 of 8 runs of a 3x2 swarm
                        # ended 0.1-0.4% apart, the tail's first gradient norm 1.6x too large).
                        tail_grads = self._tail_gradients(loss_t * tokens.shape[0], leaf)
                        if self.curvature is not None:
                            self.curvature.keep(coords, tokens, targets=next_token_targets(tokens, last))
        finally:
            if swapped is not None:
                self._swap_in(swapped)
        fwd_s = self._account(t0, tokens.numel(), "forward")
        if self.is_tail and train:
            self._measure(tokens.numel(), fwd_s)  # the tail's forward includes its backward
        kept = coords if train and not keep_graph and not self.is_tail else None
        return Pending(tokens, leaf, out, self.step, self.generation, fwd_s, weights=stash,
                       version=self.sent_version(self.step), coords=kept, clock=self.warmup_clock,
                       frame_in=self.frames.epoch_in if self.frames is not None else 0, frame_back=back,
                       frame_map=self.stage.boundary_map, frame_out=self.frame_out, tail_grads=tail_grads), loss

    def _tail_gradients(self, loss: torch.Tensor, leaf: Optional[torch.Tensor]) -> list:
        """(parameter, gradient) of every trained parameter the loss reaches; the input gradient goes to
        ``leaf.grad`` as a backward would put it (``_accepted`` sends it upstream)."""
        params = [p for p in self.stage.parameters() if p.requires_grad]
        inputs = ([leaf] if leaf is not None else []) + params
        grads = torch.autograd.grad(loss, inputs, allow_unused=True)
        if leaf is not None:
            leaf.grad, grads = grads[0], grads[1:]
        return [(p, g) for p, g in zip(params, grads) if g is not None]

    def _into_frame(self, coords: Optional[torch.Tensor], frame: Optional[int]):
        """(coords in our input frame, the map back to the sender's frame or None). UPM runs only."""
        if self.frames is None or coords is None:
            return coords, None
        c = self.frames.conversion(frame)
        if c is None:
            return coords, None
        return (coords.double() @ c).float(), c.T

    @property
    def frame_out(self) -> Optional[int]:
        """The frame epoch of our output boundary (what our boundaries are written in); None without UPM."""
        return self.frames.epoch_out if self.frames is not None and not self.is_tail else None

    def _moments(self, p: torch.nn.Parameter) -> Optional[dict]:
        return self.optimizer.state.get(self._master(p))

    def _in(self, tensor: torch.Tensor) -> torch.Tensor:
        """A received tensor on this stage's device."""
        return tensor.to(self.device, non_blocking=True) if tensor.device != self.device else tensor

    def _autocast(self, precision: Optional[str] = None):
        """Autocast at this peer's precision, or at ``precision`` (an audit recomputes at its sender's)."""
        return autocast(self.device, precision or self.options.precision)

    def memory(self) -> dict:
        """How this peer computes and the memory it used: device peak (CUDA), host resident set now and at its peak
        (``agora.devices.memory_report``). For summaries, records and /metrics."""
        o = self.options
        return {**memory_report(self.device), "precision": o.precision, "backward": o.backward,
                "offload_optimizer": o.offload_optimizer, "checkpoint_blocks": o.checkpoint_blocks,
                "optimizer_kernel": "fused" if self.fused_optimizer else "single"}

    def boundary(self, pending: Pending) -> Boundary:
        """What this (non-tail) stage sends downstream for ``pending``: the compressed output, through the output
        filters."""
        boundary = compress(pending.out.detach().float(), pending.tokens, self.stage.basis,
                            self.manifest.residual.wire_dtype)
        boundary.coords, boundary.tokens = boundary.coords.cpu(), boundary.tokens.cpu()  # the wire reads host memory
        if self.output_filters:
            boundary.coords = self.filtered("fwd", boundary.coords)
        return boundary

    def _stashed(self) -> dict:
        """The weight snapshot of the current parameter version (made once per version: one copy per step), or,
        with the look-ahead while a step is pending, of the weights one predicted update ahead."""
        key = (self.version, self._ahead())
        if self._stash_key != key or self._stash_weights is None:
            values = self._lookahead_values() if key[1] else {n: p.detach() for n, p in self.stage.named_parameters()}
            self._stash_weights = {n: v.clone().requires_grad_(True) for n, v in values.items()}
            self._stash_key = key
        return self._stash_weights

    def _ahead(self) -> bool:
        """Whether a training forward now runs on look-ahead weights: the run uses them, this stage's step is
        pending, and there is momentum to extrapolate along (not before the first step)."""
        return self.lookahead and self.step_pending and self.step > 0

    @torch.no_grad()
    def _lookahead_values(self) -> dict:
        """Every parameter of the stage, the trained ones moved by NAdam's predicted next update (the update the
        pending step would make if its gradient equalled the momentum; ``DelayedNAdam.lookahead_weights``), at the
        learning rate of the pending step. Frozen parameters (bypassed blocks) and a first step's (no momentum yet)
        stay as they are."""
        set_lr(self.optimizer, self.manifest.optimizer, self.step)
        held = {id(p) for group in self.optimizer.param_groups for p in group["params"]}
        named = [(n, p) for n, p in self.stage.named_parameters()]
        trained = [(n, p) for n, p in named if id(self._master(p)) in held]
        ahead = self.optimizer.lookahead_weights(delay=1, params=[self._master(p) for _, p in trained])
        values = {n: p.detach() for n, p in named}
        for (name, p), w in zip(trained, ahead):
            values[name] = w.to(p.device, p.dtype)
        return values

    def _swap_in(self, values: dict) -> dict:
        """Put ``values`` (name -> tensor) into the stage's parameters; returns what they held (to swap back)."""
        held = {}
        for name, p in self.stage.named_parameters():
            held[name], p.data = p.data, values[name]
        return held

    def forward_from(self, coords: Optional[torch.Tensor], tokens: torch.Tensor, weights: Optional[dict] = None):
        """(leaf, output): ``leaf`` is the received coordinates as a grad-tracking leaf (None on the head).
        With ``weights`` the stage runs on that snapshot instead of its live parameters."""
        run = self.stage if weights is None else functools.partial(torch.func.functional_call, self.stage, weights)
        if self.is_head:
            return None, run(tokens) if weights is None else run((tokens,))
        leaf = self._in(coords).detach().float().requires_grad_(torch.is_grad_enabled())
        x = decompress(Boundary(leaf, tokens, self.manifest.residual.mode), self.stage.basis, self.stage.frozen_embed)
        return leaf, run(x) if weights is None else run((x,))

    def backward(self, pending: Pending, grad_out: torch.Tensor) -> Optional[torch.Tensor]:
        """Backward of a non-tail stage from the gradient of its output; returns the gradient to send upstream."""
        self.check_generation(pending.generation)
        t0 = time.perf_counter()
        # Every training forward of a stage that sends a boundary ran on a weight snapshot (``forward``): the
        # backward differentiates exactly that function, whatever steps were taken since. No recompute.
        if pending.coords is not None or (self.is_head and self.options.backward == "recompute"):
            # recompute: the forward again, on the snapshot it first ran on, now keeping its graph. Same function,
            # same input, same weights: the same output and gradients as a stashed graph.
            # the forward ran at its step's depth and write scales (architecture warm-up)
            now = self.stage.active_depth, self.stage.write_scales, self.stage.boundary_map
            self.stage.set_step(pending.clock)
            self.stage.boundary_map = pending.frame_map  # and in the UPM frame it ran in
            try:
                with torch.enable_grad(), self._autocast():
                    pending.leaf, pending.out = self.forward_from(pending.coords, pending.tokens, pending.weights)
            finally:
                self.stage.active_depth, self.stage.write_scales, self.stage.boundary_map = now
        next_basis = self.stage.basis if self.manifest.residual.mode == "subspace" else None
        sent = pending.out @ next_basis if next_basis is not None else pending.out
        sent.backward(self._in(grad_out).to(sent.dtype))
        if self.curvature is not None:
            self.curvature.keep(pending.leaf, pending.tokens, grad_out=grad_out)
        if pending.weights is not None:
            # The gradient landed on the snapshot: move it to the live parameters, where steps are taken (in the
            # frame they are in now: a UPM rotation of our input may have come since the forward).
            if self.frames is not None and pending.frame_in != self.frames.epoch_in:
                moved = self.frames.stale_gradients({n: w.grad for n, w in pending.weights.items()},
                                                    pending.frame_in, pending.weights)
                for name, w in pending.weights.items():
                    w.grad = moved[name]
            for name, p in self.stage.named_parameters():
                g = pending.weights[name].grad
                if g is not None:
                    p.grad = g if p.grad is None else p.grad.add_(g)
                    pending.weights[name].grad = None
        self._count_staleness(pending)
        self._measure(pending.tokens.numel(), pending.fwd_s + self._account(t0, pending.tokens.numel(), "backward"))
        return self._accepted(pending)

    def finish_tail(self, pending: Pending) -> Optional[torch.Tensor]:
        """The tail's backward already ran in ``forward``: add its gradients to the accumulated sums, count the
        samples, return the gradient for upstream."""
        self.check_generation(pending.generation)
        if pending.tail_grads:
            if self.frames is not None and pending.frame_in != self.frames.epoch_in:
                # Our input frame rotated since the forward (a step on a partial batch came between): its gradients
                # are of weights in the old frame, which only a snapshot could convert. The caller retries it.
                raise RpcError("frame_unknown", f"the tail's input frame rotated from {pending.frame_in} to "
                                                f"{self.frames.epoch_in} while this microbatch waited; run it again")
            for p, g in pending.tail_grads:
                p.grad = g if p.grad is None else p.grad.add_(g)
            pending.tail_grads = None
            self._count_staleness(pending)  # a step may have come since the forward (a partial batch's)
        return self._accepted(pending)

    def _count_staleness(self, pending: Pending) -> None:
        """Steps taken between a microbatch's forward and the moment its gradient joins the accumulated sums."""
        stale = self.step - pending.step
        self.counters.staleness_sum += stale
        self.counters.staleness_max = max(self.counters.staleness_max, stale)

    def _accepted(self, pending: Pending) -> Optional[torch.Tensor]:
        self.samples += pending.tokens.shape[0]
        self.last_sample_time = time.monotonic()
        if pending.leaf is None:
            return None
        grad = pending.leaf.grad
        if pending.frame_back is not None:  # back into the frame its sender wrote the boundary in (UPM)
            grad = grad.double() @ pending.frame_back.to(grad.device)
        return self.filtered("bwd", grad.to(self.wire_dtype).cpu())

    def record_loss(self, loss: float) -> None:
        self.loss_ema = loss if math.isnan(self.loss_ema) else 0.9 * self.loss_ema + 0.1 * loss

    # ------------------------------------------------------------------ audits (SENTINEL)
    def recompute_head(self, tensors: list[torch.Tensor], generation: int,
                       precision: Optional[str] = None) -> tuple[torch.Tensor, list]:
        """An audit request to a head: the boundary coordinates it sends for these tokens, without training (the
        same computation as a training forward, whose stashed weights equal the live ones of that version; not so
        with ``optimizer.lookahead``, which is why a node refuses ``--sentinel`` with it). ``precision``: the
        audited sender's (None: ours): a bf16 message differs from an fp32 recomputation by far more than
        rounding."""
        self.check_generation(generation)
        check_precision(self.device, precision or self.options.precision)
        tokens = self._in(tensors[-2]).long()
        with torch.no_grad(), self._autocast(precision):
            out = self.stage(tokens)
        coords = compress(out.float(), tokens, self.stage.basis, self.manifest.residual.wire_dtype).coords
        return coords.cpu(), self.sent_version(self.step)

    def recompute_tail(self, tensors: list[torch.Tensor], generation: int,
                       frame: Optional[int] = None, precision: Optional[str] = None) -> tuple[torch.Tensor, list]:
        """An audit request: the gradient this tail returns for ``tensors``, without training on it (no parameter
        gradients, samples or throughput counted), and the version of the weights used. The same computation as
        ``forward`` + ``finish_tail``, so that an honest tail at the same version and ``precision`` (the audited
        sender's; None: ours) reproduces it bit for bit on the same kind of device."""
        self.check_generation(generation)
        check_precision(self.device, precision or self.options.precision)
        tokens, last = self._in(tensors[-2]).long(), self._in(tensors[-1]).long()
        coords, back = self._into_frame(tensors[0], frame)
        with torch.enable_grad():
            with self._autocast(precision):
                leaf, out = self.forward_from(coords, tokens)
                loss = self.stage.loss(out, next_token_targets(tokens, last)) * tokens.shape[0]
            (grad,) = torch.autograd.grad(loss, leaf)
        if back is not None:
            grad = grad.double() @ back.to(grad.device)
        return grad.to(self.wire_dtype).cpu(), self.sent_version(self.step)

    # ------------------------------------------------------------------ generation sessions (server/inference.py)
    def decode(self, cache: KVCache, tensors: list[torch.Tensor], position: int, generation: int,
               frame: Optional[int] = None) -> torch.Tensor:
        """One chunk of a generation session: the positions from ``position`` on, after those in ``cache``.

        ``tensors`` is [token ids int32 [1, t]] on the head, else [boundary coords, token ids]. Returns what goes
        back to the client: the boundary coordinates for the next stage (wire dtype, through the output filters
        like every message this stage sends), or on the tail the logits of the last position, [1, V] fp32. Runs on
        the live weights without gradients; nothing is counted toward training.
        """
        self.check_generation(generation)
        # Checked here, on the compute thread, and not only on the loop: two concurrent requests of one session
        # must not both write at the same positions.
        if cache.length != position:
            raise RpcError("position_mismatch", f"the session holds {cache.length} positions; this chunk starts at "
                                                f"{position}")
        tokens = self._in(tensors[-1]).long()
        with torch.no_grad():
            if self.is_head:
                out = self.stage(tokens, cache)
            else:
                coords, _ = self._into_frame(tensors[0], frame)  # the KV cache is the same in every frame
                boundary = Boundary(self._in(coords).float(), tokens, self.manifest.residual.mode)
                out = self.stage(decompress(boundary, self.stage.basis, self.stage.frozen_embed), cache)
            if self.is_tail:
                return self.stage.logits(out[:, -1:])[:, -1].float().cpu()
            coords = compress(out, tokens, self.stage.basis, self.manifest.residual.wire_dtype).coords.cpu()
        return self.filtered("fwd", coords) if self.output_filters else coords

    # ------------------------------------------------------------------ measurements
    def _account(self, t0: float, n_tokens: int, kind: str) -> float:
        dt = time.perf_counter() - t0
        self.counters.busy_s += dt
        self.observers.emit("compute", kind, dt, n_tokens)
        return dt

    def _measure(self, n_tokens: int, seconds: float) -> None:
        """Throughput = tokens per compute second of a whole training microbatch (forward + backward), as an EMA.

        Per microbatch, not per call: averaging a fast forward's rate with a slow backward's would overstate every
        stage but the tail (whose forward includes the backward), and routing and rebalancing compare stages.

        The first microbatch is not counted: it pays for cold caches and allocations, and a peer published as slow
        after it would not be picked again by a client that always takes the earliest finish (its measurement
        would never be corrected). Unmeasured, it stays scored at the best measured rate, so it gets a second job.
        """
        self.measured += 1
        if self.measured == 1:
            return
        if seconds > 0:
            rate = n_tokens / seconds
            self.throughput = rate if self.throughput == 0 else 0.8 * self.throughput + 0.2 * rate

    # ------------------------------------------------------------------ steps and state
    def take_gradients(self, dtype: torch.dtype = torch.float64) -> tuple[int, list[torch.Tensor]]:
        """Move the accumulated gradient sums out (as means over their samples, on the host, in ``dtype``) and
        restart accumulation. A host gradient already in ``dtype`` is divided in place, not copied: for a big stage
        every copy here is another stage-sized allocation at the moment all buffers are live."""
        n = self.samples
        grads = []
        for p in self.stage.parameters():
            g = p.grad if p.grad is not None else torch.zeros_like(p)
            g = g.to("cpu", dtype)  # averaging buffers live on the host; no copy when already there in dtype
            grads.append(g.div_(max(n, 1)))
            p.grad = None
        self.samples = 0
        self.step_pending = True  # until ``apply_step``: forwards meanwhile are a step late (look-ahead)
        return n, grads

    def apply_step(self, grads: Optional[list[torch.Tensor]], clip_scale: Optional[float] = None,
                   hold_warmup: bool = False) -> None:
        """One optimizer step with ``grads`` (averaged, mean over samples); gradients accumulated meanwhile survive.
        ``clip_scale``: the global-norm clipping factor of this step (``averaging.clip``); None: clip by this
        stage's own norm. ``hold_warmup``: the warm-up clock does not advance with this step (a curvature-driven
        warm-up held by the swarm's curvature, ``server.warmup``)."""
        params = [p for p in self.stage.parameters()]
        kept = [p.grad for p in params]
        stepped = [self._master(p) for p in params]  # what the optimizer steps (host copies when offloading)
        frozen = {id(p) for p in self.stage.inactive_parameters()}  # bypassed blocks (architecture warm-up)
        for p, q, g in zip(params, stepped, grads):
            q.grad = None if id(p) in frozen else g.to(q.device, q.dtype)
        clip = self.manifest.optimizer.grad_clip
        tied = tied_parameter(self.stage)
        tied = self._master(tied) if tied is not None else None
        if clip_scale is not None:  # every stage of the step scales by the same global factor
            if clip_scale < 1.0:
                for q in stepped:
                    if q.grad is not None:
                        q.grad.mul_(clip_scale)
        else:
            # A tied embedding's copy is clipped by its own norm: the other end, holding another stage, must scale
            # the same summed gradient by the same factor for the two copies to stay equal.
            torch.nn.utils.clip_grad_norm_([q for q in stepped if q is not tied and q.grad is not None], clip)
            if tied is not None:
                torch.nn.utils.clip_grad_norm_([tied], clip)
        set_lr(self.optimizer, self.manifest.optimizer, self.step)
        self.optimizer.step()
        if self._masters is not None:
            with torch.no_grad():
                for p, q in zip(params, stepped):
                    p.copy_(q, non_blocking=True)
                    q.grad = None
        for p, g in zip(params, kept):
            p.grad = g
        self.version += 1
        self.step += 1
        self.step_pending = False
        if self.is_tail:
            self._stash_weights = None  # the tail's only snapshot is a look-ahead: not kept beyond its window
        if not hold_warmup:
            self.warmup_clock += 1
        self._grow()
        self._rotate_due()
        self.parameter_sample = (self.step, self.sample_parameters())
        if self.curvature is not None:
            self.curvature.after_step(self.step, self.counters.busy_s)
        if self.checkpoint_dir and self.checkpoint_every and self.step % self.checkpoint_every == 0:
            self.save_checkpoint()

    def _rotate_due(self) -> None:
        """UPM: apply the rotations due after this step (parameters, moments, and the gradients accumulated toward
        the next step all move to the new frame; server/upm.py)."""
        if self.frames is None or not self.frames.due:
            return
        applied = self.frames.applied
        named = dict(self.stage.named_parameters())
        moved = self.frames.apply_due(self.step, {n: p.grad for n, p in named.items()})
        if self.frames.applied != applied:
            for name, p in named.items():
                p.grad = moved[name]
            self.version += 1  # the next forward takes a snapshot of the new frame
            self.observers.emit("rotation", self.stage_index, self.step, self.frames.summary())

    def _sample_positions(self) -> list[tuple[int, int]]:
        """(parameter index, flat offset) of ``PARAMETER_SAMPLE`` positions drawn uniformly over the stage's
        elements, seeded by the run and the stage: every replica samples the same positions."""
        sizes = [p.numel() for p in self.stage.parameters()]
        total = sum(sizes)
        if total == 0:
            return []
        gen = torch.Generator().manual_seed((self.manifest.seed * 7919 + self.stage_index + 1) % (2 ** 63))
        flat = torch.randint(0, total, (min(PARAMETER_SAMPLE, total),), generator=gen).sort().values.tolist()
        starts, acc = [], 0
        for n in sizes:
            starts.append(acc)
            acc += n
        out, i = [], 0
        for f in flat:
            while f >= starts[i] + sizes[i]:
                i += 1
            out.append((i, f - starts[i]))
        return out

    def sample_parameters(self) -> list[float]:
        """The parameters' values at the seeded positions (compute thread: after every change of the weights)."""
        params = self.trained_parameters()
        with torch.no_grad():
            return [float(params[i].reshape(-1)[j]) for i, j in self._sample_at]

    def _grow(self) -> None:
        """Architecture warm-up: blocks due at this step join, with zeroed output projections (``Stage.grow_to``)
        and no optimizer state (they never had a gradient: their moments start at zero)."""
        joined = self.stage.grow_for_step(self.warmup_clock)
        if joined:
            for name in joined:
                for p in self.stage.layers[name].parameters():
                    q = self._master(p)
                    if q is not p:
                        with torch.no_grad():
                            q.copy_(p)
                    self.optimizer.state.pop(q, None)
            self.observers.emit("blocks_joined", self.stage_index, self.step, joined)

    def export_state(self) -> tuple[int, list[str], list[torch.Tensor]]:
        """Parameters and optimizer moments, as a flat named list (also the checkpoint format)."""
        names, tensors = [], []
        for name, p in self.stage.named_parameters():
            names.append(f"param/{name}")
            tensors.append(p.detach().cpu().clone())
            st = self.optimizer.state.get(self._master(p), {})
            for key in OPTIMIZER_STATE_KEYS:
                if key in st:
                    names.append(f"opt/{key}/{name}")
                    value = st[key]
                    tensors.append(torch.as_tensor(value).detach().cpu().clone().reshape(-1) if key == "step"
                                   else value.detach().cpu().clone())
        if self.stage.boundary_map is not None:  # UPM: the map into the next stage's frame (agora.frames)
            names.append(FRAME_MAP)
            tensors.append(self.stage.boundary_map.detach().cpu().clone())
        if self.frames is not None:
            names.append(FRAME_EPOCHS)
            tensors.append(self.frames.export())
        for name, value in self.sync_state.items():
            names.append(name)
            tensors.append(value.detach().cpu().clone())
        if self.manifest.training.warmup_depth is not None:
            names.append(WARMUP_CLOCK)
            tensors.append(torch.tensor([self.warmup_clock], dtype=torch.int64))
        return self.step, names, tensors

    def import_state(self, step: int, names: list[str], tensors: list[torch.Tensor], keep_grads: bool = False) -> None:
        """Replace parameters, optimizer moments and step. ``keep_grads`` keeps the gradients accumulated toward the
        next step (a same-step repair); otherwise they are dropped with their samples."""
        by_name = dict(zip(names, tensors))
        params = dict(self.stage.named_parameters())
        missing = [n for n in params if f"param/{n}" not in by_name]
        if missing:
            raise ValueError(f"state is missing parameters {missing[:3]}")
        frame = check_frame_map(self.stage, by_name.get(FRAME_MAP))
        with torch.no_grad():
            for name, p in params.items():
                src = by_name[f"param/{name}"]
                if src.shape != p.shape:
                    raise ValueError(f"{name}: state shape {tuple(src.shape)} != {tuple(p.shape)}")
                p.copy_(src)
                q = self._master(p)
                if q is not p:
                    q.copy_(src)
                st = {key: by_name[f"opt/{key}/{name}"] for key in OPTIMIZER_STATE_KEYS if f"opt/{key}/{name}" in by_name}
                if "step" in st and len(st) > 1:
                    for key, value in st.items():
                        if key != "step" and value.shape != q.shape:
                            raise ValueError(f"{name}: optimizer {key} of shape {tuple(value.shape)} != "
                                             f"{tuple(q.shape)}")
                    # The fused kernel keeps its step counts beside the parameters; the loop keeps them on the CPU.
                    step_device = q.device if self.fused_optimizer else "cpu"
                    self.optimizer.state[q] = {
                        key: (value.reshape(()).to(step_device, torch.float32, copy=True) if key == "step"
                              else value.to(q.device, copy=True))
                        for key, value in st.items()}
                else:
                    self.optimizer.state.pop(q, None)
                if not keep_grads:
                    p.grad = None
            self.stage.boundary_map = frame.to(self.stage.rope_cos.device) if frame is not None else None
            if self.frames is not None:
                self.frames.restore(by_name.get(FRAME_EPOCHS))
        # The scheme checks what it finds here (and starts afresh without it: a checkpoint of another scheme).
        self.sync_state = {n: t.clone() for n, t in by_name.items() if n.startswith(SYNC_PREFIX)}
        self.version += 1
        self.step = int(step)
        self.warmup_clock = warmup_clock_of(self.step, by_name)
        # The imported weights already hold every zeroed block that joined before it: only the depth and the write
        # scales follow.
        self.stage.set_step(self.warmup_clock)
        self.parameter_sample = (self.step, self.sample_parameters())
        if not keep_grads:
            self.samples = 0
            self.step_pending = False
        set_lr(self.optimizer, self.manifest.optimizer, self.step)

    def _master(self, p: torch.nn.Parameter) -> torch.nn.Parameter:
        return self._masters.of(p) if self._masters is not None else p

    def trained_parameters(self) -> list[torch.nn.Parameter]:
        """What the optimizer steps, in the stage's parameter order: the parameters themselves, or their fp32 host
        copies when the optimizer is offloaded (the bf16 device copies are then only a rounding of these)."""
        return [self._master(p) for p in self.stage.parameters()]

    def load_parameters(self, values: list[torch.Tensor]) -> None:
        """Compute thread: replace every parameter's value (and its host copy) in the stage's parameter order; the
        optimizer's moments stay. The next forward takes a fresh weight snapshot (``version``)."""
        params = list(self.stage.parameters())
        if len(values) != len(params):
            raise ValueError(f"{len(values)} values for {len(params)} parameters")
        with torch.no_grad():
            for p, v in zip(params, values):
                if v.shape != p.shape:
                    raise ValueError(f"parameter value of shape {tuple(v.shape)} for {tuple(p.shape)}")
                q = self._master(p)
                q.copy_(v)
                if q is not p:
                    p.copy_(q, non_blocking=True)
        self.version += 1
        self.parameter_sample = (self.step, self.sample_parameters())

    def save_checkpoint(self) -> Optional[Path]:
        step, names, tensors = self.export_state()
        return save_stage_checkpoint(self.checkpoint_dir, self.manifest, self.stage_index, step, names, tensors)


class _HostMasters(torch.nn.Module):
    """fp32 host copies of a stage's parameters, for an optimizer that lives in host RAM (``offload_optimizer``).
    A module of its own so that ``build_optimizer`` groups them (decay on matrices) as it groups the stage's."""

    def __init__(self, stage: torch.nn.Module):
        super().__init__()
        self._by_id: dict[int, torch.nn.Parameter] = {}
        for i, (name, p) in enumerate(stage.named_parameters()):
            q = torch.nn.Parameter(p.detach().to("cpu", torch.float32, copy=True))
            self.register_parameter(f"p{i}", q)  # parameter names may not contain dots
            self._by_id[id(p)] = q

    def of(self, p: torch.nn.Parameter) -> torch.nn.Parameter:
        return self._by_id[id(p)]

