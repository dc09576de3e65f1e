"""``agora bench chaos``: what churn costs. The same local swarm trains twice, without and with kills.

1. Clean: ``stages x replicas`` stage processes and one trainer train for ``minutes``; its token count is the budget.
2. Chaos: the same swarm trains to the same token budget while every ``kill_every`` seconds a random serving stage
   peer is SIGKILLed (never the last of its stage) and a replacement starts with ``--stage auto``.

Reported (from the demo's timeline, per-microbatch completion times, node summaries and a state download from every
replica at the end):

* optimizer steps per minute of training (slowest stage), and the ratio chaos / clean;
* time from each kill to the next microbatch through the swarm: the first microbatch *submitted after* the kill
  that completes (every microbatch crosses every stage, the killed one included), p50 and max (goal < 10 s); also
  per stage from the peers' work counters (coarser: records refresh every few seconds);
* the longest stall, the longest time without a completed microbatch (goal: none > 30 s);
* microbatches retried and abandoned;
* final validation loss, ratio chaos / clean (goal within 2%);
* the largest parameter difference between replicas of a stage at the end (goal: < 1e-6, i.e. identical).
"""

from __future__ import annotations

import statistics
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from agora.bench.common import markdown_table, write_result
from agora.lab.demo import ChaosOptions, DemoOptions, StopRule, SwarmShape, run_demo


def _p50_max(values: list[float]) -> dict:
    return {"p50": statistics.median(values) if values else None, "max": max(values) if values else None,
            "n": len(values)}


def kill_to_next_microbatch(kills: list[dict], completions: list[list[float]]) -> list[Optional[float]]:
    """Per kill: seconds until the first microbatch submitted after it completed (None if none did)."""
    out: list[Optional[float]] = []
    for k in kills:
        later = [done for submitted, done in completions if submitted >= k["t"]]
        out.append(min(later) - k["t"] if later else None)
    return out


def kill_to_stage_work(kills: list[dict], timeline: list[dict]) -> list[Optional[float]]:
    """Per kill: seconds until a surviving peer of the killed stage shows more forward work than before."""
    out: list[Optional[float]] = []
    for k in kills:
        if k.get("stage") is None:  # the bootstrap peer serves no stage
            out.append(None)
            continue
        stage, victim = k["stage"], (k.get("peer_id") or "")[-8:]
        seen: dict[str, int] = {}
        found = None
        for point in timeline:
            work = point["work"][stage] if stage < len(point.get("work", [])) else {}
            if point["t"] >= k["t"] and any(n > seen.get(p, n) for p, n in work.items() if p != victim):
                found = point["t"] - k["t"]
                break
            seen.update(work)
        out.append(found)
    return out


def longest_stall(completions: list[list[float]], start: float, end: float) -> float:
    """Longest time without a completed microbatch between the first completion and the end of training."""
    done = sorted(c[1] for c in completions if start <= c[1] <= end)
    if not done:
        return end - start
    gaps = [b - a for a, b in zip(done, done[1:])] + [end - done[-1]]
    return max(gaps)


def analyse(summary: dict) -> dict:
    """One run's figures from its demo summary, measured over training (from the trainers' start to the end)."""
    timeline = summary["timeline"]
    start = summary.get("train_started_s") or (timeline[0]["t"] if timeline else 0.0)
    end = timeline[-1]["t"] if timeline else start
    minutes = max(1e-9, (end - start) / 60)
    steps = min(timeline[-1]["steps"]) if timeline else 0
    kills = summary["chaos_kills"]
    recovery = kill_to_next_microbatch(kills, summary["completions"])
    stage_recovery = kill_to_stage_work(kills, timeline)
    divergence = summary.get("replica_divergence") or {}
    return {
        "train_minutes": (end - start) / 60,
        "tokens": summary["tokens"],
        "optimizer_steps": steps,
        # After the trainers stopped and the stages applied their last samples (the nodes' own final summaries);
        # the timeline's last point is taken while rounds are still running, so it also shows their lag.
        "steps_per_stage": [v for _, v in sorted(summary.get("steps_per_stage", {}).items(), key=lambda kv: int(kv[0]))],
        "steps_per_stage_while_training": timeline[-1]["steps"] if timeline else [],
        "steps_per_minute": steps / minutes,
        "tokens_per_s": summary["tokens"] / max(1e-9, end - start),
        "kills": len(kills),
        "kill_to_next_microbatch_s": _p50_max([r for r in recovery if r is not None]),
        "kills_without_recovery": sum(r is None for r in recovery),
        "kill_to_stage_work_s": _p50_max([r for r in stage_recovery if r is not None]),
        "longest_stall_s": longest_stall(summary["completions"], start, end),
        "microbatches": summary["microbatches"],
        "val_loss": summary["val_loss"],
        "final_loss": summary["final_loss"],
        "replica_max_abs_diff": divergence.get("max_abs_diff"),
        "replicas_settled": divergence.get("settled"),
        "rounds_failed": summary.get("rounds_failed", 0),
        "resyncs": summary.get("resyncs", 0),
        "moves": summary.get("moves", 0),
        "orphans": summary.get("chaos_orphans", 0),
        "finished": summary["finished"],
    }


