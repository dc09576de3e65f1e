"""``agora bench training``: AdamW, Muon and NuMuon at equal tokens on the centralized model, and what their weights
and pseudo-gradients look like to a compressor; online curvature at a spiking learning rate.

Every run is ``train-local`` on the same manifest, data order and steps, so tokens are equal by construction; only
``optimizer.name`` (and, in the curvature section, ``optimizer.lr``) changes. Measured per run: validation loss;
the stable rank ``||W||_F^2 / ||W||_2^2`` of every block matrix (mean); the validation loss after truncating every
block matrix to a quarter of its rank; and the relative residual of the best rank-4 approximation of each block
matrix's pseudo-gradient over the last ``pseudo_steps`` steps (what PowerSGD's error feedback would carry: the
best rank-4 fit is PowerSGD's fixed point, so this is a lower bound on its residual). The tracker section checks
the curvature tracker against the exact eigenvalue (dense ``eigvalsh``) on a micro model small enough for it.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Optional

import torch

from agora.bench.common import markdown_table, write_result
from agora.config import Manifest, load_manifest
from agora.data import build_datasets
from agora.lab.train_local import evaluate, train_model
from agora.optim import is_block_matrix
from agora.optim.curvature import METHODS, CurvatureTracker, tracked_parameters

OPTIMIZERS = ("adamw", "muon", "numuon")
SECTIONS = ("optimizers", "curvature", "tracker")
# The tracker section's model: the preset's architecture and data at a width whose whole preconditioned Hessian
# (~3,300 x 3,300 over the tracked parameters) fits a dense eigvalsh at every measurement.
MICRO_MODEL = {"vocab_size": 272, "d_model": 8, "n_layers": 2, "n_heads": 2, "n_kv_heads": 1, "ffn_dim": 16,
               "seq_len": 32}


@dataclass(frozen=True)
class TrainingOptions:
    preset: str = "small"
    steps: int = 60
    seeds: tuple[int, ...] = (0, 1)
    optimizers: tuple[str, ...] = OPTIMIZERS
    numuon_rank: float = 0.25
    truncate_rank: float = 0.25
    pseudo_steps: int = 10
    val_batches: int = 8
    overrides: dict = field(default_factory=dict)
    # curvature section: AdamW at the preset's learning rate and at these multiples of it, tracker every N steps
    spike_lr_factors: tuple[float, ...] = (10.0,)
    curvature_every: int = 10
    curvature_hvps: int = 3
    curvature_sequences: int = 2  # of the measurement microbatch (a Hessian-vector product costs ~2 backwards)
    # > 0: after the measurement at each of ``curvature_reference_steps`` (default: the last step), one Lanczos run
    # of this many products from the tracker's vector at the same point: the tracker's error against it
    curvature_reference_hvps: int = 0
    curvature_reference_steps: tuple[int, ...] = ()
    warmup_until: float = 0.3  # architecture warm-up rows (spiking lr): every block active at this share of steps
    # (mode steps; mode curvature runs the same schedule on a clock held while lr x lambda > 0.5 x the threshold,
    # measured every ``warmup_curvature_every`` steps: a warm-up of a few dozen steps needs more than every 10)
    warmup_curvature_every: int = 2
    curvature_method: str = "lanczos"  # the curvature section's tracker (the tracker section runs every method)
    tracker_steps: int = 150  # tracker section: AdamW steps of the micro model
    sections: tuple[str, ...] = ("optimizers", "curvature")


def _block_matrices(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    return [(n, p) for n, p in model.named_parameters() if is_block_matrix(n, p)]


def stable_rank(w: torch.Tensor) -> float:
    s = torch.linalg.svdvals(w.detach().float())
    return float((s ** 2).sum() / s[0] ** 2) if s[0] > 0 else 0.0


def rank_residual(delta: torch.Tensor, rank: int) -> tuple[float, float]:
    """(squared residual, squared norm) of the best rank-``rank`` approximation of ``delta``."""
    s = torch.linalg.svdvals(delta.detach().double())
    return float((s[rank:] ** 2).sum()), float((s ** 2).sum())


@torch.no_grad()
def truncated_loss(model: torch.nn.Module, val: list, fraction: float) -> float:
    """Validation loss with every block matrix replaced by its rank-``ceil(fraction * min side)`` SVD truncation
    (the model is restored afterwards)."""
    saved = []
    for _, p in _block_matrices(model):
        saved.append(p.detach().clone())
        u, s, vh = torch.linalg.svd(p.float(), full_matrices=False)
        k = max(1, math.ceil(fraction * min(p.shape)))
        p.copy_((u[:, :k] * s[:k]) @ vh[:k])
    loss = evaluate(model, val)
    for (_, p), w in zip(_block_matrices(model), saved):
        p.copy_(w)
    return loss


def run_optimizer(base: Manifest, name: str, seed: int, opts: TrainingOptions) -> dict:
    overrides = {"optimizer.name": name, "optimizer.total_steps": opts.steps, "seed": seed, **opts.overrides}
    if name == "numuon":
        overrides["optimizer.muon.rank"] = opts.numuon_rank
    m = base.with_overrides(**overrides)
    snapshot: dict[str, torch.Tensor] = {}

    def after_step(model, _opt, step: int) -> None:
        if step == opts.steps - 1 - opts.pseudo_steps:
            snapshot.update({n: p.detach().clone() for n, p in _block_matrices(model)})

    from agora.model import PipelineModel

    initial = {n: p.detach().clone() for n, p in _block_matrices(PipelineModel(m))}  # the seeded init, by name
    t0 = time.perf_counter()
    summary, model = train_model(m, opts.steps, val_batches=opts.val_batches, after_step=after_step)
    _, val, _ = build_datasets(m)
    val_set = val.fixed_batches(m.batch.microbatch_size, opts.val_batches)
    matrices = _block_matrices(model)
    residual = norm = 0.0
    if snapshot:
        for n, p in matrices:
            r, t = rank_residual(p.detach() - snapshot[n], 4)
            residual, norm = residual + r, norm + t
    truncated = truncated_loss(model, val_set, opts.truncate_rank)
    return {
        "optimizer": name, "seed": seed, "steps": opts.steps, "tokens": summary["tokens"],
        "val_loss": summary["val_loss"], "train_loss_last": summary["train_loss"][-1],
        "stable_rank_mean": statistics.fmean(stable_rank(p) for _, p in matrices),
        # of what training added (W - W_0): at short horizons the weights are still mostly their random init
        "update_stable_rank_mean": statistics.fmean(stable_rank(p.detach() - initial[n]) for n, p in matrices),
        "truncated_val_loss": truncated, "truncation_increase": truncated - summary["val_loss"],
        "pseudo_gradient_rank4_residual": math.sqrt(residual / norm) if norm > 0 else None,
        "wall_s": time.perf_counter() - t0, "train_wall_s": summary["wall_s"], "cpu_s": summary["cpu_s"],
    }


def count_spikes(losses: list[float], rise: float = 0.1, window: int = 5) -> int:
    """Steps whose training loss exceeds the lowest of the previous ``window`` steps by more than ``rise`` (10%):
    a loss that jumps back up instead of falling."""
    return sum(1 for t in range(window, len(losses)) if losses[t] > (1 + rise) * min(losses[t - window:t]))


def run_curvature(base: Manifest, factor: float, seed: int, opts: TrainingOptions, warmup: str = "") -> dict:
    """AdamW at ``factor`` x the preset's learning rate, with architecture warm-up ``warmup`` ("", "steps" or
    "curvature": ``training.warmup_depth.mode``), the whole model's curvature tracked every N steps on a few fixed
    training sequences with the optimizer's own second moments (``train_local.ModelCurvature``)."""
    m = base.with_overrides(**{"optimizer.name": "adamw", "optimizer.total_steps": opts.steps, "seed": seed,
                               "optimizer.lr": base.optimizer.lr * factor, **opts.overrides})
    if warmup:
        warm = {"until": opts.warmup_until, "mode": warmup}
        if warmup == "curvature":
            warm["curvature_every"] = opts.warmup_curvature_every
        m = m.with_overrides(**{"training.warmup_depth": warm})
    summary, _ = train_model(m, opts.steps, val_batches=opts.val_batches, curvature_every=opts.curvature_every,
                             curvature_hvps=opts.curvature_hvps, curvature_sequences=opts.curvature_sequences,
                             curvature_reference_hvps=opts.curvature_reference_hvps,
                             curvature_reference_steps=opts.curvature_reference_steps,
                             curvature_method=opts.curvature_method)
    c = summary["curvature"]
    train_s = summary["wall_s"] - c["seconds"] - c.get("reference_seconds", 0.0)  # the yardstick is not training
    depth = [r["depth"] for r in summary["history"]]
    full = next((r["step"] + 1 for r in summary["history"] if r["depth"] == m.model.n_layers), None)
    return {"lr": m.optimizer.lr, "factor": factor, "warmup": warmup or "no", "seed": seed,
            "val_loss": summary["val_loss"], "spikes": count_spikes(summary["train_loss"]), "alarms": c["alarms"],
            "threshold": c["threshold"], "curvature": c["values"], "train_loss": summary["train_loss"],
            "depth": depth, "all_blocks_at_step": full,
            "held_steps": (summary["warmup"] or {}).get("held_steps", 0), "reference": c.get("reference"),
            "references": c.get("references", []),
            "tracker_s": c["seconds"], "reference_s": c.get("reference_seconds", 0.0), "train_s": train_s,
            "tracker_share": c["seconds"] / max(train_s, 1e-9)}


