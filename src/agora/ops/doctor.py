"""``agora doctor``: the things that break a join, checked one by one and explained in plain words.

Each check is ``ok``, ``warn`` (joining works, something is worse than it should be) or ``fail`` (a node started
like this would not serve). Network checks run only once the bootstrap answered.
"""

from __future__ import annotations

import errno
import shutil
import socket
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import psutil

from agora.config import Manifest
from agora.model import stage_memory_bytes
from agora.net.dht import Endpoint, JoinError, check_run_manifest, make_dht, visible_maddrs
from agora.net.reachability import DIRECT, UNREACHABLE, listening_port, probe
from agora.net.records import ANNOUNCE_PERIOD_S, RECORD_TTL_S, PeerState, manifest_key, read_subkeys, read_swarm, trainers_key
from agora.net.routing import drop_stale, pick_stage

OK, WARN, FAIL = "ok", "warn", "fail"
CLOCK_OK_S = 2.0  # records carry their writer's time; beyond this a peer's view of who is alive starts to slip
REACH_TIMEOUT_S = 40.0


@dataclass
class Check:
    name: str
    status: str
    detail: str


def check_port(host: str, port: int) -> Check:
    if not port:
        return Check("port", OK, "none given: the node takes a free port at start (a public node passes --port and "
                                 "--announce-host so that its address can be opened in a firewall)")
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError as err:
            why = "another process listens on it" if err.errno == errno.EADDRINUSE else (err.strerror or str(err))
            return Check("port", FAIL, f"{host}:{port} cannot be bound: {why}; choose another --port")
    return Check("port", OK, f"{host}:{port} is free")


def check_resources(manifest: Manifest, stage: Optional[int], folder: Path) -> list[Check]:
    stages = [stage] if stage is not None else list(range(manifest.n_stages))
    need = max(stage_memory_bytes(manifest, s) for s in stages)
    which = f"stage {stage}" if stage is not None else "its largest stage"
    have = psutil.virtual_memory().available
    gib = 2 ** 30
    memory = Check("memory", OK if need <= have else FAIL,
                   f"{which} needs at least {need / gib:.2f} GiB (parameters, gradients, optimizer moments); "
                   f"{have / gib:.1f} GiB available"
                   + ("" if need <= have else ": serve a smaller stage (--stage) or join a run with more stages"))
    free = shutil.disk_usage(folder).free
    disk = Check("disk", OK if free >= need else WARN,
                 f"{free / gib:.1f} GiB free in {folder}; a checkpoint of {which} takes up to {need / gib:.2f} GiB"
                 + ("" if free >= need else ": free space before passing --checkpoint-dir"))
    return [memory, disk]


def clock_skew(ages: Sequence[float]) -> Optional[float]:
    """This machine's clock minus the swarm's, estimated from how old the peers' records look (``now - updated``):
    a record is rewritten every ``ANNOUNCE_PERIOD_S``, so with agreeing clocks ages spread over [0, period]."""
    if not ages:
        return None
    return statistics.median(ages) - ANNOUNCE_PERIOD_S / 2


def check_clock(dht, manifest: Manifest) -> tuple[Check, list]:
    swarm = read_swarm(dht, manifest.run_id, manifest.n_stages, manifest.hash)
    now = time.time()
    ages = [now - r.updated for stage in swarm for r in stage if r.updated]
    ages += [now - float(v["updated"]) for v in read_subkeys(dht, trainers_key(manifest.run_id)).values()
             if isinstance(v, dict) and isinstance(v.get("updated"), (int, float))]
    skew = clock_skew(ages)
    if skew is None:
        return Check("clock", WARN, "no peer record to compare clocks with (nobody serves yet)"), swarm
    status = OK if abs(skew) <= CLOCK_OK_S else WARN if abs(skew) <= RECORD_TTL_S / 2 else FAIL
    direction = "ahead of" if skew > 0 else "behind"
    detail = f"this clock is about {abs(skew):.1f}s {direction} the swarm's (from {len(ages)} record(s))"
    if status != OK:
        detail += (f": records live {RECORD_TTL_S:g}s, so peers would see this node's as stale or from the future; "
                   f"enable time sync (e.g. `timedatectl set-ntp true`)")
    return Check("clock", status, detail), swarm


