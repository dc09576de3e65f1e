"""Memory planner: what one stage needs on a GPU (and on its host) to train, for every combination of node options.

A stage's memory is counted from shapes alone (nothing is allocated, so it works for 8B stages on a laptop), part by
part: weights, gradients, optimizer moments, weight snapshots, the saved activations of the microbatches in flight,
the tail's logits, the subspace tables, and what replica averaging keeps on the host. ``choose`` picks the cheapest
option set that fits a GPU: bf16 before fp32, no offload, stash, no checkpointing. The formulas and what they
assume are in ``docs/PLAN.md``; ``tests/test_plan.py`` checks them against autograd's saved tensors, peaks measured
on CPU (through ``StageRuntime``) and the peaks recorded on an H200.

The options are the node's ``RuntimeOptions``: ``--precision fp32|bf16`` (bf16 = autocast over fp32 weights),
``--backward stash|recompute``, ``--offload-optimizer`` and ``--checkpoint-blocks`` (per-block activation
checkpointing).
"""

from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass, field, replace
from typing import Literal, Optional, Sequence

from agora.config import Manifest, ModelShape

GIB = 2**30
Precision = Literal["fp32", "bf16"]
Backward = Literal["stash", "recompute"]
Attention = Literal["sdpa", "math"]
PRECISIONS: tuple[Precision, ...] = ("bf16", "fp32")
BACKWARDS: tuple[Backward, ...] = ("stash", "recompute")
DTYPE_BYTES = {"fp32": 4, "bf16": 2}

# Relative compute time per microbatch, only used to order option sets (see ``Options.cost``). A forward is about a
# third of forward + backward, so recomputing the stage (``recompute``) or every block (checkpointing) adds ~1/3.
# fp32 matmuls run without bf16 tensor cores: several times slower. Offloading moves the optimizer step to the CPU
# and its tensors over PCIe every step: the slowest, so the last resort.
FP32_COST = 4.0
RECOMPUTE_COST = 1 / 3
CHECKPOINT_COST = 1 / 3
OFFLOAD_COST = 1.5


@dataclass(frozen=True)
class Options:
    """One set of node options (what the planner searches over)."""

    precision: Precision = "fp32"
    backward: Backward = "stash"
    offload_optimizer: bool = False
    checkpointing: bool = False  # per-block activation checkpointing inside the stage

    @property
    def cost(self) -> float:
        base = FP32_COST if self.precision == "fp32" else 1.0
        extra = (RECOMPUTE_COST if self.backward == "recompute" else 0.0) + (CHECKPOINT_COST if self.checkpointing
                                                                            else 0.0)
        return base * (1.0 + extra) * (OFFLOAD_COST if self.offload_optimizer else 1.0)

    @property
    def rank(self) -> tuple:
        """Order of preference: cost, then (at equal cost) no offload, then stash, then no checkpointing."""
        return (round(self.cost, 6), self.offload_optimizer, self.backward != "stash", self.checkpointing,
                self.precision != "bf16")

    def describe(self) -> str:
        words = [self.precision, self.backward]
        if self.offload_optimizer:
            words.append("offload optimizer")
        if self.checkpointing:
            words.append("block checkpointing")
        return ", ".join(words)

    def node_flags(self) -> str:
        """The ``agora node`` options that select this set."""
        flags = f"--precision {self.precision} --backward {self.backward}"
        if self.offload_optimizer:
            flags += " --offload-optimizer"
        if self.checkpointing:
            flags += " --checkpoint-blocks"
        return flags


def all_options(precision: Optional[Precision] = None, checkpointing: Optional[bool] = None) -> list[Options]:
    """Every option set, cheapest first; ``precision`` / ``checkpointing`` (when not None) keep only those sets."""
    sets = [Options(p, b, o, c) for p, b, o, c in itertools.product(PRECISIONS, BACKWARDS, (False, True),
                                                                    (False, True))
            if (precision is None or p == precision) and (checkpointing is None or c == checkpointing)]
    return sorted(sets, key=lambda o: o.rank)


