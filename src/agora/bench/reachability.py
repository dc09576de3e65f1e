"""``agora bench reachability``: what a node nobody can dial costs a swarm, over capped links.

Side by side in each repeat, at equal tokens and the same uplink cap (kernel-capped namespaces): a swarm where every
peer accepts inbound connections, and the same swarm where the first replica of some stages sits behind a firewall
that drops inbound connections (a home router). Reported per run: time to N steps, tokens/s, the validation loss at
exactly the run's tokens; for the node behind the firewall (and, in the open run, the same replica as a control):
what the dial-back said, whether any of its connections crossed a circuit relay, its share of its stage's
microbatches and how long its callers' calls to it took against its sibling's. Why: README, "Join from home".
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from agora.bench.common import markdown_table, write_result
from agora.bench.links import run_row
from agora.lab.demo import DemoOptions, LinkOptions, StopRule, SwarmShape, demo_manifest, plan_links, run_demo
from agora.lab.demo_summary import trainer_summaries
from agora.lab.train_local import tokens_per_step

VARIANTS = ("open", "firewalled")


@dataclass(frozen=True)
class ReachabilityOptions:
    """``preset`` as ``stages`` x ``replicas`` nodes, one trainer with ``in_flight`` microbatches in flight, every
    uplink capped at ``mbps``; per repeat one run with every peer open and one with the first replica of each of
    ``firewalled`` stages refusing inbound connections, each ``steps`` optimizer steps' worth of tokens, validated
    on ``val_batches`` held-out microbatches every ``eval_every`` steps and at the end."""

    preset: str = "small"
    stages: int = 3
    replicas: int = 2
    in_flight: int = 4
    mbps: float = 20.0
    firewalled: tuple[int, ...] = (1,)
    steps: int = 6
    eval_every: int = 2
    val_batches: int = 2
    averaging: Optional[str] = "powersgd,rank=4"
    repeats: int = 3
    timeout_s: float = 1800.0


def check_options(opts: ReachabilityOptions) -> None:
    """ValueError naming what is wrong with ``opts``."""
    if min(opts.steps, opts.eval_every, opts.val_batches, opts.repeats, opts.in_flight) < 1:
        raise ValueError("steps, eval_every, val_batches, repeats and in_flight must be at least 1")
    if opts.replicas < 2:
        raise ValueError(f"replicas must be at least 2 (the firewalled node is compared with its sibling), "
                         f"got {opts.replicas}")
    if not 0 < opts.mbps < 1e5:
        raise ValueError(f"mbps must be in (0, 1e5), got {opts.mbps}")
    if not opts.firewalled or any(not 0 <= s < opts.stages for s in opts.firewalled):
        raise ValueError(f"firewalled stages must be among 0..{opts.stages - 1}, got {list(opts.firewalled)}")


def run(out: Path, options: Optional[ReachabilityOptions] = None, log: Callable[[str], None] = print) -> dict:
    """Every repeat's open and firewalled runs; writes ``OUT/result.json`` and ``OUT/result.md``."""
    opts = options or ReachabilityOptions()
    check_options(opts)
    out = Path(out)
    plan_links(opts.mbps, 0.0, "netns")  # fails here when namespaces are unavailable
    manifest = demo_manifest(opts.preset, opts.stages, averaging=opts.averaging)
    tokens = opts.steps * tokens_per_step(manifest)
    rows = []
    for repeat in range(1, opts.repeats + 1):
        for variant in VARIANTS:
            folder = out / f"{variant}-r{repeat}"
            behind = opts.firewalled if variant == "firewalled" else ()
            log(f"reachability: repeat {repeat}, {variant} ({opts.mbps:g} Mbit/s uplinks, first replica of stages "
                f"{list(opts.firewalled)} {'behind a firewall' if behind else 'open'}): {tokens} tokens")
            summary = run_demo(DemoOptions(
                out=folder,
                shape=SwarmShape(preset=opts.preset, stages=opts.stages, replicas=opts.replicas,
                                 in_flight=opts.in_flight, averaging=opts.averaging, val_batches=opts.val_batches,
                                 eval_every_steps=opts.eval_every),
                stop=StopRule(steps=opts.steps, tokens=tokens, exact_tokens=True, timeout=opts.timeout_s),
                link=LinkOptions(mbps=opts.mbps, backend="netns", refuse_inbound=behind), live=False,
                sample_tokens=0))
            row = {"variant": variant, "repeat": repeat, **run_row(summary, folder, opts.steps),
                   "watched": watched_nodes(summary, folder, opts.firewalled)}
            rows.append(row)
            log(f"reachability: {variant}: {opts.steps} steps in {_fmt(row['time_to_steps_s'])} s, validation loss "
                f"{_fmt(row['val_loss'])}; " + "; ".join(_watched_line(w) for w in row["watched"]))
    result = {"preset": opts.preset, "stages": opts.stages, "replicas": opts.replicas, "in_flight": opts.in_flight,
              "mbps": opts.mbps, "firewalled": list(opts.firewalled), "steps": opts.steps, "tokens": tokens,
              "averaging": manifest.averaging.model_dump(mode="json"), "repeats": opts.repeats, "rows": rows,
              "summary": summarize(rows)}
    md = markdown(result)
    write_result(out, "reachability", result, md)
    log(md)
    return result


