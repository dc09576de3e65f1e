"""``agora bench upm``: do UPM's boundary rotations preserve the function, and do shards of different times fit?

(a) Function preservation: T rotations at random boundaries, compounded in place, on ``small`` (subspace, briefly
trained here) in fp32 and fp64, and on a real pretrained model (dense, ``--model``) in fp32: max |delta logit|,
Jensen-Shannon drift (nats, mean and max over positions) and the validation perplexity change, against the model
before any transform. (b) Stitching: a model assembled from a stage captured before 1 (or 100) more rotations of
every boundary and the other stages after them, against the same model with that stage replaced by unrelated
random weights (the JS ratio). Recovery cost and the swarm's training overhead (issue #17 items 5c, 5d) are not
measured here yet.
"""

from __future__ import annotations

import copy
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch

from agora.bench.common import markdown_table, write_result
from agora.config import Manifest, even_split, load_manifest
from agora.data import build_datasets, split_documents, load_documents, tokenize_documents
from agora.frames import enable_frames, exact_basis, frame_width, haar_orthogonal, rotate_boundary
from agora.model import Stage, build_stages

logger = logging.getLogger("agora.bench")


@dataclass
class UpmBenchOptions:
    out: Path
    transforms: int = 10_000  # compounded rotations on ``small``
    real_transforms: int = 20  # on the real model (dense d x d rotations: ~seconds each on a CPU)
    train_steps: int = 30  # ``small`` is trained this long first, so its outputs are not near-uniform
    model: Optional[Path] = None  # a real pretrained model (Hugging Face folder, GGUF or import folder), dense
    real_stages: int = 3
    eval_rows: int = 8  # validation windows the logits are compared on
    seed: int = 0
    checkpoints: list[int] = field(default_factory=lambda: [1, 10, 100, 1000, 10_000])


# --------------------------------------------------------------------------- measurements