@dataclass(frozen=True)
class Search:
    """Which option sets the search may pick from: one precision only, with or without block checkpointing (None:
    both)."""

    precision: Optional[Precision] = None
    checkpointing: Optional[bool] = None

    def options(self) -> list[Options]:
        return all_options(self.precision, self.checkpointing)


@dataclass(frozen=True)
class Assumptions:
    """What the formulas cannot know from the manifest; ``docs/PLAN.md`` explains each.

    :param attention: ``sdpa``: a fused attention kernel (flash / memory-efficient on CUDA, and on CPU the flash
      kernel recent torch uses for causal attention without a mask: checked with 2.13) saves O(T) per head: q, k, v,
      output and the log-sum-exp. ``math``: the unfused path (an explicit mask, kernels that do not support the
      dtype or GPU) also saves the T x T probabilities of every head.
    :param versions: weight snapshots alive at once on a stage that stashes (None: min(in flight, 2): around an
      optimizer step, microbatches of the old version are still in flight when the new version's first forward
      makes its snapshot).
    :param reserve_gib: GPU memory not available to tensors: the CUDA context, cuBLAS workspaces and the caching
      allocator's fragmentation.
    """

    attention: Attention = "sdpa"
    versions: Optional[int] = None
    reserve_gib: float = 1.0


@dataclass(frozen=True)
class StageShape:
    """The facts about one stage the formulas use (a stage of a manifest, or a hypothetical one for a new split)."""

    index: int
    is_head: bool
    is_tail: bool
    layers: int
    parameters: int  # trainable, as ``model.count_parameters`` counts them
    matmul_parameters: int  # the ones autocast casts to bf16 for a matmul (not norms, not an embedding lookup)
    block_matmul: int  # of those, one block's (the rest is the LM head's)
    embedding: int  # the head's token embedding (trainable part)
    lm_head: int

    @property
    def kind(self) -> str:
        return "head+tail" if self.is_head and self.is_tail else "head" if self.is_head else (
            "tail" if self.is_tail else "body")


def stage_shape(manifest: Manifest, index: int, layers: Optional[int] = None) -> StageShape:
    """Parameter counts of stage ``index`` (with ``layers`` blocks instead of the manifest's, for split search)."""
    shape, res = manifest.model, manifest.residual
    n = manifest.stages[index] if layers is None else layers
    is_head, is_tail = index == 0, index == manifest.n_stages - 1
    subspace = res.mode == "subspace"
    d, hd, f, v = shape.d_model, shape.head_dim, shape.ffn_dim, shape.vocab_size
    width = res.k if subspace and not is_tail else d  # the tail's blocks write densely (model.Stage)
    block_matmul = d * hd * (shape.n_heads + 2 * shape.n_kv_heads) + shape.n_heads * hd * width + 2 * d * f + f * width
    embedding = v * (res.k if subspace else d) if is_head else 0
    tied_one_matrix = shape.tie_embeddings and is_head and is_tail
    lm_head = v * d if is_tail and not tied_one_matrix else 0
    norms = n * 2 * d + (d if is_tail else 0)
    matmul = n * block_matmul + lm_head + (embedding if tied_one_matrix else 0)  # a tied LM head multiplies too
    return StageShape(index, is_head, is_tail, n, n * block_matmul + norms + embedding + lm_head, matmul, block_matmul,
                      embedding, lm_head)