def _counter(name: str) -> int:
    """The start order in a node's name (``node1-4`` -> 4)."""
    try:
        return int(name.rsplit("-", 1)[1])
    except (IndexError, ValueError):
        return 1 << 30


def watched_nodes(summary: dict, folder: Path, stages: tuple[int, ...]) -> list[dict]:
    """Per stage in ``stages``: the node behind the firewall (in an open run, the replica started first, the one
    that would have been) against its siblings: its dial-back answer, relayed connections, its share of the
    stage's forward passes, and its callers' mean call duration to it over that to its siblings."""
    nodes = summary["nodes"]
    callers_of: dict[int, list[dict]] = {}  # the stage's callers' per-peer views ("called" in their summaries)
    for n in nodes:
        if n.get("stage") is not None and n.get("called"):
            callers_of.setdefault(int(n["stage"]) + 1, []).append(n["called"])
    callers_of[0] = [t.get("called") or {} for t in trainer_summaries(summary, folder)]
    out = []
    for stage in stages:
        mine = sorted((n for n in nodes if n.get("stage") == stage), key=lambda n: _counter(n["name"]))
        if not mine:
            out.append({"stage": stage, "missing": True})
            continue
        watched = next((n for n in mine if n.get("firewalled")), mine[0])
        siblings = [n for n in mine if n is not watched]

        def latency(peer_ids: list[str]) -> Optional[float]:
            """Callers' mean call duration to these peers, weighted by the results each delivered to the caller."""
            total = weight = 0.0
            for view in callers_of.get(stage, []):
                for pid in peer_ids:
                    v = view.get(pid)
                    if v and v.get("latency_s") is not None and v.get("delivered"):
                        total += v["latency_s"] * v["delivered"]
                        weight += v["delivered"]
            return total / weight if weight else None

        forward = [n.get("forward") or 0 for n in mine]
        own = latency([watched["peer_id"]])
        others = latency([n["peer_id"] for n in siblings])
        connections = watched.get("connections") or {}
        out.append({"stage": stage, "name": watched["name"], "peer_id": watched["peer_id"],
                    "firewalled": bool(watched.get("firewalled")), "reachability": watched.get("reachability"),
                    "relayed_peers": connections.get("relayed_peers"), "relayed_max": connections.get("relayed_max"),
                    "connection_samples": connections.get("samples"),
                    "forward_share": (watched.get("forward") or 0) / sum(forward) if sum(forward) else None,
                    "latency_s": own, "sibling_latency_s": others,
                    "latency_ratio": own / others if own is not None and others else None})
    return out


