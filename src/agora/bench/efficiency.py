"""``agora bench efficiency``: the swarm against the centralized baseline, side by side, ``repeats`` times.

Same manifest, data and token budget:
  (a) centralized: ``train-local`` with every core of the machine, ``steps`` optimizer steps;
  (b) the local swarm (stages x replicas processes + trainer + bootstrap) on the same cores, its trainer stopping
      at exactly the centralized token count (``StopRule.exact_tokens``: no in-flight microbatch carries it past),
      validated once the stages have applied every sample, on the same held-out batches.
CPU is counted over the training window only in both arms: the centralized loop (model build and validation
excluded), and for the swarm from the trainer's first announcement to the moment the stages applied its last
samples, read from outside for the whole process tree of every role -- bootstrap, nodes, trainer, the demo's own DHT
client, hivemind's DHT and averager processes, every p2pd -- before anything is stopped (``agora.lab.cpu_meter``).
Reported per repeat and as median with min-max: tokens per CPU-second and their ratio, validation loss and its
ratio; per role and per kind of process, with a compute / averaging / daemons / other breakdown.

Over capped links, compare training speed with ``agora bench links`` (time to N optimizer steps, validation loss
against wall-clock time); this benchmark once ran capped swarms too and reported their tokens/s through the
pipeline, which is not training speed.

All runs share the machine's cores, so the pooled CPU-second ratio is the fair efficiency figure; wall-clock
numbers are reported too but depend on how many processes compete for two cores.
"""

from __future__ import annotations

import os
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch

from agora.bench.common import markdown_table, write_result
from agora.devices import check_precision, resolve_device
from agora.lab.demo import DemoOptions, NodeExtras, StopRule, SwarmShape, demo_manifest, run_demo
from agora.lab.demo_summary import trainer_summaries
from agora.lab.train_local import tokens_per_step, train_local


@dataclass(frozen=True)
class EfficiencyOptions:
    """The compared runs: ``preset`` trained ``steps`` optimizer steps' worth of tokens, the swarm as ``stages x
    replicas`` stage nodes and one trainer keeping ``in_flight`` microbatches in flight, replicas averaged as
    ``averaging`` (a spec, None: the preset's); both arms validated on the same ``val_batches`` held-out
    microbatches; the pair run ``repeats`` times."""

    preset: str = "small"
    steps: int = 20
    stages: int = 3
    replicas: int = 2
    in_flight: int = 4
    averaging: Optional[str] = None
    repeats: int = 3
    val_batches: int = 4
    # Where both arms compute: the centralized run and every stage node (``--device``/``--precision``). On one GPU
    # the swarm's nodes share the card; issue #15's target is its wall tokens/s against the centralized run's.
    device: str = "cpu"
    precision: str = "fp32"


SWARM_TIMEOUT_S = 3600  # each swarm run gives up after this long


def run(out: Path, options: Optional[EfficiencyOptions] = None, log: Callable[[str], None] = print) -> dict:
    """``repeats`` x (centralized, then the swarm on the same tokens); writes ``OUT/result.json`` and ``OUT/result.md``."""
    opts = options or EfficiencyOptions()
    if opts.repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {opts.repeats}")
    out = Path(out)
    device = resolve_device(opts.device)
    check_precision(device, opts.precision)
    card = _card(device)
    manifest = demo_manifest(opts.preset, opts.stages, averaging=opts.averaging)
    scheme = _scheme_label(manifest.averaging)
    cores = os.cpu_count() or 1
    budget = opts.steps * tokens_per_step(manifest)
    runs = []
    for i in range(opts.repeats):
        folder = out / f"repeat{i + 1}"
        log(f"[efficiency] repeat {i + 1}/{opts.repeats}: centralized: {opts.preset}, {opts.steps} steps "
            f"({budget} tokens), {cores} threads, on {card} in {opts.precision}")
        central = train_local(manifest, opts.steps, folder / "centralized", val_batches=opts.val_batches,
                              threads=cores, device=str(device), precision=opts.precision)
        if device.type == "cuda":
            torch.cuda.empty_cache()  # the nodes share this card: hand back what the centralized arm's cache holds
        log(f"[efficiency] repeat {i + 1}/{opts.repeats}: swarm: {opts.stages} stages x {opts.replicas} replicas, "
            f"{central['tokens']} tokens, {scheme} averaging")
        swarm = run_demo(DemoOptions(
            out=folder / "swarm", shape=_swarm_shape(opts, val_batches=opts.val_batches),
            stop=StopRule(steps=opts.steps, tokens=central["tokens"], exact_tokens=True, timeout=SWARM_TIMEOUT_S),
            nodes=NodeExtras(args=["--device", str(device), "--precision", opts.precision]),
            live=False, sample_tokens=0))
        runs.append(compare(central, swarm, folder / "swarm"))
    result = {"preset": opts.preset, "steps": opts.steps, "stages": opts.stages, "replicas": opts.replicas,
              "in_flight": opts.in_flight, "cores": cores, "repeats": opts.repeats, "val_batches": opts.val_batches,
              "device": str(device), "card": card, "precision": opts.precision,
              "averaging": manifest.averaging.model_dump(mode="json"), "runs": runs, "summary": summarize_runs(runs)}
    md = f"On {card} ({device}) in {opts.precision}.\n\n" + _comparison_markdown(runs, result["summary"], scheme)
    write_result(out, "efficiency", result, md)
    log(md)
    return result