def block_bytes_per_token(shape: ModelShape, precision: Precision, write_width: Optional[int] = None,
                          attention: Attention = "sdpa") -> int:
    """Bytes one block's autograd graph saves per token (``model.Block`` under autocast or in fp32).

    Counted tensor by tensor from what autograd saves (``tests/test_plan.py`` checks the count with saved-tensor
    hooks): the residual stream stays fp32 (block input, mid-block stream, both RMSNorm outputs: 4 x 4d); the
    matmul inputs are the norm outputs themselves in fp32 (2 x 4d), or one bf16 cast per projection (q, k, v, gate,
    up: 5 x 2d) under autocast, which casts non-leaf tensors anew for every op; attention keeps q, k and v after the
    grouped-query repeat (each n_heads x head_dim = d wide) and its output (4 x e d); SwiGLU keeps the gate and up
    outputs, the SiLU output and their product (4 x e f); a subspace write (``write_width`` k) keeps the fp32 copy
    its gain-free RMSNorm makes (4k per branch). Small per-token terms: every RMSNorm's 1/rms and the attention's
    log-sum-exp (fp32 per head).
    """
    e = DTYPE_BYTES[precision]
    d, f = shape.d_model, shape.ffn_dim
    stream = 4 * 4 * d
    matmul_inputs = 2 * 4 * d if precision == "fp32" else 5 * 2 * d
    attn = 4 * e * d + 4 * shape.n_heads
    mlp = 4 * e * f
    norms = 2 * 4
    writes = 0 if write_width is None else 2 * (4 * write_width + 4)
    total = stream + matmul_inputs + attn + mlp + norms + writes
    if attention == "math":
        # The unfused path keeps the softmax probabilities (n_heads x T per token) and a contiguous copy of the
        # output for o_proj (the fused kernels return it in the layout o_proj reads: a view).
        total += e * shape.n_heads * shape.seq_len + e * d
    return total


def backward_workspace_per_token(shape: ModelShape, precision: Precision) -> int:
    """Transient bytes per token while one block is differentiated, beyond its saved activations: the gradients
    of two f-wide SwiGLU intermediates at once, and about 1.5 fp32 d-wide residual gradients. Fitted to peaks
    measured on CPU at three shapes (f/d from 0.5 to 8); see docs/PLAN.md."""
    return 2 * DTYPE_BYTES[precision] * shape.ffn_dim + 6 * shape.d_model


@dataclass(frozen=True)
class Part:
    """One line of a plan. ``phase``: ``always`` (held for the whole run), ``microbatch`` (while one microbatch
    computes) or ``step`` (while the optimizer steps); a total adds ``always`` and the larger of the other two."""

    name: str
    device: int
    host: int
    phase: Literal["always", "microbatch", "step"]
    note: str


@dataclass
class StagePlan:
    stage: int
    kind: str
    layers: int
    parameters: int
    microbatch: int
    in_flight: int
    options: Options
    parts: list[Part]
    held_per_microbatch: int  # what one microbatch in flight keeps between its forward and its backward

    def phase_bytes(self, where: str = "device") -> dict[str, int]:
        """``where`` ("device" or "host") bytes at the peak of a microbatch and of an optimizer step."""
        def of(phase: str) -> int:
            return sum(getattr(p, where) for p in self.parts if p.phase == phase)

        return {"microbatch": of("always") + of("microbatch"), "step": of("always") + of("step")}

    @property
    def device_bytes(self) -> int:
        return max(self.phase_bytes("device").values())

    @property
    def host_bytes(self) -> int:
        return max(self.phase_bytes("host").values())

    def to_json(self) -> dict:
        return {"stage": self.stage, "kind": self.kind, "layers": self.layers, "parameters": self.parameters,
                "microbatch": self.microbatch, "in_flight": self.in_flight, "options": asdict(self.options),
                "held_per_microbatch": self.held_per_microbatch,
                "device_bytes": self.device_bytes, "host_bytes": self.host_bytes,
                "device_by_phase": self.phase_bytes("device"), "host_by_phase": self.phase_bytes("host"),
                "parts": [asdict(p) for p in self.parts]}