def _spread(values: list) -> Optional[dict]:
    values = [v for v in values if v is not None]
    if not values:
        return None
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def summarize(rows: list[dict]) -> dict:
    """Per variant: medians and ranges; then firewalled over open, paired within each repeat."""
    per = {}
    for variant in VARIANTS:
        mine = [r for r in rows if r["variant"] == variant]
        watched = [w for r in mine for w in r["watched"] if not w.get("missing")]
        per[variant] = {"runs": len(mine), "finished": sum(bool(r["finished"]) for r in mine),
                        "time_to_steps_s": _spread([r["time_to_steps_s"] for r in mine]),
                        # replicas of a stage can end a step apart (a failed averaging round, open or not): the time
                        # at which some replica of every stage had the last step is the other honest reading
                        "time_to_steps_any_replica_s": _spread([r["time_to_steps_any_replica_s"] for r in mine]),
                        "never_every_replica": sum(r["time_to_steps_s"] is None for r in mine),
                        "tokens_per_s": _spread([r["tokens_per_s"] for r in mine]),
                        "val_loss": _spread([r["val_loss"] for r in mine]),
                        "forward_share": _spread([w["forward_share"] for w in watched]),
                        "latency_ratio": _spread([w["latency_ratio"] for w in watched]),
                        "relayed_connections_max": max((w["relayed_max"] or 0 for w in watched), default=0),
                        "reachability": sorted({str(w["reachability"]) for w in watched})}
    pairs = {}
    for r in rows:
        pairs.setdefault(r["repeat"], {})[r["variant"]] = r
    throughput, throughput_any, loss = [], [], []
    for pair in pairs.values():
        a, b = pair.get("open"), pair.get("firewalled")
        if a and b and a["tokens_per_s"] and b["tokens_per_s"]:
            throughput.append(b["tokens_per_s"] / a["tokens_per_s"])
        if a and b and a["time_to_steps_any_replica_s"] and b["time_to_steps_any_replica_s"]:
            throughput_any.append(a["time_to_steps_any_replica_s"] / b["time_to_steps_any_replica_s"])
        if a and b and a["val_loss"] is not None and b["val_loss"] is not None:
            loss.append(b["val_loss"] / a["val_loss"] - 1.0)
    return {**per, "throughput_ratio": _spread(throughput), "throughput_ratio_any_replica": _spread(throughput_any),
            "val_loss_rel_diff": _spread(loss)}


def _fmt(v: Optional[float], digits: int = 3) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def _watched_line(w: dict) -> str:
    if w.get("missing"):
        return f"stage {w['stage']}: no node"
    return (f"stage {w['stage']} {w['name']} ({'firewalled' if w['firewalled'] else 'open'}, dial-back "
            f"{w['reachability']}, relayed connections {w['relayed_max']}): share {_fmt(w['forward_share'], 2)}, "
            f"call latency {_fmt(w['latency_s'])} s vs sibling {_fmt(w['sibling_latency_s'])} s")


def _sp(v: Optional[dict], digits: int = 3) -> str:
    if v is None:
        return "-"
    if v["n"] == 1:
        return f"{v['median']:.{digits}f} (1 run)"
    return f"{v['median']:.{digits}f} ({v['min']:.{digits}f}-{v['max']:.{digits}f})"


def markdown(result: dict) -> str:
    s = result["summary"]
    header = ["run", "finished", f"time to {result['steps']} steps (s)", "same, some replica per stage (s)",
              "tokens/s", "val loss",
              "watched node's share", "its call latency / sibling's", "dial-back", "relayed connections (max)"]
    table = [[v, f"{s[v]['finished']}/{s[v]['runs']}",
              _sp(s[v]["time_to_steps_s"], 1) + (f"; {s[v]['never_every_replica']} run(s) never every replica"
                                                 if s[v]["never_every_replica"] else ""),
              _sp(s[v]["time_to_steps_any_replica_s"], 1), _sp(s[v]["tokens_per_s"], 1),
              _sp(s[v]["val_loss"]), _sp(s[v]["forward_share"], 2), _sp(s[v]["latency_ratio"], 2),
              ", ".join(s[v]["reachability"]), s[v]["relayed_connections_max"]] for v in VARIANTS]
    lines = [f"`{result['preset']}`, {result['stages']} stages x {result['replicas']} replicas, every uplink at "
             f"{result['mbps']:g} Mbit/s (namespaces + tc tbf), {result['tokens']} tokens per run, first replica of "
             f"stages {result['firewalled']} behind a firewall that drops inbound connections in the firewalled "
             f"runs (the same replica, open, is watched in the open runs); median (min-max) of "
             f"{result['repeats']} repeats.", "", markdown_table(header, table), "",
             f"Firewalled over open, paired per repeat: tokens/s {_sp(s['throughput_ratio'])} (by the time some "
             f"replica of every stage had the last step: {_sp(s['throughput_ratio_any_replica'])}); validation loss "
             f"relative difference {_sp(s['val_loss_rel_diff'], 4)}."]
    return "\n".join(lines)
