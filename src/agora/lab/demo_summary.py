"""What a demo run measured: ``summary.json`` from the processes' own summaries and what the demo observed.

The demo records, precisely enough to measure recovery from chaos: kill times, a timeline of per-stage work, every
completed microbatch (submitted/completed times on the demo's clock), how each process exited and, on request, the
largest parameter difference between replicas of a stage at the end (``measure_replica_divergence``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from rich.console import Console

from agora.config import Manifest
from agora.lab.processes import Child, read_json

console = Console(stderr=True)


@dataclass
class RunRecord:
    """What the demo itself observed, on its own clock (seconds since ``t0``, a ``time.time()``)."""

    t0: float
    train_started_s: Optional[float] = None  # when the trainers were started
    wall_s: float = 0.0  # from t0 until everything was stopped
    finished: bool = False  # the stop rule held before the timeout
    events: list[str] = field(default_factory=list)  # lines shown under the live table
    kills: list[dict] = field(default_factory=list)  # one per chaos kill (see DemoRun.chaos_kill)
    timeline: list[dict] = field(default_factory=list)  # one timeline_point per status read
    divergence: Optional[dict] = None  # measure_replica_divergence's result, when asked for
    sample: Optional[dict] = None  # the trained model's continuation of a prompt (DemoRun.sample_model)


def timeline_point(snap: dict, t: float) -> dict:
    """What the demo saw at time ``t``: tokens, completed microbatches, the slowest serving replica's step per
    stage, serving peers per stage, and per-stage work counters by peer (forward calls, from their records)."""
    serving = [[p for p in st["peers"] if p["state"] == "serving"] for st in snap["stages"]]
    return {
        "t": t,
        "tokens": snap["tokens"],
        "completed": int(snap["microbatches"].get("completed", 0)),
        **_steps([[p["step"] for p in peers] for peers in serving]),
        "work": [{p["short_id"]: int((p.get("metrics") or {}).get("forward", 0)) for p in st["peers"]}
                 for st in snap["stages"]],
    }


def settling_point(swarm: list, last: dict, t: float) -> dict:
    """A timeline point read while the stages settle after the trainers stopped (``swarm``: the stage records
    per stage): the steps and serving peers as ``timeline_point`` has them, tokens and work as at the ``last``
    point (the trainers send nothing more), so the last steps of a run are on its timeline too."""
    steps = [[r.step for r in stage if r.state == "serving"] for stage in swarm]
    return {**last, "t": t, **_steps(steps), "settling": True}


def _steps(serving_steps: list[list[int]]) -> dict:
    """Per stage, from its serving replicas' steps: the slowest one's, the most advanced one's, and how many serve."""
    return {"steps": [min(s or [0]) for s in serving_steps], "steps_max": [max(s or [0]) for s in serving_steps],
            "serving": [len(s) for s in serving_steps]}


def measure_replica_divergence(dht, manifest: Manifest, settle_s: float = 45.0, timeout: float = 60.0) -> dict:
    """Largest |difference| of any parameter between the serving replicas of each stage (trainers stopped).

    Waits (up to ``settle_s``) until, per stage, every serving replica is at one step with nothing accumulated
    and no round running, then downloads each replica's state (``get_state``, ``timeout`` seconds per peer) and
    compares parameters. ``dht``: the demo's DHT client.
    """
    import asyncio

    from agora.ops.status import swarm_status

    deadline = time.time() + settle_s
    settled = 0
    while time.time() < deadline and settled < 2:
        snap = swarm_status(dht, manifest)
        ok = True
        for st in snap["stages"]:
            peers = [p for p in st["peers"] if p["state"] == "serving"]
            if len({p["step"] for p in peers}) > 1 or any(p["samples"] for p in peers):
                ok = False
        settled = settled + 1 if ok else 0
        time.sleep(1.0)
    snap = swarm_status(dht, manifest)
    return asyncio.run(_download_and_compare(dht, manifest, snap, timeout)) | {"settled": settled >= 2}