def _averaging_bytes(manifest: Manifest, params: int) -> tuple[int, int, str]:
    """(kept, at a step) host bytes of the replica averaging scheme (``server/averaging``), and a note."""
    a = manifest.averaging
    if a.scheme == "full":
        return 8 * params, 16 * params, ("hivemind's float64 gradient buffers (8 B/param); at a step the taken "
                                          "float64 gradients and the averaged copy (16 B/param)")
    if a.scheme == "powersgd":
        return 16 * params, 16 * params, ("float64 M = G + E per matrix and the error-feedback buffers (16 B/param);"
                                          " at a step the taken gradients and the result (16 B/param)")
    if a.scheme == "diloco":
        return 24 * params, 4 * params, ("fp32 outer parameters and momentum (8 B/param) and the float64 payload "
                                         "of both (16 B/param); at a step the taken fp32 gradients (4 B/param)")
    if a.scheme == "gossip":
        return 12 * params, 4 * params, ("fp32 phase start and momentum (8 B/param) and the fp32 exchange buffer "
                                         "(4 B/param); at a step the taken fp32 gradients (4 B/param)")
    return int(24 * a.rho * params), 8 * params, (f"float64 payload of a rho={a.rho} slice of weights and both "
                                                  f"moments; at a step the taken float64 gradients")