@dataclass(frozen=True)
class ChaosBenchOptions:
    """The swarm (``stages x replicas`` stage nodes of ``preset``, one trainer), how long the clean run trains
    (``minutes``), how often chaos kills (``kill_every`` seconds) and how (``fault``), and the validation microbatches at
    the end."""

    minutes: float = 5.0
    preset: str = "small"
    stages: int = 3
    replicas: int = 2
    kill_every: float = 20.0
    val_batches: int = 8
    fault: str = "kill"  # "kill", "kill-main", "stop", "kill-bootstrap" or "mixed" (lab.demo.ChaosOptions)
    stop_s: float = 40.0  # how long a "stop" fault freezes its victim


def run(out: Path, options: Optional[ChaosBenchOptions] = None, log: Callable[[str], None] = print) -> dict:
    """Both runs, analysed and compared; writes ``OUT/result.json`` and ``OUT/result.md``."""
    opts = options or ChaosBenchOptions()
    out = Path(out)
    train_s = opts.minutes * 60
    log(f"[chaos] clean run: {opts.preset}, {opts.stages} stages x {opts.replicas} replicas, {opts.minutes:g} min of "
        f"training")
    clean = run_demo(_demo_options(opts, out / "clean", StopRule(steps=10**9, train_seconds=train_s,
                                                                 timeout=train_s + 900)))
    budget = clean["tokens"]
    log(f"[chaos] chaos run: kill every {opts.kill_every:g}s until {budget} tokens")
    chaos_stop = StopRule(steps=10**9, tokens=budget, timeout=4 * opts.minutes * 60 + 900)
    chaos = run_demo(_demo_options(opts, out / "chaos", chaos_stop,
                                   ChaosOptions(every_s=opts.kill_every, fault=opts.fault, stop_s=opts.stop_s)))
    a, b = analyse(clean), analyse(chaos)
    headline = _headline(a, b)
    goals = _goals(headline)
    md = _markdown(a, b, headline, goals)
    faults = dict(Counter(k.get("fault", opts.fault) for k in chaos["chaos_kills"]))
    md += (f"\nfault: {opts.fault} ({', '.join(f'{n} x {f}' for f, n in faults.items()) or 'none happened'}); helper "
           f"processes of killed peers still alive 5 s after their main process died: {chaos['chaos_orphans']}; "
           f"steps per stage at the end: clean {a['steps_per_stage']}, chaos {b['steps_per_stage']}\n")
    result = {"preset": opts.preset, "stages": opts.stages, "replicas": opts.replicas, "minutes": opts.minutes,
              "kill_every_s": opts.kill_every, "fault": opts.fault, "stop_s": opts.stop_s, "faults": faults,
              "clean": a, "chaos": b, "headline": headline, "goals": goals, "kills": chaos["chaos_kills"],
              "orphans": chaos["chaos_orphans"]}
    write_result(out, "chaos", result, md)
    log(md)
    return result


def _demo_options(opts: ChaosBenchOptions, out: Path, stop: StopRule,
                  chaos: ChaosOptions = ChaosOptions()) -> DemoOptions:
    """One of the two runs: the same swarm, no live table, replicas compared at the end."""
    shape = SwarmShape(preset=opts.preset, stages=opts.stages, replicas=opts.replicas, val_batches=opts.val_batches)
    return DemoOptions(out=out, shape=shape, stop=stop, chaos=chaos, live=False, measure_divergence=True)


