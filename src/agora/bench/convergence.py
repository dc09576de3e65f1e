"""``agora bench convergence``: what the swarm learns per token against centralized training, one change at a time.

Per seed, centralized ``train-local`` first, then a swarm per row, every arm on exactly the centralized tokens
(``StopRule.exact_tokens``) and validated on the same held-out batches once the stages applied every sample. The
rows add one source of difference at a time to ``serial``, then all together:

  serial          one replica per stage, one microbatch in flight, ``batch.overlap_rounds`` off: centralized
                  training (whose arm streams the same shard in the same order) split into stages, with the preset's
                  wire dtype at the boundaries (``small``: bf16 coordinates and gradients, which centralized lacks)
  serial_fp32_wire  ``serial`` with an fp32 wire: no wire rounding. Not bit for bit centralized even so: the
                  boundary's projections (x U, then c U^T) round differently from the unsplit residual stream
  serial_dense    ``serial`` without the subspace (``residual.mode: dense``) and with an fp32 wire: a boundary sends the
                  residual stream itself, unchanged, so the swarm runs plain centralized training's very computation
                  (compared with a dense centralized arm)
  overlap         ``serial`` with rounds overlapping the next step's forwards (their weights one step old)
  in_flight       ``serial`` with ``in_flight`` microbatches in flight (pipelining within a step)
  replicas        ``serial`` with ``replicas`` per stage, full averaging
  powersgd        ``replicas`` averaged by PowerSGD (power iteration warm-started from the last round's Q; the
                  first ``averaging.dense_steps`` steps, 5, averaged in full)
  powersgd_no_dense  ``powersgd`` compressing from the first step (the default on 2026-12-04 before the dense steps)
  powersgd_cold   ``powersgd_no_dense`` with a fresh seeded Q every round (the default before 2026-12-04)
  sparse          ``replicas`` with sparse averaging (rho 0.05), a round every ``sparse_every`` steps (1: the default)
  diloco          ``replicas`` with DiLoCo: ``diloco_every`` inner steps per outer Nesterov step (0.7 / 0.9)
  gossip          ``diloco`` with factored gossip instead of the exact average (q = 1)
  in_flight_overlap  ``in_flight`` with the overlap on (with ``replicas_overlap``: which of the two the overlap's
                  cost in ``all_overlap`` comes from)
  replicas_overlap   ``replicas`` with the overlap on
  all             ``replicas`` per stage, ``in_flight`` in flight, the preset's averaging and overlap (as users run;
                  overlap is off by default since 2026-12-04)
  all_no_overlap  ``all`` with overlap off
  all_powersgd    ``all`` averaged by PowerSGD as in ``powersgd`` (the issue's 3% target is for the pipelined swarm)
  all_sparse      ``all`` with sparse averaging as in ``sparse``
  all_overlap     ``all`` with overlap on
  all_capped      ``all`` with every peer's link capped at ``link_mbps`` (only with ``link_mbps``)
  all_capped_no_overlap  ``all_capped`` with overlap off (is the capped gap the staleness of slow rounds?)
  all_capped_overlap     ``all_capped`` with overlap on
  upm, upm_5s     ``replicas`` with UPM: every boundary's frame rotated every ``upm_every_s`` (30 s), or every 5 s
  replicas_coordinates  ``replicas`` on a coordinate basis (``residual.basis: coordinates``: U is k of the d
                  coordinates), compared with a centralized arm on the same basis (``centralized_coordinates``)
  upm_signed      ``replicas_coordinates`` with UPM by signed permutations (``security.upm.transforms``) every
                  ``upm_every_s``: the transform that moves weights and moments by indexing only, so the swarm should
                  equal ``replicas_coordinates`` up to noise
  nadam           ``all_overlap`` with NAdam (betas 0.99, 0.999: the asynchronous-pipeline recipe) instead of AdamW
  nadam_lookahead ``nadam`` with the look-ahead: forwards while a step is pending run one predicted update ahead
  nadam_no_overlap ``nadam`` with overlap off (no forward waits on a pending step: nothing for a look-ahead to do)
  centralized_reordered  no swarm: centralized again, each step's microbatches backpropagated in reverse order.
                  The same gradient sums, rounded differently: how far apart rounding alone leaves two runs at this
                  horizon, the floor under every ratio above. (Another torch thread count is no such test: on this
                  CPU one and two threads gave bit-identical runs.)

The NAdam rows are compared with a centralized NAdam run of the same seed (``centralized_nadam``), not with AdamW's.

Reported per row: the validation loss ratio to the same seed's centralized run (median and min-max over seeds), the
steps each stage took (a centralized run takes ``steps``), the all-reduce bytes every node sent, and the
training-loss curves against tokens (plot).
The why of each row is in ``docs/AVERAGING.md`` ("Convergence parity").
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Optional

from agora.bench.common import markdown_table, write_result
from agora.config import DENSE_RESIDUAL
from agora.devices import check_precision, resolve_device
from agora.lab.demo import DemoOptions, LinkOptions, NodeExtras, StopRule, SwarmShape, demo_manifest, run_demo
from agora.lab.demo_summary import trainer_summaries
from agora.lab.train_local import train_local

# Not a swarm: the centralized arm again with its gradient sums reordered, for the float noise floor of a ratio.
NOISE_ROW = "centralized_reordered"
ROWS = ("serial", "serial_fp32_wire", "serial_dense", "overlap", "in_flight", "replicas", "powersgd",
        "powersgd_no_dense", "powersgd_cold", "sparse", "diloco", "gossip", "in_flight_overlap", "replicas_overlap",
        "all", "all_no_overlap", "all_powersgd", "all_sparse", "all_overlap", "all_capped", "all_capped_no_overlap",
        "all_capped_overlap", "upm", "upm_5s", "replicas_coordinates", "upm_signed", "nadam", "nadam_lookahead",
        "nadam_no_overlap", NOISE_ROW)
# The optimizer settings of rows that change it; their centralized arm runs with the same settings.
NADAM = {"optimizer.name": "nadam", "optimizer.betas": (0.99, 0.999)}
OPTIMIZERS = {"nadam": NADAM, "nadam_lookahead": {**NADAM, "optimizer.lookahead": True}, "nadam_no_overlap": NADAM}
# Manifest settings other rows change that only a swarm has (a centralized run has no pending step and no wire):
# such a row is compared with the centralized arm without them.
COORDINATES = {"residual.basis": "coordinates"}
OVERRIDES = {"serial_fp32_wire": {"residual.wire_dtype": "fp32"}, "replicas_coordinates": COORDINATES,
             "serial_dense": dict(DENSE_RESIDUAL),
             "upm_signed": {**COORDINATES, "security.upm.transforms": "signed_permutations"}}
SWARM_ONLY = ("optimizer.lookahead", "residual.wire_dtype", "security.upm.transforms")
# Rows that compute exactly what a centralized run does but for the boundaries' rounding (one replica, one in flight):
# each is also compared with the centralized arm whose stages round their boundaries as the swarm's do
# (``train_local(wire_boundaries=True)``), which it equals bit for bit when nothing else differs.
SAME_ROUNDING = ("serial", "serial_fp32_wire")
# The targets, as loss ratios to centralized at equal tokens (rows without one are reported, not judged):
# a row meets its target when its median ratio is within (target - 1) of 1 either way.
TARGETS = {"serial": 1.001, "serial_fp32_wire": 1.001, "serial_dense": 1.001, "all": 1.02, "all_no_overlap": 1.02,
           "all_overlap": 1.02, "powersgd": 1.03, "powersgd_no_dense": 1.03, "powersgd_cold": 1.03, "sparse": 1.03,
           "all_powersgd": 1.03, "all_sparse": 1.03}
SWARM_TIMEOUT_S = 7200


@dataclass(frozen=True)
class ConvergenceOptions:
    """``preset`` split into ``stages``, trained ``steps`` optimizer steps' worth of tokens per arm (100 steps of
    ``small`` are ~410k tokens), for each of ``seeds``; ``rows``: which of ``ROWS`` (None: all that apply);
    ``val_batches`` held-out microbatches validate every arm."""

    preset: str = "small"
    steps: int = 100
    stages: int = 3
    replicas: int = 2
    in_flight: int = 4
    seeds: tuple[int, ...] = (0, 1, 2)
    rows: Optional[tuple[str, ...]] = None
    link_mbps: Optional[float] = None
    val_batches: int = 4
    diloco_every: int = 4  # DiLoCo's inner steps per outer round in the ``diloco`` and ``gossip`` rows
    sparse_every: int = 1  # steps between the ``sparse`` row's rounds (the scheme's default; 4 before 2026-12-05)
    powersgd_rank: Optional[int] = None  # the PowerSGD rows' rank (None: the scheme's default, 4)
    powersgd_dense_every: Optional[int] = None  # the PowerSGD rows' averaging.dense_every (None: the default, 0)
    upm_every_s: float = 30.0  # seconds between rotations of a boundary in the ``upm`` row
    # Nodes move to the bottleneck stage as ``agora node`` does by default. A move mid-run changes a row's shape
    # (and its speed) at a moment that depends on timing: off for comparing rows' speeds.
    rebalance: bool = True
    # ``agora node --averaging-timeout`` of every node (None: the node's default): how long one all-reduce may take
    averaging_timeout_s: Optional[float] = None
    # Where every arm computes: the centralized runs and every node (``--device``, ``--precision``)
    device: str = "cpu"
    precision: str = "fp32"

    def node_args(self) -> Optional[list[str]]:
        args = [] if self.rebalance else ["--rebalance-every", "0"]
        if (self.device, self.precision) != ("cpu", "fp32"):
            args += ["--device", self.device, "--precision", self.precision]
        if self.averaging_timeout_s is not None:
            args += ["--averaging-timeout", f"{self.averaging_timeout_s:g}"]
        return args or None

    def row_shapes(self) -> dict[str, dict]:
        """Each row's swarm: replicas, microbatches in flight, averaging spec (None: the preset's), link cap."""
        r, f = self.replicas, self.in_flight
        rank = f",rank={self.powersgd_rank}" if self.powersgd_rank is not None else ""
        if self.powersgd_dense_every is not None:
            rank += f",dense_every={self.powersgd_dense_every}"
        sparse = f"sparse,every={self.sparse_every}"

        def row(replicas: int, in_flight: int, overlap: Optional[bool], averaging: Optional[str] = None,
                mbps: Optional[float] = None, upm: Optional[float] = None) -> dict:
            return dict(replicas=replicas, in_flight=in_flight, overlap=overlap, averaging=averaging, mbps=mbps,
                        upm_every_s=upm, overrides=None)

        shapes = {
            "serial": row(1, 1, False),
            "serial_fp32_wire": row(1, 1, False),
            "serial_dense": row(1, 1, False),
            "overlap": row(1, 1, True),
            "in_flight": row(1, f, False),
            "replicas": row(r, 1, False),
            "powersgd": row(r, 1, False, f"powersgd{rank}"),
            "powersgd_no_dense": row(r, 1, False, f"powersgd,dense_steps=0{rank}"),
            # a fresh seeded Q every round instead of the last averaged one (the default before 2026-12-04)
            "powersgd_cold": row(r, 1, False, f"powersgd,warm_start=false,dense_steps=0{rank}"),
            "sparse": row(r, 1, False, sparse),
            "diloco": row(r, 1, False, f"diloco,every={self.diloco_every}"),
            "gossip": row(r, 1, False, f"gossip,every={self.diloco_every},q=1"),
            "in_flight_overlap": row(1, f, True),
            "replicas_overlap": row(r, 1, True),
            "all": row(r, f, None),
            "all_no_overlap": row(r, f, False),
            "all_powersgd": row(r, f, None, f"powersgd{rank}"),
            "all_sparse": row(r, f, None, sparse),
            "all_overlap": row(r, f, True),
            "upm": row(r, 1, False, upm=self.upm_every_s),
            "upm_5s": row(r, 1, False, upm=5.0),
            "replicas_coordinates": row(r, 1, False),
            "upm_signed": row(r, 1, False, upm=self.upm_every_s),
            "nadam": row(r, f, True),  # the look-ahead acts only on forwards that overlap a pending step
            "nadam_lookahead": row(r, f, True),
            "nadam_no_overlap": row(r, f, False),
        }
        for name, settings in {**OPTIMIZERS, **OVERRIDES}.items():
            shapes[name]["overrides"] = settings
        if self.link_mbps is not None:
            shapes["all_capped"] = row(r, f, None, mbps=self.link_mbps)
            shapes["all_capped_no_overlap"] = row(r, f, False, mbps=self.link_mbps)
            shapes["all_capped_overlap"] = row(r, f, True, mbps=self.link_mbps)
        if self.rows is None:
            return shapes
        unknown = [name for name in self.rows if name not in shapes and name != NOISE_ROW]
        if unknown:
            raise ValueError(f"unknown or inapplicable rows {unknown}; choose from {sorted([*shapes, NOISE_ROW])} "
                             f"(all_capped rows need link_mbps)")
        return {name: shapes[name] for name in self.rows if name != NOISE_ROW}


def run(out: Path, options: Optional[ConvergenceOptions] = None, log: Callable[[str], None] = print) -> dict:
    """Every seed's centralized run and swarm rows; ``OUT/result.json``, ``OUT/result.md``, ``OUT/convergence.png``
    (rewritten after each run, so a long benchmark stopped midway keeps what it measured)."""
    opts = options or ConvergenceOptions()
    if opts.steps < 1 or not opts.seeds:
        raise ValueError("steps must be at least 1 and seeds not empty")
    check_precision(resolve_device(opts.device), opts.precision)
    shapes = opts.row_shapes()
    out = Path(out)
    runs: list[dict] = []
    for seed in opts.seeds:
        folder = out / f"seed{seed}"
        centrals: dict[tuple, dict] = {}  # rows that change the optimizer get a centralized arm of their own
        for name, shape in shapes.items():
            arm, settings = _central_arm(shape)
            key = tuple(sorted(settings.items()))
            if key not in centrals:
                centrals[key] = _centralized(folder, opts, seed, arm, settings, log)
                runs.append(centrals[key]["run"])
            same = None
            if name in SAME_ROUNDING:
                wire = _wire_dtype(opts, shape)
                wkey = ("wire_boundaries", wire)
                if wkey not in centrals:
                    centrals[wkey] = _centralized(folder, opts, seed, f"centralized_wire_{wire}",
                                                  {**settings, "residual.wire_dtype": wire}, log,
                                                  wire_boundaries=True, plain=centrals[key])
                    runs.append(centrals[wkey]["run"])
                same = centrals[wkey]
            log(f"convergence: seed {seed}: {name} ({_describe(shape)})")
            try:
                runs.append(_swarm_row(folder / name, opts, seed, name, shape, centrals[key], same))
            except Exception as err:  # one broken arm must not cost the arms and seeds after it (hours here)
                reason = f"{type(err).__name__}: {err}"
                log(f"convergence: seed {seed}: {name} FAILED ({reason}); its folder keeps the logs")
                runs.append({"seed": seed, "row": name, **shape, "failed": reason, "curve": []})
            _write(out, opts, runs)
        if opts.rows is not None and NOISE_ROW in opts.rows:
            central = centrals.get(()) or _centralized(folder, opts, seed, "centralized", {}, log)
            if () not in centrals:
                centrals[()] = central
                runs.append(central["run"])
            runs.append(_noise_row(folder, opts, seed, central, log))
            _write(out, opts, runs)
    result, md = _write(out, opts, runs)
    log(md)
    return result


def _central_arm(shape: dict) -> tuple[str, dict]:
    """The centralized arm a row is compared with (its name, its manifest settings): ``centralized``, or
    ``centralized_nadam`` for the NAdam rows, ``centralized_coordinates`` for rows on a coordinate basis,
    ``centralized_dense`` for rows without the subspace. Settings
    only a swarm has (``SWARM_ONLY``: the look-ahead, the wire dtype, the UPM transform) are left out, so such a row
    shares the centralized arm of the row without them."""
    settings = {k: v for k, v in (shape.get("overrides") or {}).items() if k not in SWARM_ONLY}
    parts = [settings.get("optimizer.name"), settings.get("residual.basis"),
             "dense" if settings.get("residual.mode") == "dense" else None]
    return "_".join(["centralized", *[str(p) for p in parts if p]]), settings


def _wire_dtype(opts: ConvergenceOptions, shape: dict) -> str:
    """The wire dtype a row's swarm sends boundaries in: its override, else the preset's."""
    override = (shape.get("overrides") or {}).get("residual.wire_dtype")
    return override or demo_manifest(opts.preset, opts.stages).residual.wire_dtype


def _centralized(folder: Path, opts: ConvergenceOptions, seed: int, arm: str, settings: dict,
                 log: Callable[[str], None], wire_boundaries: bool = False, plain: Optional[dict] = None) -> dict:
    """A centralized arm; ``wire_boundaries``: its stages round their boundaries as a swarm's do (``SAME_ROUNDING``),
    reported with its ratio to ``plain`` (the arm without)."""
    manifest = demo_manifest(opts.preset, opts.stages, seed=seed, overrides=settings or None)
    log(f"convergence: seed {seed}: {arm}, {opts.preset}, {opts.steps} steps")
    central = train_local(manifest, opts.steps, folder / arm, val_batches=opts.val_batches,
                          eval_every=max(1, opts.steps // 5), shard=(0, 1), device=opts.device,
                          precision=opts.precision, wire_boundaries=wire_boundaries)
    ratio = central["val_loss"] / plain["val_loss"] if plain is not None else 1.0
    central["run"] = {"seed": seed, "row": arm, "tokens": central["tokens"], "val_loss": central["val_loss"],
                      "loss_ratio": ratio, "steps_per_stage": {str(s): opts.steps for s in range(opts.stages)},
                      "wall_s": central["wall_s"],
                      "curve": [[h["tokens"], h["loss"]] for h in central["history"]],
                      "val_curve": [[e["tokens"], e["val_loss"]] for e in central["evals"]]}
    return central


def _noise_row(folder: Path, opts: ConvergenceOptions, seed: int, central: dict, log: Callable[[str], None]) -> dict:
    """``centralized_reordered``: the centralized arm with each step's microbatches backpropagated in reverse order,
    compared with it like a swarm row."""
    manifest = demo_manifest(opts.preset, opts.stages, seed=seed)
    log(f"convergence: seed {seed}: {NOISE_ROW} (centralized, gradients accumulated in reverse order)")
    again = train_local(manifest, opts.steps, folder / NOISE_ROW, val_batches=opts.val_batches,
                        eval_every=max(1, opts.steps // 5), shard=(0, 1), device=opts.device,
                        precision=opts.precision, reverse_accumulation=True)
    return {"seed": seed, "row": NOISE_ROW, "tokens": again["tokens"], "val_loss": again["val_loss"],
            "loss_ratio": again["val_loss"] / central["val_loss"],
            "steps_per_stage": {str(s): opts.steps for s in range(opts.stages)}, "wall_s": again["wall_s"],
            "curve": [[h["tokens"], h["loss"]] for h in again["history"]]}


def _describe(shape: dict) -> str:
    overlap = {None: "preset's overlap", True: "overlap", False: "no overlap"}[shape["overlap"]]
    link = f", links {shape['mbps']:g} Mbit/s" if shape["mbps"] else ""
    upm = f", UPM rotations every {shape['upm_every_s']:g} s" if shape.get("upm_every_s") else ""
    settings = "".join(f", {k.split('.')[-1]}={v}" for k, v in (shape.get("overrides") or {}).items())
    return (f"{shape['replicas']} replicas, {shape['in_flight']} in flight, {overlap}, "
            f"{shape['averaging'] or 'preset'} averaging{link}{upm}{settings}")


def _swarm_row(folder: Path, opts: ConvergenceOptions, seed: int, name: str, shape: dict, central: dict,
               same_rounding: Optional[dict] = None) -> dict:
    s = run_demo(DemoOptions(
        out=folder,
        shape=SwarmShape(preset=opts.preset, stages=opts.stages, replicas=shape["replicas"],
                         in_flight=shape["in_flight"], averaging=shape["averaging"], val_batches=opts.val_batches,
                         seed=seed, overlap_rounds=shape["overlap"], upm_every_s=shape.get("upm_every_s"),
                         overrides=shape.get("overrides")),
        stop=StopRule(steps=opts.steps, tokens=central["tokens"], exact_tokens=True, timeout=SWARM_TIMEOUT_S),
        link=LinkOptions(mbps=shape["mbps"]) if shape["mbps"] else LinkOptions(),
        nodes=NodeExtras(args=opts.node_args()),
        live=False, sample_tokens=0))
    if not s["finished"]:
        raise RuntimeError(f"seed {seed}, row {name}: the swarm did not train {central['tokens']} tokens within "
                           f"{SWARM_TIMEOUT_S}s; see {folder}")
    trainer_summaries(s, folder)  # raises when a trainer's tokens or validation went missing
    val = s["val_loss"]
    nodes = s.get("nodes") or []
    return {"seed": seed, "row": name, **shape,
            "tokens": s["tokens"], "val_loss": val,
            "loss_ratio": (val if val is not None else float("nan")) / central["val_loss"],
            "steps_per_stage": s["steps_per_stage"], "settled": s["settled"], "wall_s": s["wall_s"],
            "rounds_ok": s["rounds_ok"], "rounds_failed": s["rounds_failed"],
            # all-reduce payload every node put on the wire, all stages and rounds together (the averaging cost)
            "averaging_bytes": int(s.get("averaging_bytes_sent") or 0),
            "share_redirects": sum(int(n.get("share_redirects") or 0) for n in nodes),
            # steps that waited out the clip wait for another stage's gradient norm, and partial steps that
            # realigned a stage that lost part of a batch with a replica that moved or died
            "clip_fallbacks": sum(int(n.get("clip_fallbacks") or 0) for n in nodes),
            "realigned_steps": sum(int(n.get("realigned_steps") or 0) for n in nodes),
            # UPM rows: rotations applied on the first boundary (the head's output frame epoch, max over replicas)
            "rotations": max([int((n.get("upm") or {}).get("epoch_out") or 0) for n in nodes
                              if n.get("stage") == 0] or [0]),
            # look-ahead rows: training forwards that ran while their stage's step was pending (every node)
            "lookahead_forwards": sum(int(n.get("lookahead_forwards") or 0) for n in nodes),
            # Over the training window (every trainer announced .. the stages applied the last sample), as in
            # ``bench efficiency``: start-up, validation and shutdown differ between rows for reasons of their own.
            "tokens_per_s": s["tokens"] / window if (window := (s.get("cpu_window") or {}).get("seconds")) else None,
            "curve": [[p["tokens"], p["loss"]] for p in s["loss_curve"]],
            # SAME_ROUNDING rows: against the centralized arm that rounds its boundaries as this swarm does
            **({"same_rounding_ratio": (val if val is not None else float("nan")) / same_rounding["val_loss"],
                "same_rounding_step_diff": step_loss_difference(s["loss_curve"], same_rounding["train_loss"])}
               if same_rounding is not None else {})}


def step_loss_difference(curve: list[dict], central: list[float]) -> Optional[float]:
    """The largest relative difference between a swarm's per-step training loss (the mean of each step's
    microbatch losses, in the order the trainer reported them) and a centralized run's; None when the curve does not
    hold the same number of microbatches for every step (then there is no step-by-step comparison to make)."""
    if not central or not curve or len(curve) % len(central):
        return None
    per = len(curve) // len(central)
    steps = [sum(p["loss"] for p in curve[i:i + per]) / per for i in range(0, len(curve), per)]
    return max(abs(a - b) / abs(b) for a, b in zip(steps, central))


def summarize_rows(runs: list[dict], steps: int) -> dict[str, dict]:
    """Per row, over seeds: the loss ratio and validation loss (median, min, max), whether every stage of every
    seed took ``steps`` steps, and the target (if the issue set one) and whether the median meets it."""
    rows: dict[str, dict] = {}
    for name in dict.fromkeys(r["row"] for r in runs):
        failed = [{"seed": r["seed"], "reason": r["failed"]} for r in runs if r["row"] == name and r.get("failed")]
        mine = [r for r in runs if r["row"] == name and not r.get("failed")]
        if not mine:
            rows[name] = {"seeds": [], "failed": failed}
            continue
        ratios = [r["loss_ratio"] for r in mine]
        vals = [r["val_loss"] for r in mine]
        target = TARGETS.get(name)
        rows[name] = {
            "seeds": [r["seed"] for r in mine],
            "loss_ratio": _spread(ratios), "val_loss": _spread(vals),
            "steps_min": min(min(r["steps_per_stage"].values()) for r in mine),
            "steps_max": max(max(r["steps_per_stage"].values()) for r in mine),
            "equal_steps": all(set(r["steps_per_stage"].values()) == {steps} for r in mine),
            "target": target,
            # "within x%" both ways: a swarm that ends lower than centralized is as far from the same computation
            "met": None if target is None else abs(statistics.median(ratios) - 1) <= target - 1 + 1e-12,
            # swarm rows: training tokens over the swarm's wall time, and (UPM rows) rotations of boundary 0
            "tokens_per_s": _spread([r["tokens_per_s"] for r in mine]) if all(r.get("tokens_per_s") for r in mine)
            else None,
            "averaging_mb": _spread([r.get("averaging_bytes", 0) / 1e6 for r in mine]),
            "rotations": [r.get("rotations", 0) for r in mine],
            "lookahead_forwards": [r.get("lookahead_forwards", 0) for r in mine],
            "same_rounding_ratio": _spread([r["same_rounding_ratio"] for r in mine])
            if all("same_rounding_ratio" in r for r in mine) else None,
            "same_rounding_step_diff": max(r["same_rounding_step_diff"] for r in mine)
            if all(r.get("same_rounding_step_diff") is not None for r in mine) else None,
            "failed": failed,
        }
    return rows


def _spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def _write(out: Path, opts: ConvergenceOptions, runs: list[dict]) -> tuple[dict, str]:
    rows = summarize_rows(runs, opts.steps)
    md = _markdown(rows, opts)
    result = {"options": asdict(opts), "runs": runs, "rows": rows}
    write_result(out, "convergence", result, md)
    _plot(out / "convergence.png", runs, opts)
    return result, md


def _markdown(rows: dict[str, dict], opts: ConvergenceOptions) -> str:
    def fmt(v: dict, spec: str) -> str:
        return f"{v['median']:{spec}} ({v['min']:{spec}}-{v['max']:{spec}})"

    def line(name: str, r: dict) -> list:
        if not r["seeds"]:
            return [name, 0, "every seed failed"] + [""] * 9
        return [name, len(r["seeds"]), fmt(r["val_loss"], ".4f"), fmt(r["loss_ratio"], ".4f"),
                (fmt(r["same_rounding_ratio"], ".6f") + _step_note(r.get("same_rounding_step_diff")))
                if r.get("same_rounding_ratio") else "",
                "" if r["target"] is None else f"within {100 * (r['target'] - 1):g}%",
                "" if r["met"] is None else ("yes" if r["met"] else "NO"),
                f"{r['steps_min']}-{r['steps_max']}" if r["steps_min"] != r["steps_max"] else r["steps_min"],
                fmt(r["tokens_per_s"], ".0f") if r.get("tokens_per_s") else "",
                fmt(r["averaging_mb"], ".0f") if r.get("averaging_mb") and r["averaging_mb"]["max"] else "",
                ",".join(str(x) for x in r.get("rotations") or []) if any(r.get("rotations") or []) else "",
                ",".join(str(x) for x in r.get("lookahead_forwards") or [])
                if any(r.get("lookahead_forwards") or []) else ""]

    failures = "".join(f"\n- {name}, seed {f['seed']}: {f['reason']}" for name, r in rows.items()
                       for f in r.get("failed") or [])
    if failures:
        failures = f"\n\nFailed arms (left out of their rows above; their folders keep the logs):{failures}"
    table = markdown_table(
        ["row", "seeds", "val loss", "ratio to centralized", "ratio to centralized, same boundary rounding",
         "target", "met", "steps per stage",
         "tokens/s (training window)", "averaging MB sent", "rotations", "look-ahead forwards"],
        [line(name, r) for name, r in rows.items()])
    where = "" if (opts.device, opts.precision) == ("cpu", "fp32") else f" on {opts.device} in {opts.precision}"
    return (f"`{opts.preset}`{where}, {opts.stages} stages, {opts.steps} optimizer steps' tokens per arm, seeds "
            f"{list(opts.seeds)}; median (min-max) over seeds of the validation loss and of its ratio to the same "
            f"seed's centralized run (NAdam rows: its centralized NAdam run), on the same held-out batches at equal "
            f"tokens. A centralized run takes {opts.steps} steps. `centralized_wire_*`: the centralized run with "
            f"each boundary rounded as a one-replica swarm rounds it (the projection onto the subspace and the wire "
            f"dtype, both ways); its ratio is to the plain centralized run, and the rows `serial*` are also compared "
            f"with it.\n\n{table}{failures}")


def _step_note(diff: Optional[float]) -> str:
    if diff is None:
        return ""
    return "; training loss identical at every step" if diff == 0 else f"; training loss at most {diff:.1e} apart"


def _plot(path: Path, runs: list[dict], opts: ConvergenceOptions) -> None:
    """Training loss against tokens for the first seed's arms (centralized validation points as markers)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    seed = opts.seeds[0]
    fig, ax = plt.subplots(figsize=(8, 5))
    markers = iter("^svD")
    for r in [r for r in runs if r["seed"] == seed]:
        central = r["row"].startswith("centralized")
        if r["curve"]:
            xs, ys = zip(*r["curve"])
            ax.plot(xs, ys, label=r["row"], linewidth=1.8 if central else 1.0)
        if r.get("val_curve"):
            xs, ys = zip(*r["val_curve"])
            ax.plot(xs, ys, "k" + next(markers, "o"), label=f"{r['row']} validation")
    ax.set_xlabel("tokens")
    ax.set_ylabel("training loss")
    ax.set_title(f"{opts.preset}, seed {seed}: swarm rows against centralized at equal tokens")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