def plan_stage(manifest: Manifest, stage: int | StageShape, options: Options, microbatch: Optional[int] = None,
               in_flight: int = 2, assumptions: Assumptions = Assumptions()) -> StagePlan:
    """Device and host bytes of one stage under ``options``, part by part."""
    s = stage if isinstance(stage, StageShape) else stage_shape(manifest, stage)
    shape, res = manifest.model, manifest.residual
    b = manifest.batch.microbatch_size if microbatch is None else microbatch
    if b < 1 or in_flight < 1:
        raise ValueError(f"microbatch ({b}) and in-flight microbatches ({in_flight}) must be at least 1")
    n_tok = b * shape.seq_len
    d, v, p = shape.d_model, shape.vocab_size, s.parameters
    subspace = res.mode == "subspace"
    bf16 = options.precision == "bf16"
    e = DTYPE_BYTES[options.precision]
    # The GPU always holds the stage's fp32 weights (``StageRuntime``: bf16 is autocast; an offloaded optimizer
    # steps fp32 host copies and copies the result back), so autocast makes a bf16 copy of every matmul weight per
    # forward, and the graph keeps it.
    casts = 2 * s.matmul_parameters if bf16 else 0
    block_casts = 2 * s.block_matmul if bf16 else 0
    head_casts = casts - s.layers * block_casts  # the LM head's: outside the blocks, never checkpointed
    stashes = not s.is_tail  # the tail runs its backward right after its forward: nothing waits, no snapshot

    blk = block_bytes_per_token(shape, options.precision, res.k if subspace and not s.is_tail else None,
                                assumptions.attention)
    acts = s.layers * blk * n_tok  # every block's saved tensors for one microbatch
    inputs = s.layers * 4 * d * n_tok  # checkpointing keeps only each block's fp32 input
    one_block = blk * n_tok + block_casts
    out = 4 * d * n_tok  # the stage output a stashing forward keeps (Pending.out) for its backward
    width_in = (res.k if subspace else d)
    boundary = 8 * n_tok + (0 if s.is_head else 4 * width_in * n_tok)  # int64 token ids + fp32 input coordinates
    graph = (inputs + head_casts if options.checkpointing else acts + casts) + out
    # A microbatch waiting for its backward keeps its output (``Pending.out``, also in recompute mode: computed
    # without a graph), its token ids and received coordinates, and with ``stash`` its whole graph.
    held = 0 if s.is_tail else graph + boundary if options.backward == "stash" else out + boundary
    workspace = backward_workspace_per_token(shape, options.precision) * n_tok
    # Gradients land on the snapshot during the backward and move to the live parameters after it
    # (``StageRuntime.backward``): they grow while the graph they come from is freed, block by block.
    landing = 4 * p if stashes else 0
    releasable = graph - out

    parts: list[Part] = []
    add = lambda *a: parts.append(Part(*a))  # noqa: E731
    add("weights", 4 * p, 4 * p if options.offload_optimizer else 0, "always",
        "fp32" + (" (autocast computes in bf16)" if bf16 else "")
        + ("; the optimizer's fp32 master copy on the host" if options.offload_optimizer else ""))
    add("gradients", 4 * p, 0, "always", "fp32, accumulated between optimizer steps")
    if manifest.optimizer.name in ("muon", "numuon"):  # one momentum buffer per block matrix, AdamW's two else
        matrices = s.layers * s.block_matmul
        moments, what = 4 * matrices + 8 * (p - matrices), "Muon momentum on block matrices + AdamW's two on the rest"
    else:
        moments, what = 8 * p, "AdamW exp_avg + exp_avg_sq"
    add("optimizer moments", 0 if options.offload_optimizer else moments, moments if options.offload_optimizer else 0,
        "always", what + ", fp32" + (" (offloaded)" if options.offload_optimizer else ""))
    if stashes:
        versions = assumptions.versions or min(in_flight, 2)
        add("weight snapshots", versions * 4 * p, 0, "always",
            f"{versions} parameter version(s) the microbatches in flight ran on")
    tables = 2 * shape.seq_len * shape.head_dim * 4
    if subspace:
        tables += 4 * v * d + 4 * d * res.k
    add("frozen tables", tables, 0, "always", "frozen embedding F (V x d), basis U, RoPE" if subspace else "RoPE")

    if s.is_tail:
        add("boundary", boundary, 0, "microbatch", "the received coordinates and token ids")
        trunk = graph - out
        logits_n = n_tok * v
        # Log-softmax keeps its fp32 output; its backward holds that, the incoming gradient and its own result
        # (12 B per logit). Later the LM head's backward holds the logits' gradient (e B each) with its new weight
        # gradient (fp32, plus the bf16 one under autocast) before adding it to the accumulated one. The final norm
        # keeps its fp32 input and output, and the LM head its input (fp32, or a bf16 cast).
        wgrad = s.lm_head * (4 + (2 if casts else 0))
        loss = max(12 * logits_n, e * logits_n + wgrad) + (8 + (2 if bf16 else 4)) * d * n_tok
        recompute_block = one_block if options.checkpointing else 0
        add("activations", trunk, 0, "microbatch",
            f"{s.layers} blocks x {blk} B/token x {n_tok} tokens" + (" + bf16 weight casts" if casts else "")
            if not options.checkpointing else f"block inputs only ({s.layers} x 4d B/token)"
            + (" + the LM head's bf16 weight cast" if head_casts else ""))
        add("logits", loss, 0, "microbatch", f"B*T*V = {logits_n:,} logits: fp32 log-softmax and its gradients")
        # The blocks' backward starts once the logits' gradients are gone: only what exceeds their peak counts.
        add("backward workspace", max(0, recompute_block + workspace - loss), 0, "microbatch",
            "transient gradients" + (" + one block recomputed" if options.checkpointing else "")
            + ", beyond the logits' peak")
    else:
        what = "whole autograd graph" if options.backward == "stash" else "output and input boundary"
        add("microbatches in flight", in_flight * held, 0, "always",
            f"{in_flight} x {what} ({held / 2**20:.1f} MiB each)")
        working = max(0, landing - releasable) + workspace
        if options.backward == "recompute":
            working += graph  # the re-run forward's graph exists during the backward
            note = "the stage forward re-run for the backward"
        else:
            note = "backward of one of them"
        if options.checkpointing:
            working += one_block
            note += ", one block recomputed at a time"
        add("working microbatch", working, 0, "microbatch",
            note + "; gradients landing on the snapshot beyond the activations they free; transients")

    avg_kept, avg_step, avg_note = _averaging_bytes(manifest, p)
    add("averaging buffers", 0, avg_kept, "always", avg_note)
    # ``ReplicaSync.round`` hands ``apply_step`` the average cast to fp32 (4 B/param on the host) while the float64
    # copies still exist. Without offload that gradient comes to the GPU next to the gradients accumulated in the
    # meantime, and the fused (foreach) AdamW materialises sqrt(exp_avg_sq) for every tensor at once; offloaded,
    # the step runs on the host, one tensor at a time, and only the new weights travel back.
    if options.offload_optimizer:
        add("optimizer step", 0, avg_step + 4 * p, "step", "the averaged gradient in fp32 for the host AdamW")
    else:
        add("optimizer step", 8 * p, avg_step + 4 * p, "step",
            "the averaged gradient on the GPU + AdamW's foreach temporary")
    if assumptions.reserve_gib:
        add("reserve", int(assumptions.reserve_gib * GIB), 0, "always", "CUDA context, workspaces, fragmentation")
    return StagePlan(s.index, s.kind, s.layers, p, b, in_flight, options, parts, held)