def micro_manifest(base: Manifest, seed: int, opts: TrainingOptions) -> Manifest:
    """``base`` shrunk to ``MICRO_MODEL`` in two one-block stages (subspace k = 4 when ``base`` is subspace)."""
    changes = {f"model.{k}": v for k, v in MICRO_MODEL.items()}
    if opts.overrides.get("residual.mode", base.residual.mode) == "subspace":
        changes["residual.k"] = 4
    return base.with_overrides(**{**changes, "stages": [1, 1], "seed": seed, "optimizer.name": "adamw",
                                  "optimizer.total_steps": opts.tracker_steps, **opts.overrides})


def exact_top_eigenvalue(tracker: CurvatureTracker, loss_fn: Callable[[], torch.Tensor],
                         second_moments: list, beta2: float, step: int) -> tuple[float, float]:
    """(largest, smallest) eigenvalue of the dense ``P^-1/2 H P^-1/2`` over ``tracker``'s parameters, in float64:
    one Hessian row per unit vector (batched double backward), symmetrised, then ``eigvalsh``."""
    params = tracker.params
    scale = tracker.inverse_sqrt_preconditioner(second_moments, beta2, step).double()
    sizes, n = [p.numel() for p in params], sum(p.numel() for p in params)
    with torch.enable_grad():
        grads = torch.autograd.grad(loss_fn().reshape(()), params, create_graph=True)
        rows = []
        for lo in range(0, n, 256):
            eye = torch.zeros(min(256, n - lo), n)
            eye[torch.arange(eye.shape[0]), torch.arange(lo, lo + eye.shape[0])] = 1.0
            chunks = [c.reshape(eye.shape[0], *p.shape) for c, p in zip(eye.split(sizes, dim=1), params)]
            hv = torch.autograd.grad(grads, params, grad_outputs=chunks, retain_graph=True, is_grads_batched=True)
            rows.append(torch.cat([h.reshape(eye.shape[0], -1) for h in hv], dim=1).double())
    hessian = torch.cat(rows)
    hessian = scale[:, None] * (hessian + hessian.T) / 2 * scale[None, :]
    values = torch.linalg.eigvalsh(hessian)
    return float(values[-1]), float(values[0])


