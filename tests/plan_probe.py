"""Measure one stage's peak memory on CPU, trained the way ``StageRuntime`` does, for ``tests/test_plan.py``.

Run in a fresh process: ``python tests/plan_probe.py MANIFEST STAGE B F PRECISION BACKWARD CHECKPOINT [runtime
OFFLOAD]`` (``runtime``: through the node's own ``StageRuntime``, else through a copy of its steps); prints one JSON
line of byte counts, each relative to the resident set after a warm-up.

How it measures, and why this way: torch's CPU allocator keeps no statistics and ``tracemalloc`` does not see it,
but every tensor is plain ``malloc`` memory. With ``MALLOC_MMAP_THRESHOLD_`` fixed (the test sets it), glibc
serves every allocation above the threshold with its own ``mmap`` and unmaps it on free, so the resident set
follows the live tensors instead of a heap that never shrinks. The kernel's high-water mark of the resident set
(``VmHWM``) is the peak; writing 5 to ``/proc/self/clear_refs`` resets it. A warm-up through the same code paths
first loads the lazily imported modules and initialises kernels, and one torch thread keeps per-thread scratch
from coming and going.

The stage is trained as ``server/runtime.py`` does: non-tail stages run on a weight snapshot (here a copy of the
stage sharing its buffers, so that per-block checkpointing recomputes on the snapshot too), keep ``F`` microbatches
in flight (their whole graph with ``stash``, only the input with ``recompute``), and move each backward's gradient
to the accumulated one afterwards; the tail runs its backward right after its forward.
"""

from __future__ import annotations

import contextlib
import copy
import json
import sys
from pathlib import Path
from typing import Optional

import torch