def compare(central: dict, swarm: dict, swarm_dir: Path) -> dict:
    """One repeat: the centralized summary and the swarm's (its trainers' own summaries read from ``swarm_dir``)
    side by side, CPU over the training window of each."""
    trainers = trainer_summaries(swarm, swarm_dir)
    window = swarm.get("cpu_window") or {}
    swarm_cpu = window.get("total_s") or float("nan")
    swarm_wall = window.get("seconds") or float("nan")
    s_val, c_val = swarm.get("val_loss"), central["val_loss"]
    row = {
        "centralized": {"tokens": central["tokens"], "wall_s": central["wall_s"], "cpu_s": central["cpu_s"],
                        "tokens_per_s": central["tokens_per_s"], "tokens_per_cpu_s": central["tokens_per_cpu_s"],
                        "val_loss": c_val, "steps": central["steps"]},
        "swarm": {"tokens": swarm["tokens"], "wall_s": swarm_wall, "cpu_s": swarm_cpu,
                  "tokens_per_s": swarm["tokens"] / swarm_wall, "tokens_per_cpu_s": swarm["tokens"] / swarm_cpu,
                  "val_loss": s_val, "val_batches_done": [t.get("val_batches_done") for t in trainers],
                  "settled": swarm.get("settled"), "finished": swarm["finished"],
                  "steps_per_stage": swarm["steps_per_stage"], "microbatches": swarm["microbatches"],
                  "rounds_ok": swarm["rounds_ok"], "rounds_failed": swarm["rounds_failed"],
                  "averaging_bytes_sent": swarm["averaging_bytes_sent"], "cpu_window": window},
    }
    row["token_overshoot"] = swarm["tokens"] - central["tokens"]
    row["ratio_tokens_per_cpu_s"] = row["swarm"]["tokens_per_cpu_s"] / central["tokens_per_cpu_s"]
    row["ratio_tokens_per_s"] = row["swarm"]["tokens_per_s"] / central["tokens_per_s"]
    row["loss_ratio"] = (s_val if s_val is not None else float("nan")) / c_val
    return row


_SPREAD = {"ratio_tokens_per_cpu_s": lambda r: r["ratio_tokens_per_cpu_s"],
           "loss_ratio": lambda r: r["loss_ratio"],
           "swarm_tokens_per_cpu_s": lambda r: r["swarm"]["tokens_per_cpu_s"],
           "centralized_tokens_per_cpu_s": lambda r: r["centralized"]["tokens_per_cpu_s"],
           "ratio_tokens_per_s": lambda r: r["ratio_tokens_per_s"]}


def summarize_runs(runs: list[dict]) -> dict:
    """Median, min and max over the repeats of the headline figures."""
    out = {}
    for name, get in _SPREAD.items():
        values = [get(r) for r in runs]
        out[name] = {"median": statistics.median(values), "min": min(values), "max": max(values)}
    out["token_overshoot_max"] = max(r["token_overshoot"] for r in runs)
    return out


def _swarm_shape(opts: EfficiencyOptions, val_batches: int = 4) -> SwarmShape:
    return SwarmShape(preset=opts.preset, stages=opts.stages, replicas=opts.replicas, in_flight=opts.in_flight,
                      averaging=opts.averaging, val_batches=val_batches)


