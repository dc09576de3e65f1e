"""``agora bench compression``: what the subspace costs and saves.

1. Bytes per token at each stage boundary, dense vs subspace(k), fp32 and bf16 coordinates, for ``small`` and
   ``agora-8b`` (computed from the manifest and checked against a real encoded boundary for small). The headline
   ratio compares like with like (subspace vs dense at the same precision); bf16 subspace vs dense fp32 mixes a
   precision change into the ratio and is reported as a labelled extra only.
2. Validation loss at an equal token budget, dense vs subspace, on ``small``: the quality price of compression.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch

from agora.bench.common import markdown_table, write_result
from agora.config import load_manifest
from agora.model import Stage
from agora.lab.train_local import train_local
from agora.wire import bytes_per_token, compress


def measured_bytes_per_token(preset: str, wire_dtype: str) -> float:
    """Encode a real head-stage output and count its bytes (guards the formula against drift)."""
    m = load_manifest(preset)
    stage = Stage(m, 0)
    tokens = torch.randint(0, m.model.vocab_size, (2, m.model.seq_len))
    with torch.no_grad():
        b = compress(stage(tokens), tokens, stage.basis, wire_dtype)
    return b.nbytes / tokens.numel()


def run(out: Path, token_budget: int, preset: str = "small", log: Callable[[str], None] = print) -> dict:
    rows, table = [], []
    for name in (preset, "agora-8b"):
        m = load_manifest(name)
        d, k = m.model.d_model, m.residual.k
        for dtype in ("fp32", "bf16"):
            dense = bytes_per_token(d, "dense", None, dtype)
            for mode in ("dense", "subspace"):
                b = bytes_per_token(d, mode, k if mode == "subspace" else None, dtype)
                mixed = bytes_per_token(d, "dense", None, "fp32") / b
                rec = {"preset": name, "mode": mode, "k": k if mode == "subspace" else None, "wire_dtype": dtype,
                       "bytes_per_token": b, "reduction_same_precision": dense / b,
                       "reduction_vs_dense_fp32": mixed}
                if name == preset and mode == "subspace":
                    rec["measured_bytes_per_token"] = measured_bytes_per_token(name, dtype)
                rows.append(rec)
                table.append([name, mode, rec["k"] or "-", dtype, b, f"{dense / b:.1f}x", f"{mixed:.1f}x"])

    base = load_manifest(preset)
    tokens_per_step = base.batch.target_batch_size * base.model.seq_len
    steps = max(1, token_budget // tokens_per_step)
    quality = {}
    for mode in ("dense", "subspace"):
        changes = {"residual.mode": mode, "optimizer.total_steps": steps}
        if mode == "dense":
            changes["residual.k"] = None
        m = base.with_overrides(**changes)
        log(f"[compression] training {preset} {mode} for {steps} steps ({steps * tokens_per_step} tokens)")
        s = train_local(m, steps, out / f"train-{mode}", val_batches=16)
        quality[mode] = {"val_loss": s["val_loss"], "tokens": s["tokens"], "parameters": s["parameters"],
                         "wall_s": s["wall_s"]}
    gap = quality["subspace"]["val_loss"] / quality["dense"]["val_loss"] - 1
    md = markdown_table(["preset", "residual", "k", "coords", "bytes/token", "vs dense, same precision",
                         "extra: vs dense fp32"], table)
    md += "\n\n" + markdown_table(
        ["residual", "tokens", "parameters", "val loss"],
        [[k, v["tokens"], v["parameters"], v["val_loss"]] for k, v in quality.items()],
    )
    md += f"\n\nsubspace vs dense validation loss: {gap * 100:+.2f}%\n"
    result = {"bytes": rows, "quality": quality, "val_loss_gap": gap, "steps": steps}
    write_result(out, "compression", result, md)
    log(md)
    return result