def _headline(clean: dict, chaos: dict) -> dict:
    """The chaos run's figures that answer 'what does churn cost', as ratios to the clean run where it helps."""

    def ratio(key: str) -> Optional[float]:
        return chaos[key] / clean[key] if clean.get(key) and chaos.get(key) is not None else None

    recovery = chaos["kill_to_next_microbatch_s"]
    return {
        "steps_per_minute_ratio": ratio("steps_per_minute"),
        "tokens_per_s_ratio": ratio("tokens_per_s"),
        "val_loss_ratio": ratio("val_loss"),
        "kill_to_next_microbatch_p50_s": recovery["p50"],
        "kill_to_next_microbatch_max_s": recovery["max"],
        "longest_stall_s": chaos["longest_stall_s"],
        "abandoned": chaos["microbatches"].get("abandoned", 0),
        "replica_max_abs_diff": chaos["replica_max_abs_diff"],
        "kills": chaos["kills"],
        "steps_per_stage": chaos["steps_per_stage"],
        "orphans": chaos["orphans"],
    }


def _goals(headline: dict) -> dict[str, bool]:
    worst = headline["kill_to_next_microbatch_max_s"]
    loss_ratio = headline["val_loss_ratio"]
    diff = headline["replica_max_abs_diff"]
    steps = headline["steps_per_stage"]
    return {
        "kill_to_next_microbatch_under_10s": worst is not None and worst < 10.0,
        "no_stall_over_30s": headline["longest_stall_s"] <= 30.0,
        "longest_gap_under_10s": headline["longest_stall_s"] <= 10.0,  # issue #14's target with a 40 s SIGSTOP
        "steps_per_stage_within_1": bool(steps) and max(steps) - min(steps) <= 1,
        "no_orphans": headline["orphans"] == 0,
        "val_loss_within_2pct": loss_ratio is not None and loss_ratio <= 1.02,
        "replicas_identical": diff is not None and diff < 1e-6,
    }


def _markdown(clean: dict, chaos: dict, headline: dict, goals: dict[str, bool]) -> str:
    """The side-by-side table, then the ratios and which goals were met."""

    def row(name: str, key: str, fmt=lambda v: v):
        return [name, fmt(clean.get(key)), fmt(chaos.get(key))]

    md = markdown_table(["", "clean", "chaos"], [
        row("training minutes", "train_minutes"),
        row("tokens", "tokens"),
        row("optimizer steps (slowest stage)", "optimizer_steps"),
        row("steps / minute", "steps_per_minute"),
        row("tokens / s", "tokens_per_s"),
        row("kills", "kills"),
        row("kill -> next microbatch p50 / max (s)", "kill_to_next_microbatch_s", _p50_max_cell),
        row("kill -> stage work p50 / max (s)", "kill_to_stage_work_s", _p50_max_cell),
        row("longest stall (s)", "longest_stall_s"),
        row("microbatches", "microbatches", _microbatches_cell),
        row("validation loss", "val_loss"),
        row("max |param diff| between replicas", "replica_max_abs_diff"),
        row("failed averaging rounds", "rounds_failed"),
    ])
    return md + (f"\n\nresyncs: clean {clean['resyncs']}, chaos {chaos['resyncs']}; moves: clean {clean['moves']}, "
                 f"chaos {chaos['moves']}."
                 f"\n\nchaos / clean: steps/min x{_fmt(headline['steps_per_minute_ratio'])}, tokens/s "
                 f"x{_fmt(headline['tokens_per_s_ratio'])}, validation loss x{_fmt(headline['val_loss_ratio'], 4)}.\n\n"
                 + "\n".join(f"- {k}: {'yes' if v else 'NO'}" for k, v in goals.items()) + "\n")


def _p50_max_cell(d: dict) -> str:
    return "-" if d["p50"] is None else f"{d['p50']:.1f} / {d['max']:.1f} (n={d['n']})"


def _microbatches_cell(d: dict) -> str:
    return f"{d.get('completed', 0)} done, {d.get('retried', 0)} retried, {d.get('abandoned', 0)} abandoned"


def _fmt(v: Optional[float], digits: int = 2) -> str:
    return "-" if v is None else f"{v:.{digits}f}"