def _card(device) -> str:
    """The accelerator's name (or ``cpu``), for the report."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def _scheme_label(a) -> str:
    """The manifest's averaging section ``a`` in a few words, e.g. ``powersgd rank 4``."""
    return {"full": "full", "powersgd": f"powersgd rank {a.rank}",
            "sparse": f"sparse rho {a.rho:g} every {a.every}",
            "diloco": f"diloco every {a.every} outer lr {a.outer_lr:g} momentum {a.outer_momentum:g}"}[a.scheme]


def _spread(v: dict, fmt: str = ".3f") -> str:
    return f"**{v['median']:{fmt}}** ({v['min']:{fmt}}-{v['max']:{fmt}})"


def _comparison_markdown(runs: list[dict], summary: dict, scheme: str) -> str:
    """Every repeat side by side, the medians, then where the swarm's CPU went."""
    rows = []
    for i, r in enumerate(runs, 1):
        c, s = r["centralized"], r["swarm"]
        rows.append([i, c["tokens"], s["tokens"], c["wall_s"], s["wall_s"], c["cpu_s"], s["cpu_s"],
                     c["tokens_per_cpu_s"], s["tokens_per_cpu_s"], f"{r['ratio_tokens_per_cpu_s']:.3f}", c["val_loss"],
                     s["val_loss"], f"{r['loss_ratio']:.4f}", "/".join(str(v) for v in s["steps_per_stage"].values())])
    md = markdown_table(["repeat", "tokens central", "tokens swarm", "wall s central", "wall s swarm",
                         "CPU s central", "CPU s swarm", "tokens/CPU-s central", "tokens/CPU-s swarm", "ratio",
                         "val loss central", "val loss swarm", "loss ratio", "swarm steps per stage"], rows)
    md += (f"\n\nOver {len(runs)} repeat(s), median (min-max): swarm / centralized tokens per CPU-second "
           f"{_spread(summary['ratio_tokens_per_cpu_s'])}; validation loss ratio (swarm / centralized, same tokens, "
           f"same held-out batches) {_spread(summary['loss_ratio'], '.4f')}; swarm tokens per "
           f"CPU-second {_spread(summary['swarm_tokens_per_cpu_s'], '.1f')}, centralized "
           f"{_spread(summary['centralized_tokens_per_cpu_s'], '.1f')}; wall-clock tokens/s ratio "
           f"{_spread(summary['ratio_tokens_per_s'])}. Largest token overshoot of the swarm: "
           f"{summary['token_overshoot_max']}. Replica averaging: {scheme}.\n")
    md += "\nWhere the swarm's CPU went (training window; drain: from when the demo saw the trainer done " \
          "until the stages had applied its last samples):\n\n"
    md += markdown_table(
        ["repeat", "window s", "total CPU s", "compute", "averaging (averager processes)", "daemons (DHT processes + p2pd, which carries every RPC)",
         "other", "drain CPU s (s)", "rounds (wall s, all nodes)", "demo main (not counted)"],
        [[i, w.get("seconds"), w.get("total_s"), *(w.get("breakdown") or {}).values(),
          f"{w.get('drain_s') or 0:.1f} ({w.get('drain_seconds') or 0:.1f})",
          f"{sum((w.get('round_wall_s') or {}).values()):.1f}", w.get("observer_main_s")]
         for i, w in ((i, r["swarm"]["cpu_window"]) for i, r in enumerate(runs, 1))])
    median_run = sorted(runs, key=lambda r: r["ratio_tokens_per_cpu_s"])[(len(runs) - 1) // 2]
    md += f"\n\nPer role and kind of process (repeat {runs.index(median_run) + 1}, the median), CPU seconds:\n\n"
    md += _per_role_table(median_run["swarm"]["cpu_window"]) + "\n"
    return md


def _per_role_table(window: dict) -> str:
    kinds = ["main", "dht", "averager", "p2pd", "other"]
    by_process = window.get("by_process") or {}
    compute = window.get("compute_by_node") or {}
    rows = [[role, *[round(k.get(kind, 0.0), 2) for kind in kinds], round(compute.get(role, 0.0), 2),
             round(sum(k.values()), 2)] for role, k in sorted(by_process.items())]
    return markdown_table(["role", *kinds, "of main: compute thread", "total"], rows)
