"""``agora bench links``: training over capped links, subspace against dense boundaries, in wall-clock time.

For every link rate and every kind of boundary, the local swarm trains exactly ``steps`` optimizer steps' worth of
tokens with every peer's uplink capped, validating on the same held-out batches every ``eval_every`` steps and at
the end. Reported per run: the time from the trainer's start to each optimizer step (read from the swarm's
records about once a second), the validation loss against that time (and a plot of both), whether the replicas'
averaging rounds completed, and what the nodes did when they did not (local steps, state re-downloads).

The kernel backend (root with network namespaces) puts each peer in its own namespace behind ``tc tbf``, so the
DHT and the replicas' averaging share the cap with the activations; the in-transport backend throttles only the
tensor RPCs. The result records which one ran and why. Why it exists and what it found: README, "Capped links".
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from agora.bench.common import markdown_table, write_result
from agora.lab.demo import DemoOptions, LinkOptions, StopRule, SwarmShape, demo_manifest, plan_links, run_demo
from agora.lab.demo_summary import trainer_summaries
from agora.lab.train_local import tokens_per_step

BOUNDARIES = ("subspace", "dense")


@dataclass(frozen=True)
class LinksOptions:
    """``preset`` split into ``stages`` x ``replicas`` nodes, one trainer with ``in_flight`` microbatches in
    flight, trained ``steps`` optimizer steps' worth of tokens at each rate of ``mbps`` (Mbit/s per peer uplink)
    with each kind of ``boundaries``; validated on ``val_batches`` held-out microbatches every ``eval_every``
    steps and at the end; ``averaging``: the replicas' scheme (None: the preset's); ``link_backend``: auto,
    netns or transport; each run gives up after ``timeout_s``."""

    preset: str = "small"
    stages: int = 3
    replicas: int = 2
    in_flight: int = 4
    mbps: tuple[float, ...] = (4.0, 20.0)
    boundaries: tuple[str, ...] = BOUNDARIES
    steps: int = 6
    eval_every: int = 2
    val_batches: int = 2
    averaging: Optional[str] = None
    link_backend: str = "auto"
    timeout_s: float = 3600.0
    repeats: int = 1
    reuse: bool = False  # read runs already in OUT with the same settings instead of running them again


def run(out: Path, options: Optional[LinksOptions] = None, log: Callable[[str], None] = print) -> dict:
    """Every (rate, boundaries) run in turn; writes ``OUT/result.json``, ``OUT/result.md`` and ``OUT/links.png``."""
    opts = options or LinksOptions()
    check_links_options(opts)
    out = Path(out)
    plan = plan_links(opts.mbps[0], 0.0, opts.link_backend)  # fails here, not after the first run, when impossible
    manifest = demo_manifest(opts.preset, opts.stages, averaging=opts.averaging)
    tokens = opts.steps * tokens_per_step(manifest)
    rows = []
    for repeat in range(1, opts.repeats + 1):
        for mbps in opts.mbps:
            for residual in opts.boundaries:
                folder = out / (f"{residual}-{mbps:g}mbit" + (f"-r{repeat}" if repeat > 1 else ""))
                summary = _reused(folder, opts, residual, mbps, plan.backend, log) if opts.reuse else None
                if summary is None:
                    log(f"links: repeat {repeat}, {residual} boundaries, every uplink at {mbps:g} Mbit/s "
                        f"({plan.backend}): {opts.steps} steps, {tokens} tokens")
                    summary = run_demo(DemoOptions(
                        out=folder,
                        shape=SwarmShape(preset=opts.preset, stages=opts.stages, replicas=opts.replicas,
                                         in_flight=opts.in_flight, residual=residual, averaging=opts.averaging,
                                         val_batches=opts.val_batches, eval_every_steps=opts.eval_every),
                        stop=StopRule(steps=opts.steps, tokens=tokens, exact_tokens=True, timeout=opts.timeout_s),
                        link=LinkOptions(mbps=mbps, backend=plan.backend), live=False, sample_tokens=0))
                    (folder / RUN_KEY_FILE).write_text(json.dumps(run_key(opts, residual, mbps, plan.backend)))
                row = run_row(summary, folder, opts.steps)
                rows.append({"boundaries": residual, "mbps": mbps, "repeat": repeat, **row})
                log(f"links: {residual} at {mbps:g} Mbit/s: {opts.steps} steps in {_fmt(row['time_to_steps_s'])} s, "
                    f"validation loss {_fmt(row['val_loss'])}, averaging rounds ok/failed "
                    f"{row['rounds_ok']}/{row['rounds_failed']}, local steps {row['local_steps']}")
    result = {"preset": opts.preset, "stages": opts.stages, "replicas": opts.replicas, "in_flight": opts.in_flight,
              "steps": opts.steps, "tokens": tokens, "eval_every": opts.eval_every, "val_batches": opts.val_batches,
              "averaging": manifest.averaging.model_dump(mode="json"), "link_backend": plan.backend,
              "link_backend_reason": plan.reason, "repeats": opts.repeats, "rows": rows,
              "summary": summarize_rows(rows)}
    plot(out / "links.png", rows, opts)
    md = markdown(result)
    write_result(out, "links", result, md)
    log(md)
    return result


RUN_KEY_FILE = "links_run.json"  # in each run's folder: the settings it ran with (``--reuse`` compares them)


def run_key(opts: LinksOptions, residual: str, mbps: float, backend: str) -> dict:
    """Everything that makes two runs the same experiment."""
    return {"preset": opts.preset, "stages": opts.stages, "replicas": opts.replicas, "in_flight": opts.in_flight,
            "steps": opts.steps, "eval_every": opts.eval_every, "val_batches": opts.val_batches,
            "averaging": opts.averaging, "boundaries": residual, "mbps": mbps, "link_backend": backend}


def _reused(folder: Path, opts: LinksOptions, residual: str, mbps: float, backend: str,
            log: Callable[[str], None]) -> Optional[dict]:
    """A finished run already in ``folder`` with exactly these settings (its summary), else None."""
    try:
        key = json.loads((folder / RUN_KEY_FILE).read_text())
        summary = json.loads((folder / "summary.json").read_text())
    except (OSError, ValueError):
        return None
    if key != run_key(opts, residual, mbps, backend) or not summary.get("finished"):
        return None
    log(f"links: reusing the run in {folder}")
    return summary


def summarize_rows(rows: list[dict]) -> list[dict]:
    """Per (boundaries, rate) over its repeats: median, min and max of the time to the last step (runs whose
    slowest replica never got there counted apart), of tokens/s and of the final validation loss."""
    out = []
    for key in dict.fromkeys((r["boundaries"], r["mbps"]) for r in rows):
        mine = [r for r in rows if (r["boundaries"], r["mbps"]) == key]

        def spread(name: str) -> Optional[dict]:
            values = [r[name] for r in mine if r[name] is not None]
            if not values:
                return None
            return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}

        out.append({"boundaries": key[0], "mbps": key[1], "runs": len(mine),
                    "never_every_replica": sum(r["time_to_steps_s"] is None for r in mine),
                    "time_to_steps_s": spread("time_to_steps_s"),
                    "time_to_steps_any_replica_s": spread("time_to_steps_any_replica_s"),
                    "tokens_per_s": spread("tokens_per_s"), "val_loss": spread("val_loss"),
                    "rounds_ok": sum(r["rounds_ok"] for r in mine), "rounds_failed": sum(r["rounds_failed"] for r in mine),
                    "local_steps": sum(r["local_steps"] for r in mine)})
    return out


def check_links_options(opts: LinksOptions) -> None:
    """ValueError naming what is wrong with ``opts``."""
    if opts.steps < 1 or opts.eval_every < 1 or opts.val_batches < 1 or opts.repeats < 1:
        raise ValueError(f"steps, eval_every, val_batches and repeats must be at least 1, got {opts.steps}, "
                         f"{opts.eval_every}, {opts.val_batches}, {opts.repeats}")
    if not opts.mbps or any(not 0 < m < 1e5 for m in opts.mbps):
        raise ValueError(f"link rates must be in (0, 1e5) Mbit/s, got {list(opts.mbps)}")
    bad = [x for x in opts.boundaries if x not in BOUNDARIES]
    if bad or not opts.boundaries:
        raise ValueError(f"boundaries must be among {list(BOUNDARIES)}, got {list(opts.boundaries)}")


def step_times(timeline: list[dict], zero_s: float, steps: int, key: str = "steps") -> list[Optional[float]]:
    """Seconds from ``zero_s`` (on the demo's clock) to the first status read at which every stage's slowest
    serving replica (``key="steps_max"``: its most advanced one) had taken step k, for k = 1..``steps`` (None:
    never seen)."""
    times: list[Optional[float]] = [None] * steps
    for point in timeline:
        reached = min(point.get(key, point["steps"]), default=0)
        for k in range(1, min(reached, steps) + 1):
            if times[k - 1] is None:
                times[k - 1] = point["t"] - zero_s
    return times


def run_row(summary: dict, folder: Path, steps: int) -> dict:
    """One run's figures from its demo summary and its trainer's own summary (the bench runs one trainer)."""
    trainer = trainer_summaries(summary, folder)[0]
    curves = summary.get("val_curves") or [{}]
    zero = curves[0].get("started_s") or summary.get("train_started_s") or 0.0
    times = step_times(summary["timeline"], zero, steps)
    # Replicas of a stage can fall steps apart (failed rounds, then local steps): when the slowest never gets there,
    # the time at which some replica of every stage did is the other honest reading.
    times_any = step_times(summary["timeline"], zero, steps, key="steps_max")
    by_stage: dict[int, list[int]] = {}
    for n in summary["nodes"]:
        if n.get("stage") is not None and n.get("step") is not None:
            by_stage.setdefault(int(n["stage"]), []).append(int(n["step"]))
    nodes = summary["nodes"]
    val_points = [{"step": p["step"], "wall_s": p["wall_s"], "val_loss": p["val_loss"], "batches": p["batches"],
                   "eval_s": p["eval_s"], "final": bool(p.get("final"))} for p in trainer.get("val_curve", [])]
    done = times[-1]
    return {
        "finished": summary["finished"],
        "tokens": trainer["tokens"],
        "time_to_step_s": times,
        "time_to_steps_s": done,
        "time_to_steps_any_replica_s": times_any[-1],
        # Per stage, the slowest and the most advanced replica's step when it left (its own summary).
        "final_steps": [[min(v), max(v)] for _, v in sorted(by_stage.items())],
        "tokens_per_s": trainer["tokens"] / done if done else None,  # training window: trainer start to step N
        "val_loss": trainer.get("val_loss"),  # on the model after every step, at exactly the run's tokens
        "val_curve": val_points,
        "loss_curve": [[p["wall_s"], p["loss"]] for p in trainer.get("loss_curve", [])],
        "steps_per_stage": summary["steps_per_stage"],
        "rounds_ok": summary["rounds_ok"],
        "rounds_failed": summary["rounds_failed"],
        "local_steps": sum(n.get("local_steps", 0) for n in nodes),
        "resyncs": summary["resyncs"],
        "averaging_bytes_sent": summary["averaging_bytes_sent"],
        "bytes_per_boundary": summary["bytes_per_boundary"],
        "startup_s": zero,
        "wall_s": summary["wall_s"],
        "link_backend": summary["link"]["backend"],
        "timeline": [[p["t"] - zero, min(p["steps"], default=0)] for p in summary["timeline"]],
    }


def _fmt(v: Optional[float]) -> str:
    return "-" if v is None else f"{v:.4g}"


def markdown(result: dict) -> str:
    rows = []
    for r in result["rows"]:
        apart = [f"stage {i}: {lo}-{hi}" for i, (lo, hi) in enumerate(r["final_steps"]) if lo != hi]
        never = "never (replicas' steps " + ", ".join(apart) + ")" if apart else "never"
        rows.append([r["boundaries"], f"{r['mbps']:g} Mbit/s", r["repeat"],
                     _fmt(r["time_to_steps_s"]) if r["time_to_steps_s"] is not None else never,
                     _fmt(r["time_to_steps_any_replica_s"]), _fmt(r["tokens_per_s"]),
                     _fmt(r["val_loss"]),
                     ", ".join(f"{p['step']}: {p['val_loss']:.3f} @ {p['wall_s']:.0f}s" for p in r["val_curve"]),
                     f"{r['rounds_ok']} / {r['rounds_failed']}", r["local_steps"], r["resyncs"],
                     f"{r['averaging_bytes_sent'] / 1e6:.1f}"])
    table = markdown_table(["boundaries", "uplink", "repeat", f"s to {result['steps']} steps (every replica)",
                            "(some replica of each stage)", "tokens/s", "final val loss",
                            "validation (step: loss @ s)", "averaging rounds ok / failed", "local steps",
                            "state re-downloads", "averaging MB sent"], rows)
    return (f"`{result['preset']}`, {result['stages']} stages x {result['replicas']} replicas, one trainer with "
            f"{result['in_flight']} microbatches in flight, {result['tokens']} tokens ({result['steps']} steps) per run; "
            f"link backend {result['link_backend']} ({result['link_backend_reason']}). Times count from the "
            f"trainer's start; validation on {result['val_batches']} held-out microbatches every "
            f"{result['eval_every']} steps (while training goes on) and at the end.\n\n{table}\n\n"
            f"{_summary_markdown(result)}![](links.png)\n")


def _summary_markdown(result: dict) -> str:
    """Median (min-max) per (boundaries, rate) over the repeats; empty with one repeat."""
    if result["repeats"] < 2:
        return ""

    def spread(v: Optional[dict]) -> str:
        return "-" if v is None else f"{v['median']:.4g} ({v['min']:.4g}-{v['max']:.4g}, n={v['n']})"

    table = markdown_table(
        ["boundaries", "uplink", "runs", f"s to {result['steps']} steps, every replica", "runs where never",
         "some replica of each stage", "tokens/s", "final val loss", "rounds ok / failed", "local steps"],
        [[v["boundaries"], f"{v['mbps']:g} Mbit/s", v["runs"], spread(v["time_to_steps_s"]), v["never_every_replica"],
          spread(v["time_to_steps_any_replica_s"]), spread(v["tokens_per_s"]), spread(v["val_loss"]),
          f"{v['rounds_ok']} / {v['rounds_failed']}", v["local_steps"]] for v in result["summary"]])
    return f"Median (min-max) over the repeats:\n\n{table}\n\n"


def plot(path: Path, rows: list[dict], opts: LinksOptions) -> None:
    """Left: validation loss (markers) and training loss (thin) against wall-clock time; right: optimizer steps
    every stage has taken against wall-clock time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5))
    colours = {k: f"C{i}" for i, k in enumerate(dict.fromkeys((r["boundaries"], r["mbps"]) for r in rows))}
    for r in rows:  # one colour per (boundaries, rate); repeats share it, the first one labelled
        colour = colours[(r["boundaries"], r["mbps"])]
        label = f"{r['boundaries']}, {r['mbps']:g} Mbit/s" if r.get("repeat", 1) == 1 else None
        if r["loss_curve"]:
            xs, ys = zip(*r["loss_curve"])
            left.plot(xs, ys, color=colour, linewidth=0.6, alpha=0.5)
        if r["val_curve"]:
            left.plot([p["wall_s"] for p in r["val_curve"]], [p["val_loss"] for p in r["val_curve"]], "o-",
                      color=colour, label=label)
        if r["timeline"]:
            xs, ys = zip(*r["timeline"])
            right.step(xs, ys, where="post", color=colour, label=label)
    left.set_xlabel("seconds since the trainer started")
    left.set_ylabel("loss (markers: validation; thin: training microbatches)")
    right.set_xlabel("seconds since the trainer started")
    right.set_ylabel("optimizer steps taken by every stage")
    right.set_ylim(0, opts.steps + 0.5)
    for ax in (left, right):
        ax.legend()
        ax.grid(alpha=0.3)
    fig.suptitle(f"{opts.preset}, {opts.stages} x {opts.replicas}: capped uplinks, subspace vs dense boundaries")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