async def _download_and_compare(dht, manifest: Manifest, snap: dict, timeout: float) -> dict:
    p2p = await dht.replicate_p2p()
    stages: dict[str, dict] = {}
    for st in snap["stages"]:
        params: dict[str, dict] = {}
        steps: dict[str, int] = {}
        for p in [p for p in st["peers"] if p["state"] == "serving"]:
            reply, tensors = await _download_state(p2p, manifest, st["stage"], p, timeout)
            if reply is None:
                continue
            params[p["short_id"]] = {n: t for n, t in zip(reply["names"], tensors) if n.startswith("param/")}
            steps[p["short_id"]] = reply["step"]
        ids = sorted(params)
        diff = 0.0
        for other in ids[1:]:
            for name, ref in params[ids[0]].items():
                diff = max(diff, float((ref.float() - params[other][name].float()).abs().max()))
        stages[str(st["stage"])] = {"replicas": len(ids), "steps": steps,
                                    "max_abs_diff": diff if len(ids) > 1 else None}
    diffs = [v["max_abs_diff"] for v in stages.values() if v["max_abs_diff"] is not None]
    return {"stages": stages, "max_abs_diff": max(diffs) if diffs else None}


async def _download_state(p2p, manifest: Manifest, stage: int, peer: dict, timeout: float) -> tuple:
    """One replica's ``get_state`` reply and tensors, or (None, None) when the download failed (said on the console)."""
    from agora.net import transport
    from agora.net.state_transfer import fetch_state

    meta = {"run_id": manifest.run_id, "manifest_hash": manifest.hash, "stage": stage}
    try:
        reply, names, tensors = await fetch_state(p2p, peer["peer_id"], manifest.run_id, meta, timeout)
        return dict(reply, names=names), tensors
    except transport.RpcError as err:
        console.print(f"[yellow]state download from {peer['short_id']} failed: {err}[/yellow]")
        return None, None


def summarize(children: list[Child], manifest: Manifest, record: RunRecord, target_steps: int,
              replicas: int) -> dict:
    """The core of ``summary.json``: throughput, loss, per-stage work and what happened to every process.

    ``children``: every process the demo started (their own summaries are read from disk); ``target_steps`` and
    ``replicas``: what the demo was asked for, recorded as such.
    """
    trainers = [s for c in children if c.role == "train" and (s := read_json(c.summary))]
    nodes = [(c, s) for c in children if c.role == "node" and (s := read_json(c.summary))]
    wall = record.wall_s
    curve = _loss_curve(trainers)
    tokens = sum(t.get("tokens", 0) for t in trainers)
    per_stage = _per_stage(nodes, manifest.n_stages, wall)
    cpu = _cpu_by_process(nodes, trainers)
    val = [t["val_loss"] for t in trainers if t.get("val_loss") is not None]
    return {
        "kind": "swarm-demo",
        "run_id": manifest.run_id,
        "manifest_hash": manifest.hash,
        "stages": manifest.n_stages,
        "replicas": replicas,
        "trainers": len(trainers),
        "target_steps": target_steps,
        "tokens": tokens,
        "wall_s": wall,
        "cpu_s_total": sum(cpu.values()),
        "cpu_s_by_process": cpu,
        "tokens_per_s": tokens / wall if wall else 0.0,
        "tokens_per_cpu_s": tokens / max(1e-9, sum(cpu.values())),
        "loss_curve": curve,
        # Per trainer: its validation during training (``SwarmShape.eval_every_steps``) and at the end, ``wall_s``
        # from that trainer's start, which was ``started_s`` after the demo's (the timeline's ``t`` counts from there).
        "val_curves": [{"started_s": t["started_at"] - record.t0 if t.get("started_at") else None,
                        "points": t.get("val_curve", [])} for t in trainers],
        "first_loss": curve[0]["loss"] if curve else None,
        "final_loss": curve[-1]["loss"] if curve else None,
        "val_loss": sum(val) / len(val) if val else None,
        "steps_per_stage": per_stage["steps_per_stage"],
        "bytes_per_boundary": per_stage["bytes_per_boundary"],
        "microbatches": _microbatch_counts(trainers),
        "stage_utilisation": per_stage["stage_utilisation"],
        "staleness_mean_per_stage": per_stage["staleness_mean_per_stage"],
        "staleness_max_per_stage": per_stage["staleness_max_per_stage"],
        "curvature_per_stage": per_stage["curvature_per_stage"],  # with nodes' --curvature-every
        "rounds_ok": sum(s.get("rounds_ok", 0) for _, s in nodes),
        "rounds_failed": sum(s.get("rounds_failed", 0) for _, s in nodes),
        "averaging_scheme": manifest.averaging.scheme,
        "averaging_bytes_sent": sum(s.get("averaging_bytes_sent", 0) for _, s in nodes),
        # per node: where and in which precision it computed, its device's peak (CUDA) and host resident set
        "compute_per_node": {c.name: s.get("compute") for c, s in nodes},
        "chaos_kills": record.kills,
        "timeline": record.timeline,
        "completions": _completions(trainers, record.t0),
        "exits": {c.name: c.exit for c in children},
        "nodes": [_node_row(c, s) for c, s in nodes],
        "moves": sum(s.get("moves", 0) for _, s in nodes),
        "resyncs": sum(s.get("resyncs", 0) for _, s in nodes),
    }