def predict_stage_bytes(manifest: Manifest, stage: int, precision: Precision = "fp32", backward: Backward = "stash",
                        microbatch: Optional[int] = None, in_flight: int = 2, offload_optimizer: bool = False,
                        checkpointing: bool = False, stepped: bool = True,
                        assumptions: Assumptions = Assumptions()) -> int:
    """Device bytes at the peak of a training microbatch, without the reserve: what
    ``torch.cuda.max_memory_allocated`` reports for a ``StageRuntime`` running microbatches. ``stepped=False``:
    before the first optimizer step (AdamW allocates its moments there), as in a benchmark that never steps."""
    plan = plan_stage(manifest, stage, Options(precision, backward, offload_optimizer, checkpointing), microbatch,
                      in_flight, replace(assumptions, reserve_gib=0))
    unstepped = 0 if stepped else sum(p.device for p in plan.parts if p.name == "optimizer moments")
    return plan.phase_bytes("device")["microbatch"] - unstepped

@dataclass
class Choice:
    """The plan picked for one stage under a GPU budget, and the alternatives."""

    stage: int
    kind: str
    gpu_bytes: int
    chosen: Optional[StagePlan]
    candidates: list[StagePlan]
    advice: list[str] = field(default_factory=list)

    @property
    def smallest(self) -> StagePlan:
        return min(self.candidates, key=lambda c: c.device_bytes)

    def to_json(self) -> dict:
        return {"stage": self.stage, "kind": self.kind, "gpu_bytes": self.gpu_bytes, "fits": self.chosen is not None,
                "chosen": self.chosen.to_json() if self.chosen else None,
                "smallest": self.smallest.to_json(), "advice": self.advice,
                "candidates": [{"options": asdict(c.options), "device_bytes": c.device_bytes,
                                "host_bytes": c.host_bytes, "fits": c.device_bytes <= self.gpu_bytes}
                               for c in self.candidates]}


def _candidates(manifest: Manifest, s: StageShape, b: Optional[int], f: int, a: Assumptions,
                search: Search) -> list[StagePlan]:
    # On the tail ``recompute`` changes nothing (its backward follows its forward at once): only stash is planned.
    sets = [o for o in search.options() if not (s.is_tail and o.backward == "recompute")]
    return [plan_stage(manifest, s, o, b, f, a) for o in sets]


def _fits(plan: StagePlan, gpu_bytes: int, host_bytes: Optional[int]) -> bool:
    return plan.device_bytes <= gpu_bytes and (host_bytes is None or plan.host_bytes <= host_bytes)


def _first_fit(manifest: Manifest, s: StageShape, b: Optional[int], f: int, a: Assumptions, gpu: int,
               host: Optional[int], search: Search) -> Optional[StagePlan]:
    return next((c for c in _candidates(manifest, s, b, f, a, search) if _fits(c, gpu, host)), None)