def run_tracker(base: Manifest, seed: int, opts: TrainingOptions) -> dict:
    """Every tracker method against the exact eigenvalue during one AdamW run of the micro model: after every
    ``curvature_every``-th step each method measures with ``curvature_hvps`` products from its own warm vector (the
    same start for all), on the same fixed sequences and second moments, then the dense Hessian gives the truth."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    m = micro_manifest(base, seed, opts)
    train, _, _ = build_datasets(m)
    sample = next(train.batches(m.batch.microbatch_size, seed=m.seed + 1))[:opts.curvature_sequences]
    beta2 = m.optimizer.betas[1]
    trackers: dict[str, CurvatureTracker] = {}  # made at the first measurement, on the trained model's parameters
    measurements: list[dict] = []

    def after_step(model, opt, step: int) -> None:
        if (step + 1) % opts.curvature_every:
            return
        if not trackers:
            params = tracked_parameters(list(model.named_parameters()))
            trackers.update({k: CurvatureTracker(params, hvps=opts.curvature_hvps, seed=m.seed, method=k)
                             for k in METHODS})
        reference = trackers[METHODS[0]]
        moments = [opt.state.get(p, {}).get("exp_avg_sq") for p in reference.params]
        taken = int(opt.state[reference.params[0]]["step"])
        loss = lambda: model.loss(sample[:, :-1], sample[:, 1:])  # noqa: E731
        row: dict = {"step": step + 1}
        with sdpa_kernel(SDPBackend.MATH):  # fused attention has no second derivative
            for k, tracker in trackers.items():
                row[k] = tracker.measure(loss, moments, beta2, taken)
                row[f"{k}_s"] = tracker.last_seconds
            row["exact"], row["exact_min"] = exact_top_eigenvalue(reference, loss, moments, beta2, taken)
        for k in trackers:
            row[f"{k}_error"] = abs(row[k] - row["exact"]) / abs(row["exact"])
        measurements.append(row)

    summary, _ = train_model(m, opts.tracker_steps, val_batches=1, after_step=after_step)
    n = sum(p.numel() for p in trackers[METHODS[0]].params) if trackers else 0
    out = {"seed": seed, "steps": opts.tracker_steps, "tracked_parameters": n, "measurements": measurements,
           "val_loss": summary["val_loss"], "step_s": summary["wall_s"] / opts.tracker_steps}
    second_half = [r for r in measurements if r["step"] > opts.tracker_steps // 2]
    for k in METHODS:
        errors = [r[f"{k}_error"] for r in measurements]
        late = [r[f"{k}_error"] for r in second_half]
        # the first measurement from which every later one is within 1%
        within = next((measurements[i]["step"] for i in range(len(errors)) if max(errors[i:]) < 0.01), None)
        out[k] = {"median_error": statistics.median(errors) if errors else None,
                  "second_half_max_error": max(late) if late else None,
                  "second_half_median_error": statistics.median(late) if late else None,
                  "within_1pct_from_step": within}
    return out


def _median_spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "values": values}


def run(out: Path, options: Optional[TrainingOptions] = None, log: Callable[[str], None] = print) -> dict:
    opts = options or TrainingOptions()
    base = load_manifest(opts.preset)
    runs = []
    for seed in opts.seeds if "optimizers" in opts.sections else ():
        for name in opts.optimizers:
            r = run_optimizer(base, name, seed, opts)
            runs.append(r)
            log(f"{name} seed {seed}: val {r['val_loss']:.4f}, stable rank {r['stable_rank_mean']:.2f} (of W - W0 "
                f"{r['update_stable_rank_mean']:.2f}), truncated "
                f"+{r['truncation_increase']:.4f}, rank-4 residual {r['pseudo_gradient_rank4_residual']:.3f} "
                f"({r['wall_s']:.0f}s)")
    rows, table = {}, []
    for name in opts.optimizers:
        mine = [r for r in runs if r["optimizer"] == name]
        if not mine:
            continue
        rows[name] = {k: _median_spread([r[k] for r in mine]) for k in
                      ("val_loss", "stable_rank_mean", "update_stable_rank_mean", "truncation_increase", "pseudo_gradient_rank4_residual",
                       "train_wall_s")}
    ref = rows.get("muon")
    for name, row in rows.items():
        vs_muon = (row["val_loss"]["median"] / ref["val_loss"]["median"]) if ref else None
        table.append([name, _fmt(row["val_loss"]), f"{vs_muon:.4f}" if vs_muon else "-",
                      _fmt(row["stable_rank_mean"], ".2f"), _fmt(row["update_stable_rank_mean"], ".2f"),
                      _fmt(row["truncation_increase"]),
                      _fmt(row["pseudo_gradient_rank4_residual"], ".3f"), _fmt(row["train_wall_s"], ".0f")])
    tokens = runs[0]["tokens"] if runs else 0
    curvature_runs = []
    variants = [(1.0, "")] + [(f, w) for f in opts.spike_lr_factors for w in ("", "steps", "curvature")]
    for seed in opts.seeds if "curvature" in opts.sections else ():
        for factor, warmup in variants:
            r = run_curvature(base, factor, seed, opts, warmup)
            curvature_runs.append(r)
            log(f"adamw lr {r['lr']:.3g} warm-up {r['warmup']} seed {seed}: val {r['val_loss']:.4f}, spikes "
                f"{r['spikes']}, alarms {r['alarms']}, lambda {[round(v['lambda'], 1) for v in r['curvature']]}, "
                f"all blocks at step {r['all_blocks_at_step']}, held {r['held_steps']}, tracker "
                f"{100 * r['tracker_share']:.1f}% of training time"
                + "".join(f", step {x['step']}: error {x['relative_error']:.2e} against {x['hvps']} products"
                          for x in r["references"]))
    curvature_table = []
    for factor, warmup in variants:
        mine = [r for r in curvature_runs if r["factor"] == factor and r["warmup"] == (warmup or "no")]
        if not mine:
            continue
        lams = [v["lr_x_lambda"] for r in mine for v in r["curvature"] if math.isfinite(v["lr_x_lambda"])]
        label = {"": "no", "steps": f"steps, until {opts.warmup_until:g}",
                 "curvature": f"curvature, until {opts.warmup_until:g}, hold above 0.5 x threshold, measured every "
                              f"{opts.warmup_curvature_every} steps"}[warmup]
        curvature_table.append([f"{mine[0]['lr']:.3g}", label, _fmt(_median_spread([r["val_loss"] for r in mine])),
                                sum(r["spikes"] for r in mine), sum(r["alarms"] for r in mine),
                                f"{max(lams):.1f}" if lams else "-", f"{mine[0]['threshold']:.0f}",
                                ", ".join(str(r["all_blocks_at_step"]) for r in mine) if warmup else "-",
                                sum(r["held_steps"] for r in mine) if warmup == "curvature" else "-",
                                _fmt(_median_spread([100 * r["tracker_share"] for r in mine]), ".1f")]
                               + ([", ".join(" / ".join(f"{x['relative_error']:.1e}" for x in r["references"]) or "-"
                                             for r in mine)] if opts.curvature_reference_hvps else []))
    tracker_runs = [run_tracker(base, seed, opts) for seed in (opts.seeds if "tracker" in opts.sections else ())]
    for r in tracker_runs:
        log(f"tracker seed {r['seed']}: " + ", ".join(
            f"{k} median error {r[k]['median_error']:.2e}, within 1% from step {r[k]['within_1pct_from_step']}"
            for k in METHODS))
    mode = opts.overrides.get("residual.mode", base.residual.mode)
    md = (f"`{opts.preset}` ({mode} residual), {opts.steps} steps ({tokens:,} tokens, equal for every row), seeds "
          f"{list(opts.seeds)}; median (min-max). NuMuon rank fraction {opts.numuon_rank}; truncation keeps "
          f"{opts.truncate_rank:.0%} of each block matrix's rank; the residual is that of the best rank-4 fit of the "
          f"last {opts.pseudo_steps} steps' pseudo-gradient, over all block matrices.\n\n"
          + markdown_table(["optimizer", "val loss", "vs muon", "stable rank", "stable rank of W - W0",
                            "loss increase after truncation",
                            "rank-4 residual", "train s"], table)) if table else ""
    if curvature_table:
        md += (f"\n\nCurvature (AdamW, whole model, {opts.curvature_hvps} warm-started HVPs ({opts.curvature_method}) every "
               f"{opts.curvature_every} steps on {opts.curvature_sequences} fixed training sequences; spikes: steps whose training loss rose >10% "
               f"above the lowest of the previous 5; totals over seeds {list(opts.seeds)}):\n\n"
               + markdown_table(["lr", "architecture warm-up", "val loss", "spikes", "alarms", "max lr x lambda",
                                 "threshold", "all blocks from step", "steps held", "tracker % of training time"]
                               + ([f"error vs {opts.curvature_reference_hvps} Lanczos products from the tracker's "
                                   f"vector, at steps {', '.join(map(str, opts.curvature_reference_steps or (opts.steps,)))}"]
                                  if opts.curvature_reference_hvps else []),
                                curvature_table))
    if tracker_runs:
        md += (f"\n\nTracker against the exact eigenvalue (`{opts.preset}`'s architecture and data shrunk to "
               f"{MICRO_MODEL}, 2 stages of 1 block, {tracker_runs[0]['tracked_parameters']:,} tracked parameters; "
               f"AdamW {opts.tracker_steps} steps; {opts.curvature_hvps} products every {opts.curvature_every} steps "
               f"on {opts.curvature_sequences} fixed sequences, each method from its own warm vector; exact: dense "
               f"`eigvalsh` of the preconditioned Hessian; relative error of the top eigenvalue):\n\n"
               + markdown_table(["seed", "method", "median error", f"max error, steps > {opts.tracker_steps // 2}",
                                 f"median error, steps > {opts.tracker_steps // 2}", "within 1% from step"],
                                [[r["seed"], k, f"{r[k]['median_error']:.2e}", f"{r[k]['second_half_max_error']:.2e}",
                                  f"{r[k]['second_half_median_error']:.2e}", r[k]["within_1pct_from_step"] or "never"]
                                 for r in tracker_runs for k in METHODS])
               + "\n\nPer measurement (step: exact, then each method's estimate and error):\n\n"
               + markdown_table(["seed", "step", "exact (min eigenvalue)"] + list(METHODS),
                                [[r["seed"], x["step"], f"{x['exact']:.4g} ({x['exact_min']:.3g})"]
                                 + [f"{x[k]:.4g} ({x[k + '_error']:.1e})" for k in METHODS]
                                 for r in tracker_runs for x in r["measurements"]]))
    result = {"options": {**asdict(opts), "seeds": list(opts.seeds), "optimizers": list(opts.optimizers)},
              "rows": rows, "runs": runs, "curvature_runs": curvature_runs, "tracker_runs": tracker_runs}
    write_result(out, "training", result, md)
    log(md)
    return result


def _fmt(s: dict, f: str = ".4f") -> str:
    return f"{s['median']:{f}} ({s['min']:{f}}-{s['max']:{f}})"