def trainer_summaries(summary: dict, out: Path) -> list[dict]:
    """The summaries the trainers of a finished demo in ``out`` wrote; raises, with the end of the trainer's log,
    when one wrote none (it crashed or was killed): its tokens and validation would silently count as zero."""
    out = Path(out)
    found = []
    for name, exit_ in summary["exits"].items():
        if not name.startswith("train"):
            continue
        data = read_json(out / "procs" / f"{name}.json")
        if data is None:
            log = out / "logs" / f"{name}.log"
            tail = "\n".join(log.read_text(errors="replace").splitlines()[-15:]) if log.exists() else "(no log)"
            raise RuntimeError(f"trainer {name} wrote no summary (exit {exit_}), so its tokens and validation are "
                               f"unknown; the end of {log}:\n{tail}")
        found.append(data)
    return found


def _loss_curve(trainers: list[dict]) -> list[dict]:
    """Every trainer's loss points in wall-clock order, each with the swarm's cumulative tokens at that moment."""
    merged = [(p["wall_s"], i, p) for i, t in enumerate(trainers) for p in t.get("loss_curve", [])]
    return [{"tokens": sum_tokens, "loss": p["loss"], "wall_s": w} for w, p, sum_tokens in _cumulative(merged)]


def _microbatch_counts(trainers: list[dict]) -> dict[str, int]:
    counts = {"submitted": 0, "completed": 0, "retried": 0, "abandoned": 0}
    for t in trainers:
        for k in counts:
            counts[k] += int(t.get("microbatches", {}).get(k, 0))
    counts["hedged"] = sum(int(t.get("hedges", 0)) for t in trainers)  # sent to a second head (client/router.py)
    return counts


def _per_stage(nodes: list[tuple[Child, dict]], n_stages: int, wall: float) -> dict[str, dict]:
    """Per-stage totals over the nodes' summaries (keys are stage indices as strings, as JSON has them)."""
    bytes_per_boundary: dict[str, int] = {}
    steps_per_stage: dict[str, int] = {}
    busy: dict[str, float] = {}
    stale_sum: dict[str, int] = {}
    stale_n: dict[str, int] = {}
    stale_max: dict[str, int] = {}
    curvature: dict[str, dict] = {}
    for _, s in nodes:
        st = s["stage"]
        c = s.get("curvature")
        if c:  # the stage's nodes together: the largest lr x lambda last measured, and every alarm
            mine = curvature.setdefault(str(st), {"lr_times_value": None, "threshold": c["threshold"], "alarms": 0})
            if c.get("lr_times_value") is not None:
                mine["lr_times_value"] = max(mine["lr_times_value"] or c["lr_times_value"], c["lr_times_value"])
            mine["alarms"] += c.get("alarms", 0)
        if st < n_stages - 1:
            key = f"{st}->{st + 1}"
            bytes_per_boundary[key] = bytes_per_boundary.get(key, 0) + s.get("bytes_sent_downstream", 0)
        steps_per_stage[str(st)] = max(steps_per_stage.get(str(st), 0), s.get("step", 0))
        busy[str(st)] = busy.get(str(st), 0.0) + s["counters"].get("busy_s", 0.0)
        stale_sum[str(st)] = stale_sum.get(str(st), 0) + s["counters"].get("staleness_sum", 0)
        stale_n[str(st)] = stale_n.get(str(st), 0) + s["counters"].get("backward", 0)
        stale_max[str(st)] = max(stale_max.get(str(st), 0), s["counters"].get("staleness_max", 0))
    stage_procs = {str(s): max(1, sum(1 for c, x in nodes if x["stage"] == s)) for s in range(n_stages)}
    return {
        "steps_per_stage": steps_per_stage,
        "bytes_per_boundary": bytes_per_boundary,
        "stage_utilisation": {k: v / (wall * stage_procs[k]) for k, v in busy.items()},
        "staleness_mean_per_stage": {k: stale_sum[k] / max(1, stale_n[k]) for k in stale_sum},
        "staleness_max_per_stage": stale_max,
        "curvature_per_stage": curvature,
    }