def choose(manifest: Manifest, stage: int, gpu_gib: float, microbatch: Optional[int] = None, in_flight: int = 2,
           assumptions: Assumptions = Assumptions(), search: Search = Search(),
           host_gib: Optional[float] = None) -> Choice:
    """The cheapest option set under which ``stage`` fits ``gpu_gib`` GiB (and ``host_gib`` when given), or advice
    on what to change when none does."""
    s = stage_shape(manifest, stage)
    gpu, host = int(gpu_gib * GIB), None if host_gib is None else int(host_gib * GIB)
    cands = _candidates(manifest, s, microbatch, in_flight, assumptions, search)
    chosen = next((c for c in cands if _fits(c, gpu, host)), None)
    choice = Choice(stage, s.kind, gpu, chosen, cands)
    if chosen is None:
        choice.advice = _advice(manifest, s, choice, microbatch, in_flight, assumptions, gpu, host, search)
    return choice


def _advice(manifest: Manifest, s: StageShape, choice: Choice, microbatch: Optional[int], in_flight: int,
            a: Assumptions, gpu: int, host: Optional[int], search: Search) -> list[str]:
    best = choice.smallest
    out = [f"does not fit: the smallest need is {best.device_bytes / GIB:.1f} GiB of GPU memory "
           f"({best.options.describe()}) for {gpu / GIB:.1f} GiB"]
    if host is not None and best.device_bytes <= gpu:
        out[0] = (f"does not fit the host: {best.options.describe()} fits the GPU but needs "
                  f"{best.host_bytes / GIB:.1f} GiB of host memory for {host / GIB:.1f} GiB")
    b = manifest.batch.microbatch_size if microbatch is None else microbatch
    for smaller in range(b - 1, 0, -1):
        plan = _first_fit(manifest, s, smaller, in_flight, a, gpu, host, search)
        if plan is not None:
            out.append(f"a microbatch of {smaller} sequences fits ({plan.options.describe()})")
            break
    if in_flight > 1 and not s.is_tail:
        plan = _first_fit(manifest, s, microbatch, 1, a, gpu, host, search)
        if plan is not None:
            out.append(f"one microbatch in flight instead of {in_flight} fits ({plan.options.describe()})")
    most = _max_layers(manifest, s, microbatch, in_flight, a, gpu, host, search)
    if most == 0:
        one = min(c.device_bytes for c in _candidates(manifest, stage_shape(manifest, s.index, 1), microbatch,
                                                      in_flight, a, search))
        fixed = "its embedding" if s.is_head else "the LM head and its logits" if s.is_tail else "the frozen tables"
        fix = "a GPU with more memory" + (", a smaller microbatch" if b > 1 else "") + " or a shorter seq_len"
        out.append(f"even one block next to {fixed} needs {one / GIB:.1f} GiB: {fix}")
    elif most < s.layers:
        out.append(f"at most {most} of its {s.layers} layers fit: move the others to other stages (see the "
                   f"suggested split)")
    return out


def _max_layers(manifest: Manifest, s: StageShape, b: Optional[int], f: int, a: Assumptions, gpu: int,
                host: Optional[int], search: Search, limit: Optional[int] = None) -> int:
    """The most blocks a stage in ``s``'s position can hold and still fit (0: not even one)."""
    limit = manifest.model.n_layers if limit is None else limit
    lo, hi = 0, limit  # fitting is monotone in the layer count: bisect
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if _first_fit(manifest, stage_shape(manifest, s.index, mid), b, f, a, gpu, host, search) is not None:
            lo = mid
        else:
            hi = mid - 1
    return lo