def _status(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def rss() -> int:
    return _status("VmRSS")


def reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")


def peak() -> int:
    return _status("VmHWM")


def run_blocks(stage, x_or_tokens, checkpointing: bool):
    """``Stage.forward`` without a cache, with or without its per-block checkpointing (``--checkpoint-blocks``)."""
    stage.checkpoint_blocks = checkpointing
    return stage(x_or_tokens)


def through_runtime(spec: str, index: int, b: int, f: int, precision: str, backward: str, offload: bool,
                    checkpointing: bool) -> dict:
    """The same measurement through the node's own ``StageRuntime``."""
    from agora.config import load_manifest
    from agora.server.observers import Observers
    from agora.server.runtime import Counters, RuntimeOptions, StageRuntime

    torch.set_num_threads(1)
    torch.manual_seed(0)
    manifest = load_manifest(spec)
    options = RuntimeOptions(device="cpu", precision=precision, backward=backward, offload_optimizer=offload,
                             checkpoint_blocks=checkpointing)

    def batch(rt, n_seq: int) -> list:
        shape, res = rt.manifest.model, rt.manifest.residual
        tokens = torch.randint(0, shape.vocab_size, (n_seq, shape.seq_len), dtype=torch.int32)
        last = torch.randint(0, shape.vocab_size, (n_seq,), dtype=torch.int32)
        if rt.is_head:
            return [tokens, last]
        width = res.k if res.mode == "subspace" else shape.d_model
        return [torch.randn(n_seq, shape.seq_len, width).to(rt.wire_dtype), tokens, last]  # as received

    def cycle(rt, batches: list, result: Optional[dict] = None) -> None:
        before = rss()
        if result is not None:
            reset_peak()
        pending = [rt.forward(x, True, rt.generation)[0] for x in batches]
        if result is not None:
            result["held"] = rss() - before
        for item in pending:
            if rt.is_tail:
                rt.finish_tail(item)
            else:
                rt.backward(item, torch.randn(rt.boundary(item).coords.shape))
        pending.clear()

    def stepped(rt) -> None:
        rt.apply_step([torch.zeros(p.shape, dtype=torch.float64) for p in rt.stage.parameters()])  # moments exist

    warm = StageRuntime(load_manifest("tiny"), 0, Counters(), Observers(), options=options)  # lazy set-up
    stepped(warm)
    cycle(warm, [batch(warm, 2)])
    del warm
    base = rss()
    rt = StageRuntime(manifest, index, Counters(), Observers(), options=options)
    built = rss() - base
    stepped(rt)
    cycle(rt, [batch(rt, b)])  # one microbatch first: gradients accumulate from here on, kernels are set up
    result = {"built": built, "static": rss() - base}
    cycle(rt, [batch(rt, b) for _ in range(f)], result)
    result["peak"] = peak() - base
    return result


def main(spec: str, index: int, b: int, f: int, precision: str, backward: str, checkpointing: bool) -> dict:
    from agora.config import load_manifest
    from agora.model import Stage
    from agora.optim import build_optimizer
    from agora.wire import Boundary, decompress

    torch.set_num_threads(1)
    torch.manual_seed(0)
    manifest = load_manifest(spec)
    shape = manifest.model

    def autocast():
        return torch.autocast("cpu", dtype=torch.bfloat16) if precision == "bf16" else contextlib.nullcontext()

    def forward(stage, coords, tokens):
        """(leaf, output) of ``stage`` for a microbatch: ``StageRuntime.forward_from``."""
        with autocast():
            if stage.spec.is_head:
                return None, run_blocks(stage, tokens, checkpointing)
            leaf = coords.float().requires_grad_(torch.is_grad_enabled())
            x = decompress(Boundary(leaf, tokens, manifest.residual.mode), stage.basis, stage.frozen_embed)
            return leaf, run_blocks(stage, x, checkpointing)

    # Warm-up through the same code paths on a throwaway stage: lazy imports and kernel set-up are not counted.
    warm_manifest = load_manifest("tiny")
    warm = Stage(warm_manifest, 0)
    warm_opt = build_optimizer(warm, manifest.optimizer)
    warm_tokens = torch.randint(0, 100, (2, 8))
    for ckpt in (False, True):
        with autocast():
            out = run_blocks(warm, warm_tokens, ckpt)
        out.sum().backward()
    with autocast():
        out = run_blocks(Stage(warm_manifest, 1), torch.randn(2, 8, 64), checkpointing)
        loss = Stage(warm_manifest, 1).loss(out, warm_tokens)
    loss.backward()
    warm_opt.step()
    del warm, warm_opt, out, loss
    base = rss()

    stage = Stage(manifest, index)
    optimizer = build_optimizer(stage, manifest.optimizer)
    built = rss() - base
    for p in stage.parameters():
        p.grad = torch.zeros_like(p)  # the accumulated gradients of a running stage
    optimizer.step()  # materialises AdamW's moments
    static = rss() - base

    def batch():
        tokens = torch.randint(0, shape.vocab_size, (b, shape.seq_len))
        last = torch.randint(0, shape.vocab_size, (b,))
        width = manifest.residual.k if stage.subspace else shape.d_model
        return (None if stage.spec.is_head else torch.randn(b, shape.seq_len, width)), tokens, last

    result = {"built": built, "static": static}
    # One microbatch before measuring, as on a node that has been serving: the kernels' first use of these shapes
    # sets up per-shape state (oneDNN's bf16 primitives: ~3 MB here) that would otherwise count as activations.
    if stage.spec.is_tail:
        for measured in (False, True):
            coords, tokens, last = batch()
            if measured:
                reset_peak()
            leaf, out = forward(stage, coords, tokens)
            with autocast():
                # ``runtime.next_token_targets`` (not imported: the server layer pulls in hivemind: seconds)
                loss = stage.loss(out, torch.cat([tokens[:, 1:], last[:, None]], dim=1))
            (loss * b).backward()
            del leaf, out, loss
        result["peak"] = peak() - base
        return result

    # The snapshot: a copy of the stage holding its own parameters and sharing the frozen buffers.
    snapshot = copy.deepcopy(stage, memo={id(t): t for t in stage.buffers()})

    def cycle(batches: list, measured: bool) -> None:
        """``F`` forwards, then their backwards in order; each gradient moved to the accumulated one after it."""
        before = rss() - base
        if measured:
            result["snapshot_and_inputs"] = before - static
            reset_peak()
        pending = []
        for coords, tokens, _ in batches:
            if backward == "stash":
                pending.append((coords, tokens, forward(snapshot, coords, tokens)))
            else:
                with torch.no_grad():  # the boundary is sent; the input and the output (``Pending.out``) are kept
                    kept = forward(snapshot, coords, tokens)[1]
                pending.append((coords, tokens, kept))
        if measured:
            result["held"] = rss() - base - before
        while pending:
            coords, tokens, done = pending.pop(0)
            leaf, out = done if backward == "stash" else forward(snapshot, coords, tokens)
            sent = out @ stage.basis if stage.subspace else out
            sent.backward(torch.randn_like(sent))
            for p, s in zip(stage.parameters(), snapshot.parameters()):  # ``StageRuntime.backward``'s move
                if s.grad is not None:
                    p.grad.add_(s.grad)
                    s.grad = None
            del done, leaf, out, sent

    cycle([batch()], measured=False)
    cycle([batch() for _ in range(f)], measured=True)
    result["peak"] = peak() - base
    return result


if __name__ == "__main__":
    spec, index, b, f, precision, backward, ckpt = sys.argv[1:8]
    if len(sys.argv) > 9 and sys.argv[8] == "runtime":
        print(json.dumps(through_runtime(spec, int(index), int(b), int(f), precision, backward, sys.argv[9] == "1",
                                         ckpt == "1")))
    else:
        print(json.dumps(main(spec, int(index), int(b), int(f), precision, backward, ckpt == "1")))