def _cpu_by_process(nodes: list[tuple[Child, dict]], trainers: list[dict]) -> dict[str, float]:
    cpu = {c.name: s.get("cpu_s", 0.0) for c, s in nodes}
    cpu.update({f"trainer{i}": t.get("cpu_s", 0.0) for i, t in enumerate(trainers)})
    return cpu


def _node_row(child: Child, s: dict) -> dict:
    """One node's line in the summary: where it ended and how eventful its life was."""
    return {"name": child.name, "peer_id": s.get("peer_id"), "stage": s.get("stage"), "state": s.get("state"),
            "step": s.get("step"), "fingerprint": s.get("fingerprint"), "moves": s.get("moves", 0),
            "resyncs": s.get("resyncs", 0), "rounds_failed": s.get("rounds_failed", 0),
            "aborted_rounds": s.get("aborted_rounds", 0), "local_steps": s.get("local_steps", 0),
            "share_redirects": s.get("share_redirects", 0), "clip_fallbacks": s.get("clip_fallbacks", 0),
            "realigned_steps": s.get("realigned_steps", 0),
            "agreed_within_tolerance": s.get("agreed_within_tolerance", 0),
            "agreement_distance": s.get("agreement_distance"),
            "agreement_max_distance": s.get("agreement_max_distance"),
            "duplicate_microbatches": s.get("duplicate_microbatches", 0), "incoming": s.get("incoming"),
            "dropped_microbatches": s.get("dropped_microbatches", 0), "freezes": s.get("freezes", 0),
            "frozen_s": s.get("frozen_s", 0.0), "hedges_downstream": s.get("hedges_downstream", 0),
            "probe_failures": s.get("probe_failures", 0), "left_rounds": s.get("left_rounds", 0),
            "hedge_claims_lost": s.get("hedge_claims_lost", 0),
            "hedge_claims_granted": s.get("hedge_claims_granted", 0),
            "curvature": s.get("curvature"), "consensus_distance": s.get("consensus_distance"),
            "utilisation": s.get("utilisation"), "upm": s.get("upm"), "firewalled": child.firewalled,
            "lookahead_forwards": s.get("lookahead_forwards"),
            "reachability": (s.get("reachability") or {}).get("status"), "connections": s.get("connections"),
            "forward": (s.get("counters") or {}).get("forward"), "called": s.get("called")}


def _completions(trainers: list[dict], t0: Optional[float]) -> list[list[float]]:
    """Every completed microbatch as [submitted, completed] seconds on the demo's clock (sorted by completion)."""
    if t0 is None:
        return []
    out = []
    for t in trainers:
        base = t.get("started_at")
        if base is None:
            continue
        for p in t.get("loss_curve", []):
            out.append([round(base + p.get("submitted_s", p["wall_s"]) - t0, 3), round(base + p["wall_s"] - t0, 3)])
    return sorted(out, key=lambda x: x[1])


def _cumulative(merged):
    """Turn per-trainer (wall, index, point) records into swarm-wide cumulative tokens at each loss point."""
    latest: dict[int, int] = {}
    for wall_s, i, p in sorted(merged, key=lambda x: x[0]):
        latest[i] = p["tokens"]
        yield wall_s, p, sum(latest.values())