def suggest_split(manifest: Manifest, gpu_gib: float, microbatch: Optional[int] = None, in_flight: int = 2,
                  assumptions: Assumptions = Assumptions(), search: Search = Search(),
                  host_gib: Optional[float] = None) -> Optional[list[int]]:
    """The fewest stages (no fewer than the manifest's) whose every stage fits, layers spread as evenly as the
    limits allow; None when no split does (then a larger GPU or a smaller microbatch is the way)."""
    n_layers = manifest.model.n_layers
    gpu, host = int(gpu_gib * GIB), None if host_gib is None else int(host_gib * GIB)

    def cap(index: int, n_stages: int) -> int:
        probe = manifest.with_overrides(stages=[1] * n_stages, **{"model.n_layers": n_stages})
        s = stage_shape(probe, index)
        return _max_layers(probe, s, microbatch, in_flight, assumptions, gpu, host, search, limit=n_layers)

    if all(_first_fit(manifest, stage_shape(manifest, i), microbatch, in_flight, assumptions, gpu, host, search)
           for i in range(manifest.n_stages)):
        return list(manifest.stages)
    for n in range(max(manifest.n_stages, 1), n_layers + 1):
        if n == 1:
            continue  # one stage is the whole model (head and tail at once): not a pipeline split
        caps = [cap(0, n)] + [cap(1, n)] * (n - 2) + [cap(n - 1, n)]
        if min(caps) < 1 or sum(caps) < n_layers:
            continue
        split = list(caps)
        while sum(split) > n_layers:  # take layers from the fullest stages until the sum is right
            i = max(range(n), key=lambda j: (split[j], j))
            split[i] -= 1
        if min(split) >= 1:
            return split
    return None


def plan_manifest(manifest: Manifest, gpu_gib: float, stage: Optional[int] = None, microbatch: Optional[int] = None,
                  in_flight: int = 2, assumptions: Assumptions = Assumptions(), search: Search = Search(),
                  host_gib: Optional[float] = None) -> list[Choice]:
    """``choose`` for one stage, or every stage of the manifest."""
    stages: Sequence[int] = range(manifest.n_stages) if stage is None else [stage]
    return [choose(manifest, s, gpu_gib, microbatch, in_flight, assumptions, search, host_gib) for s in stages]


def plan_report(manifest: Manifest, gpu_gib: float, stage: Optional[int] = None, microbatch: Optional[int] = None,
                in_flight: int = 2, assumptions: Assumptions = Assumptions(), search: Search = Search(),
                host_gib: Optional[float] = None) -> dict:
    """Everything ``agora plan`` shows, as JSON-ready data: one choice per stage, and a split that fits when the
    manifest's does not."""
    if stage is not None and not 0 <= stage < manifest.n_stages:
        raise ValueError(f"stage {stage} does not exist: the manifest has {manifest.n_stages} stages")
    choices = plan_manifest(manifest, gpu_gib, stage, microbatch, in_flight, assumptions, search, host_gib)
    fits = all(c.chosen is not None for c in choices)
    split = None if fits else suggest_split(manifest, gpu_gib, microbatch, in_flight, assumptions, search, host_gib)
    if fits:
        verdict = f"every stage planned fits {gpu_gib:g} GiB"
    else:
        sets = "any option set" if search == Search() else "any option set searched"
        verdict = f"the split {list(manifest.stages)} does not fit {gpu_gib:g} GiB under {sets}; " + (
            f"a split that does: stages: {split} (a new manifest hash: another run)" if split else
            "no split does: a GPU with more memory (or, where the microbatch is above 1, a smaller one)")
    return {"run_id": manifest.run_id, "manifest_hash": manifest.hash, "stages_split": list(manifest.stages),
            "gpu_gib": gpu_gib, "host_gib": host_gib,
            "microbatch": manifest.batch.microbatch_size if microbatch is None else microbatch,
            "in_flight": in_flight, "search": asdict(search), "assumptions": asdict(assumptions),
            "all_fit": fits, "suggested_split": split, "verdict": verdict,
            "stages": [c.to_json() for c in choices]}
