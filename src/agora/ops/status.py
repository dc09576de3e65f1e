"""A snapshot of a run, read from the DHT: what `agora status`, the demo and the dashboard show.

Contribution accounting is *verified*, not self-reported: every peer publishes, under ``acks_key``, how many results
it received from each downstream peer (stage s acknowledges stage s+1 peers, trainers acknowledge head peers). A
peer's ``acknowledged`` count is the sum of what *other* publishers say about it; its own table is ignored, so
inflating one's own numbers (``claimed``, the forward count in its own stage record) changes nothing that others
vouch for.
"""

from __future__ import annotations

import math
import time
from typing import Any, Mapping, Optional

from hivemind import DHT
from rich.table import Table

from agora.config import Manifest
from agora.net.records import acks_key, bans_key, read_subkeys, read_swarm, sampled_consensus_distance, trainers_key
from agora.net.routing import stage_capacity, typical_throughput


def _count(value: Any) -> int:
    """A non-negative integer count from an untrusted DHT value, or 0 (bools, NaN, negatives and junk count 0)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return 0
    if isinstance(value, float) and not math.isfinite(value):
        return 0
    return max(0, int(value))


def acknowledged_counts(ack_tables: Mapping[str, Any], manifest_hash: str) -> dict[str, int]:
    """Results each peer delivered, as acknowledged by the peers that received them.

    ``ack_tables`` maps publisher id (the DHT subkey) to ``{"manifest_hash": ..., "acks": {peer_id: count}}``.
    Entries a publisher makes about itself are dropped (self-vouching), as are tables of other manifests and
    malformed counts. Tables expire with their publisher, so the counts cover the receivers that are still live.
    """
    totals: dict[str, int] = {}
    for publisher, table in ack_tables.items():
        if not isinstance(table, dict) or table.get("manifest_hash") != manifest_hash:
            continue
        acks = table.get("acks")
        if not isinstance(acks, dict):
            continue
        for peer, count in acks.items():
            peer = str(peer)
            if peer == str(publisher):
                continue
            n = _count(count)
            if n:
                totals[peer] = totals.get(peer, 0) + n
    return totals


def annotate_contributions(stages: list[dict], ack_tables: Mapping[str, Any], manifest_hash: str) -> None:
    """Add ``claimed`` (own forward count) and ``acknowledged`` (vouched for by others) to every peer, in place."""
    acked = acknowledged_counts(ack_tables, manifest_hash)
    for stage in stages:
        for peer in stage["peers"]:
            peer["claimed"] = _count((peer.get("metrics") or {}).get("forward", 0))
            peer["acknowledged"] = acked.get(peer["peer_id"], 0)


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
            "consensus_distance": sampled_consensus_distance(recs),  # None: fewer than two replicas at one step
            "peers": [
                {"peer_id": r.peer_id, "short_id": r.peer_id[-8:], "state": r.state, "throughput": r.throughput,
                 "step": r.step, "samples": r.samples, "queue": r.queue, "metrics": r.metrics, "addrs": r.addrs,
                 "reachability": r.reachability}
                for r in sorted(recs, key=lambda r: r.peer_id)
            ],
        })
    annotate_contributions(stages, read_subkeys(dht, acks_key(manifest.run_id)), manifest.hash)
    bans = [
        dict(v, publisher=sub) for sub, v in read_subkeys(dht, bans_key(manifest.run_id)).items()
        if isinstance(v, dict) and v.get("manifest_hash", manifest.hash) == manifest.hash
    ]
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
        "bans": bans,
        "relayed_boundaries": relayed_boundaries(stages),
    }


def relayed_boundaries(stages: list[dict]) -> list[dict]:
    """Boundaries with a peer nobody can dial on both sides: neither can open a connection to the other, so calls
    between those two fail (no relay in time, docs/TRANSPORT.md, "Reachability") and routing must use other
    replicas. One entry per such boundary: its index (between stages b and b+1) and the relayed peers on each side."""
    def relayed(stage: dict) -> list[str]:
        return [p["short_id"] for p in stage["peers"] if p.get("reachability") == "relayed"]

    out = []
    for left, right in zip(stages, stages[1:]):
        a, b = relayed(left), relayed(right)
        if a and b:
            out.append({"boundary": left["stage"], "upstream": a, "downstream": b})
    return out


def peak_memory_label(metrics: dict) -> str:
    """A peer's peak memory from its record: the GPU's (when it computes on one) and the host resident set's."""
    def size(key: str) -> Optional[float]:  # records come from other peers: anything but a finite size is ignored
        value = metrics.get(key)
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= 0
        return float(value) if ok else None

    host, device = size("host_peak_rss_bytes"), size("device_peak_bytes")
    parts = ([f"gpu {device / 2**30:.1f}G"] if device is not None else []) + (
        [f"host {host / 2**30:.1f}G"] if host is not None else [])
    return ", ".join(parts) or "-"


def render_status(snap: dict) -> Table:
    table = Table(title=f"run {snap['run_id']} (manifest {snap['manifest_hash']})")
    cols = ("stage", "peer", "state", "reached", "tokens/s", "step", "queue", "fwd", "bwd", "rejected", "claimed",
            "acked", "peak memory")
    for col in cols:
        table.add_column(col)
    for stage in snap["stages"]:
        mark = " (bottleneck)" if stage["stage"] == snap["bottleneck_stage"] else ""
        if not stage["peers"]:
            table.add_row(f"{stage['stage']}{mark}", "-", "[red]no peers[/red]", *[""] * (len(cols) - 3))
        for p in stage["peers"]:
            m = p.get("metrics") or {}
            table.add_row(
                f"{stage['stage']}{mark}", p["short_id"], p["state"], p.get("reachability") or "-",
                f"{p['throughput']:.0f}", str(p["step"]),
                str(p["queue"]), str(m.get("forward", "")), str(m.get("backward", "")), str(m.get("rejected", "")),
                str(p.get("claimed", "")), str(p.get("acknowledged", "")), peak_memory_label(m),
            )
    mb = snap["microbatches"]
    table.caption = (
        f"{len(snap['trainers'])} trainer(s), {snap['tokens']} tokens; microbatches submitted "
        f"{mb.get('submitted', 0)}, completed {mb.get('completed', 0)}, retried {mb.get('retried', 0)}, "
        f"abandoned {mb.get('abandoned', 0)}. acked = results other peers confirm receiving from this peer."
    )
    addrs = [a for st in snap["stages"] for p in st["peers"] if p["state"] == "serving" for a in p.get("addrs") or []]
    entry = next((a for a in addrs if "/127." not in a), addrs[0] if addrs else None)  # a public address first
    for flag in snap.get("relayed_boundaries") or []:
        table.caption += (f"\nBoundary {flag['boundary']}->{flag['boundary'] + 1}: relayed peers on both sides "
                          f"({', '.join(flag['upstream'])} -> {', '.join(flag['downstream'])}) cannot connect to each "
                          f"other; their traffic goes to other replicas")
    if entry:  # every serving peer is a way in: the bootstrap peer is not needed once the swarm runs
        table.caption += f"\nJoin through any serving peer, e.g. --initial-peers {entry}"
    return table
