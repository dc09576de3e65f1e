"""A snapshot of a run, read from the DHT: what `agora status`, the demo and the dashboard show."""

from __future__ import annotations

import time

from hivemind import DHT
from rich.table import Table

from agora.config import Manifest
from agora.swarm.records import read_subkeys, read_swarm, trainers_key
from agora.swarm.routing import stage_capacity, typical_throughput


def swarm_status(dht: DHT, manifest: Manifest) -> dict:
    """Stages with their peers, the bottleneck stage, swarm tokens/s and the trainers' accounting."""
    swarm = read_swarm(dht, manifest.run_id, manifest.n_stages, manifest.hash)
    typical = typical_throughput(swarm)
    caps = [stage_capacity(stage, typical) if stage else 0.0 for stage in swarm]
    trainers = [
        v for v in read_subkeys(dht, trainers_key(manifest.run_id)).values()
        if isinstance(v, dict) and v.get("manifest_hash") == manifest.hash
    ]
    stages = []
    for s, recs in enumerate(swarm):
        stages.append({
            "stage": s,
            "capacity_tokens_per_s": caps[s],
            "peers": [
                {"peer_id": r.peer_id, "short_id": r.peer_id[-8:], "state": r.state, "throughput": r.throughput,
                 "step": r.step, "samples": r.samples, "queue": r.queue, "metrics": r.metrics}
                for r in sorted(recs, key=lambda r: r.peer_id)
            ],
        })
    bottleneck = min(range(len(caps)), key=lambda s: caps[s]) if caps else None
    counts: dict[str, int] = {}
    for t in trainers:
        for k, v in (t.get("microbatches") or {}).items():
            counts[k] = counts.get(k, 0) + int(v)
    return {
        "run_id": manifest.run_id,
        "manifest_hash": manifest.hash,
        "time": time.time(),
        "stages": stages,
        "bottleneck_stage": bottleneck,
        "trainers": trainers,
        "tokens": sum(int(t.get("tokens", 0)) for t in trainers),
        "microbatches": counts,
    }


def render_status(snap: dict) -> Table:
    table = Table(title=f"run {snap['run_id']} (manifest {snap['manifest_hash']})")
    for col in ("stage", "peer", "state", "tokens/s", "step", "queue", "fwd", "bwd", "rejected"):
        table.add_column(col)
    for stage in snap["stages"]:
        mark = " (bottleneck)" if stage["stage"] == snap["bottleneck_stage"] else ""
        if not stage["peers"]:
            table.add_row(f"{stage['stage']}{mark}", "-", "[red]no peers[/red]", "", "", "", "", "", "")
        for p in stage["peers"]:
            m = p.get("metrics") or {}
            table.add_row(
                f"{stage['stage']}{mark}", p["short_id"], p["state"], f"{p['throughput']:.0f}", str(p["step"]),
                str(p["queue"]), str(m.get("forward", "")), str(m.get("backward", "")), str(m.get("rejected", "")),
            )
    mb = snap["microbatches"]
    table.caption = (
        f"{len(snap['trainers'])} trainer(s), {snap['tokens']} tokens; microbatches submitted "
        f"{mb.get('submitted', 0)}, completed {mb.get('completed', 0)}, retried {mb.get('retried', 0)}, "
        f"abandoned {mb.get('abandoned', 0)}"
    )
    return table