def check_manifest_in_run(dht, manifest: Manifest) -> Check:
    try:
        check_run_manifest(dht, manifest)
    except JoinError as err:
        return Check("run manifest", FAIL, str(err))
    if not read_subkeys(dht, manifest_key(manifest.run_id)):
        return Check("run manifest", WARN, f"no peer announces a manifest for run {manifest.run_id!r} through these "
                                           f"initial peers: check that they and the manifest belong to one run")
    return Check("run manifest", OK, f"the run announces this manifest's hash {manifest.hash}")


def describe_swarm(swarm, manifest: Manifest, stage: Optional[int]) -> Check:
    live = drop_stale(swarm, max_age_s=2 * ANNOUNCE_PERIOD_S + 1.5)
    counts = [sum(r.state == PeerState.SERVING.value for r in recs) for recs in live]
    text = ", ".join(f"stage {s}: {n}" for s, n in enumerate(counts))
    chosen = stage if stage is not None else pick_stage(live)
    return Check("swarm", OK, f"serving peers per stage: {text}; this node would serve stage {chosen}"
                              + (" (--stage auto)" if stage is None else ""))


def run_doctor(manifest: Manifest, initial_peers: Sequence[str], endpoint: Endpoint, stage: Optional[int] = None,
               folder: Path = Path(".")) -> list[Check]:
    """Every check, in the order a join meets them."""
    checks = [Check("manifest", OK, f"run {manifest.run_id!r}, hash {manifest.hash}, {manifest.n_stages} stages")]
    if stage is not None and not 0 <= stage < manifest.n_stages:
        checks.append(Check("stage", FAIL, f"--stage {stage} does not exist: the manifest has {manifest.n_stages}"))
        stage = None
    checks.append(check_port(endpoint.host, endpoint.port))
    checks += check_resources(manifest, stage, folder)
    if not initial_peers:
        checks.append(Check("bootstrap", FAIL, "no --initial-peers: ask the run's organiser for a bootstrap address"))
        return checks
    t0 = time.monotonic()
    try:
        dht = make_dht(initial_peers, endpoint, manifest=manifest)
    except JoinError as err:
        checks.append(Check("bootstrap", FAIL, str(err)))
        return checks
    try:
        checks.append(Check("bootstrap", OK, f"joined the DHT through {len(initial_peers)} initial peer(s) in "
                                             f"{time.monotonic() - t0:.1f}s"))
        checks.append(check_manifest_in_run(dht, manifest))
        checks.append(_reachability(dht, manifest))
        clock, swarm = check_clock(dht, manifest)
        checks.append(clock)
        checks.append(describe_swarm(swarm, manifest, stage))
    finally:
        dht.shutdown()
    return checks


def _reachability(dht, manifest: Manifest) -> Check:
    try:
        result = probe(dht, manifest.run_id, listening_port(visible_maddrs(dht)), REACH_TIMEOUT_S)
    except Exception as err:  # noqa: BLE001 (our own daemon: report it, do not crash the report)
        return Check("reachability", WARN, f"could not ask peers to connect back: {err!r}")
    if result.status == DIRECT:
        return Check("reachability", OK, f"direct: {result.explain()}")
    if result.status == UNREACHABLE:
        return Check("reachability", WARN, f"relayed: {result.explain()}. Meanwhile `agora node` (--reachability "
                                           f"auto or relay) serves over connections it opens to the peers that call "
                                           f"it; an unreachable peer in an adjacent stage cannot reach it; "
                                           f"--reachability public would refuse to start")
    return Check("reachability", WARN, f"unknown: {result.explain()}")