def _logits(stages: list[Stage], tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        x = tokens
        for st in stages:
            x = st(x)
        return stages[-1].logits(x).double()


def _js(p_logits: torch.Tensor, q_logits: torch.Tensor) -> torch.Tensor:
    """Jensen-Shannon divergence (nats) per position between the two softmax distributions."""
    p, q = p_logits.double().log_softmax(-1), q_logits.double().log_softmax(-1)
    m = torch.logaddexp(p, q) - torch.log(torch.tensor(2.0, dtype=torch.float64))
    return 0.5 * ((p.exp() * (p - m)).sum(-1) + (q.exp() * (q - m)).sum(-1))


def _ppl(logits: torch.Tensor, targets: torch.Tensor) -> float:
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
    return float(loss.exp())


def compare(ref: torch.Tensor, now: torch.Tensor, targets: torch.Tensor) -> dict:
    js = _js(ref, now)
    return {"max_abs_dlogit": float((now - ref).abs().max()), "js_mean": float(js.mean()), "js_max": float(js.max()),
            "ppl": _ppl(now, targets), "dppl": abs(_ppl(now, targets) - _ppl(ref, targets))}


def preservation(stages: list[Stage], dtype: torch.dtype, rows: torch.Tensor, transforms: int,
                 checkpoints: list[int], seed: int) -> list[dict]:
    """Compound ``transforms`` random boundary rotations on a copy of ``stages`` in ``dtype``; the comparison with
    the untouched model at every checkpoint."""
    stages = [copy.deepcopy(st).to(dtype) for st in stages]
    if dtype == torch.float64:
        for st in stages:
            exact_basis(st)
    tokens, targets = rows[:, :-1], rows[:, 1:]
    ref = _logits(stages, tokens)
    for st in stages:
        enable_frames(st, allow_tied_copies=True)
    out = [dict(transforms=0, seconds_per_transform=0.0, **compare(ref, _logits(stages, tokens), targets))]
    gen = torch.Generator().manual_seed(seed)
    width, n = frame_width(stages[0]), len(stages)
    spent, done = 0.0, 0
    for t in sorted(c for c in checkpoints if c <= transforms):
        t0 = time.perf_counter()
        while done < t:
            b = int(torch.randint(0, n - 1, (1,), generator=gen))
            rotate_boundary(stages, b, haar_orthogonal(width, gen))
            done += 1
        spent += time.perf_counter() - t0
        out.append(dict(transforms=done, seconds_per_transform=spent / done, **compare(ref, _logits(stages, tokens),
                                                                                       targets)))
        logger.info(f"{done} transforms ({dtype}): {out[-1]}")
    return out


def stitching(stages: list[Stage], random_stages: list[Stage], rows: torch.Tensor, seed: int) -> list[dict]:
    """For each stage s and gap (1 or 100 rotations of every boundary): JS of the model with stage s taken before
    the gap, against the same with stage s replaced by unrelated random weights (both vs the honest model)."""
    stages = [copy.deepcopy(st) for st in stages]
    for st in stages:
        enable_frames(st, allow_tied_copies=True)
    randoms = [copy.deepcopy(st) for st in random_stages]
    for st in randoms:
        enable_frames(st, allow_tied_copies=True)
    tokens = rows[:, :-1]
    gen = torch.Generator().manual_seed(seed + 1)
    width, n = frame_width(stages[0]), len(stages)
    for b in range(n - 1):  # start from non-trivial frames
        rotate_boundary(stages, b, haar_orthogonal(width, gen))
    out = []
    for gap in (1, 100):
        before = [copy.deepcopy(st) for st in stages]
        for _ in range(gap):
            for b in range(n - 1):
                rotate_boundary(stages, b, haar_orthogonal(width, gen))
        honest = _logits(stages, tokens)
        for s in range(n):
            stitched = [before[s] if i == s else st for i, st in enumerate(stages)]
            unrelated = [randoms[s] if i == s else st for i, st in enumerate(stages)]
            js_stitched = float(_js(honest, _logits(stitched, tokens)).mean())
            js_random = float(_js(honest, _logits(unrelated, tokens)).mean())
            out.append({"gap": gap, "stage": s, "js_stitched": js_stitched, "js_unrelated": js_random,
                        "ratio": js_stitched / js_random if js_random > 0 else float("nan"),
                        "honest_after_gap_js": float(_js(_logits(before, tokens), honest).mean())})
    return out


# --------------------------------------------------------------------------- models


def _small(opts: UpmBenchOptions) -> tuple[Manifest, list[Stage], torch.Tensor]:
    from agora.lab.train_local import train_model

    m = load_manifest("small").with_overrides(seed=opts.seed)
    logger.info(f"training small for {opts.train_steps} steps")
    _, model = train_model(m, opts.train_steps) if opts.train_steps > 0 else (None, None)
    stages = list(model.stages) if model is not None else build_stages(m)
    _, val, _ = build_datasets(m)
    rows = torch.cat(val.fixed_batches(m.batch.microbatch_size, opts.eval_rows))[: opts.eval_rows].long()
    return m, [st.eval() for st in stages], rows


def _real(opts: UpmBenchOptions) -> tuple[Manifest, list[Stage], list[Stage], torch.Tensor]:
    """The real model re-cut into ``real_stages`` dense stages (each end its own embedding copy), unrelated random
    stages of the same shapes, and validation windows of the bundled corpus."""
    from agora.ops.model_io import load_model

    loaded = load_model(opts.model)
    whole = loaded.manifest
    if whole.residual.mode != "dense":
        raise ValueError(f"{opts.model}: a subspace model; the real-model rows need a dense (imported) model")
    m = whole.with_overrides(stages=even_split(whole.model.n_layers, opts.real_stages),
                             **{"model.tie_embeddings": False})
    params = {}
    for st in loaded.model.stages:
        params.update({n: p for n, p in st.named_parameters()})
    if "lm_head.weight" not in params:
        params["lm_head.weight"] = params["embed_tokens.weight"]
    stages = []
    for i in range(m.n_stages):
        st = Stage(m, i)
        with torch.no_grad():
            for n, p in st.named_parameters():
                p.copy_(params[n])
        stages.append(st.eval())
    randoms = [Stage(m.with_overrides(seed=m.seed + 1), i).eval() for i in range(m.n_stages)]
    _, val_docs = split_documents(load_documents("sotu"), 0.05)
    stream = tokenize_documents(loaded.tokenizer, val_docs[:4], use_cache=False)
    t = min(64, m.model.seq_len)
    rows = stream[: opts.eval_rows * (t + 1)].view(opts.eval_rows, t + 1).long()
    return m, stages, randoms, rows


# --------------------------------------------------------------------------- the benchmark


def run_upm_bench(opts: UpmBenchOptions) -> dict:
    torch.manual_seed(opts.seed)
    m, small, rows = _small(opts)
    result: dict = {"options": {k: str(v) if isinstance(v, Path) else v for k, v in opts.__dict__.items()},
                    "small": {"manifest_hash": m.hash, "k": m.residual.k, "d_model": m.model.d_model}}
    for name, dtype in (("fp32", torch.float32), ("fp64", torch.float64)):
        result["small"][name] = preservation(small, dtype, rows, opts.transforms, opts.checkpoints, opts.seed)
    randoms = [st.eval() for st in build_stages(m.with_overrides(seed=opts.seed + 1))]
    result["small"]["stitching"] = stitching(small, randoms, rows, opts.seed)
    if opts.model is not None:
        rm, real, real_randoms, real_rows = _real(opts)
        result["real"] = {"model": str(opts.model), "d_model": rm.model.d_model, "stages": rm.stages,
                          "fp32": preservation(real, torch.float32, real_rows, opts.real_transforms,
                                               sorted({1, 10, opts.real_transforms}), opts.seed),
                          "stitching": stitching(real, real_randoms, real_rows, opts.seed)}
    write_result(opts.out, "upm", result, markdown(result))
    return result


def markdown(result: dict) -> str:
    parts = []
    for model in ("small", "real"):
        if model not in result:
            continue
        r = result[model]
        what = (f"`small` (subspace, k={r['k']}, d={r['d_model']})" if model == "small"
                else f"{r['model']} (dense, d={r['d_model']}, stages {r['stages']})")
        rows = []
        for precision in ("fp32", "fp64"):
            for row in r.get(precision, []):
                rows.append([precision, row["transforms"], row["max_abs_dlogit"], row["js_mean"], row["js_max"],
                             row["dppl"], row["ppl"], row["seconds_per_transform"]])
        parts.append(f"### Function preservation: {what}\n\n" + markdown_table(
            ["precision", "transforms", "max abs dlogit", "JS mean (nats)", "JS max", "abs dPPL", "PPL",
             "s / transform"], rows))
        srows = [[s["gap"], s["stage"], s["js_stitched"], s["js_unrelated"], s["ratio"]] for s in r["stitching"]]
        parts.append(f"### Stitching: {what}\n\nStage taken before `gap` rotations of every boundary, the others "
                     f"after; JS (nats, mean over positions) against the honest model, and the same with that stage "
                     f"replaced by unrelated random weights.\n\n" + markdown_table(
                         ["gap", "stitched stage", "JS stitched", "JS unrelated", "ratio"], srows))
    return "\n\n".join(parts)
