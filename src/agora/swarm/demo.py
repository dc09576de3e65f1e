"""``agora demo``: a whole swarm on this machine, as separate OS processes on 127.0.0.1.

It starts a bootstrap peer, ``stages x replicas`` stage nodes and the trainers, trains until every stage has taken
``steps`` optimizer steps (or ``tokens`` tokens, or for ``train_seconds``), shows live progress, stops
everything cleanly, and writes ``summary.json``, ``loss.png`` and ``report.html``. Every child runs in its own
session so that it and its hivemind helper processes can be signalled and, if needed, killed as one group by PID,
never by name.

Chaos (``--chaos SECONDS``) SIGKILLs a random *serving* stage peer every SECONDS, never the last serving peer of
its stage unless asked, and starts a replacement with ``--stage auto``. Which stage a peer serves is read from the
DHT (peers started with ``--stage auto`` choose, and peers may move), never assumed from how it was started.
The summary records what happened precisely enough to measure recovery: kill times, a timeline of per-stage work,
every completed microbatch (submitted/completed times on the demo's clock), how each process exited, and on
request the largest parameter difference between replicas of a stage at the end.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

from rich.console import Console
from rich.live import Live
from rich.table import Table

from agora.config import Manifest, load_manifest

console = Console(stderr=True)


def even_split(n_layers: int, n_stages: int) -> list[int]:
    if n_stages > n_layers:
        raise ValueError(f"--stages {n_stages} is more than the model's {n_layers} layers")
    base, extra = divmod(n_layers, n_stages)
    return [base + (1 if s < extra else 0) for s in range(n_stages)]


def demo_manifest(preset: str, stages: int, residual: Optional[str] = None) -> Manifest:
    """The preset re-split into ``stages``; ``residual="dense"`` turns compression off (fp32 boundaries)."""
    m = load_manifest(preset)
    if stages != m.n_stages:
        m = m.with_overrides(stages=even_split(m.model.n_layers, stages))
    if residual == "dense":
        m = m.with_overrides(**{"residual.mode": "dense", "residual.k": None, "residual.wire_dtype": "fp32"})
    elif residual not in (None, "subspace"):
        raise ValueError(f"residual must be 'dense' or 'subspace', got {residual!r}")
    return m


@dataclass
class Child:
    role: str
    name: str
    proc: subprocess.Popen
    log: Path
    summary: Path
    stage: Optional[int] = None
    started: float = field(default_factory=time.time)
    exit: Optional[dict] = None  # {"graceful": bool, "seconds": float} once stopped or killed by the demo

    def current(self) -> Optional[dict]:
        """The child's latest self-written summary (nodes rewrite it every few seconds while serving)."""
        return read_json(self.summary)

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def signal(self, sig: int) -> None:
        if self.alive:
            try:
                os.kill(self.proc.pid, sig)
            except ProcessLookupError:
                pass

    def kill_group(self) -> None:
        """SIGKILL the child's whole session (its hivemind DHT/averager processes and p2pd included)."""
        if self.exit is None and self.alive:
            self.exit = {"graceful": False, "seconds": None}
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass


class Swarm:
    """The processes of a local swarm and how to start and stop them."""

    def __init__(self, manifest_path: Path, out: Path, threads: int = 1, extra_node_args: Optional[list[str]] = None,
                 env: Optional[dict[str, str]] = None):
        self.manifest_path = manifest_path
        self.env = env or {}
        self.out = out
        self.threads = threads
        self.extra_node_args = extra_node_args or []
        self.children: list[Child] = []
        self.maddr: Optional[str] = None
        self._counter = 0
        (out / "logs").mkdir(parents=True, exist_ok=True)
        (out / "procs").mkdir(parents=True, exist_ok=True)

    def _spawn(self, role: str, args: list[str], stage: Optional[int] = None) -> Child:
        self._counter += 1
        name = f"{role}{'' if stage is None else stage}-{self._counter}"
        log = self.out / "logs" / f"{name}.log"
        summary = self.out / "procs" / f"{name}.json"
        cmd = [sys.executable, "-m", "agora.cli", role, *args]
        if role != "bootstrap":
            cmd += ["--summary", str(summary)]
        env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS=str(self.threads), **self.env)
        proc = subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env, start_new_session=True)
        child = Child(role, name, proc, log, summary, stage)
        self.children.append(child)
        return child

    def start_bootstrap(self, timeout: float = 60.0) -> str:
        maddr_file = self.out / "bootstrap.maddr"
        maddr_file.unlink(missing_ok=True)
        child = self._spawn("bootstrap", ["--manifest", str(self.manifest_path), "--maddr-file", str(maddr_file)])
        deadline = time.time() + timeout
        while time.time() < deadline:
            if maddr_file.exists() and maddr_file.read_text().strip():
                self.maddr = maddr_file.read_text().split()[0]
                return self.maddr
            if not child.alive:
                raise RuntimeError(f"bootstrap exited early; see {child.log}")
            time.sleep(0.2)
        raise TimeoutError(f"bootstrap did not print its address within {timeout:.0f}s; see {child.log}")

    def start_node(self, stage: Optional[int]) -> Child:
        args = ["--manifest", str(self.manifest_path), "--initial-peers", self.maddr,
                "--stage", "auto" if stage is None else str(stage), "--threads", str(self.threads),
                *self.extra_node_args]
        return self._spawn("node", args, stage)

    def start_trainer(self, index: int, count: int, in_flight: int, val_batches: int,
                      max_tokens: Optional[int] = None) -> Child:
        args = ["--manifest", str(self.manifest_path), "--initial-peers", self.maddr, "--shard", f"{index}/{count}",
                "--in-flight", str(in_flight), "--val-batches", str(val_batches)]
        if max_tokens is not None:
            args += ["--max-tokens", str(max_tokens)]
        return self._spawn("train", args)

    def nodes(self, alive: bool = True) -> list[Child]:
        return [c for c in self.children if c.role == "node" and (c.alive or not alive)]

    def stop(self, children: list[Child], timeout: float) -> None:
        """SIGTERM (graceful leave), wait, then SIGKILL the process group of anything still running."""
        t0 = time.time()
        for c in children:
            c.signal(signal.SIGTERM)
        deadline = t0 + timeout
        for c in children:
            was_alive = c.exit is None
            try:
                c.proc.wait(timeout=max(0.1, deadline - time.time()))
                if was_alive:
                    c.exit = {"graceful": c.proc.returncode == 0, "seconds": time.time() - t0,
                              "returncode": c.proc.returncode}
            except subprocess.TimeoutExpired:
                console.print(f"[yellow]{c.name} did not leave within {timeout:.0f}s; killing it[/yellow]")
        for c in children:
            c.kill_group()  # also reaps hivemind helpers that outlived a graceful exit

    def shutdown(self) -> None:
        trainers = [c for c in self.children if c.role == "train"]
        self.stop(trainers, 90)
        self.stop(self.nodes(alive=False), 40)
        self.stop([c for c in self.children if c.role == "bootstrap"], 15)


def read_json(path: Path) -> Optional[dict]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def progress_table(snap: dict, steps: int, elapsed: float, events: list[str]) -> Table:
    t = Table(title=f"agora demo: {snap['run_id']}  ({elapsed:.0f}s)")
    t.add_column("stage")
    t.add_column("peers")
    t.add_column("steps (min..max)")
    t.add_column("tokens/s")
    for st in snap["stages"]:
        serving = [p for p in st["peers"] if p["state"] == "serving"]
        stp = [p["step"] for p in serving] or [0]
        t.add_row(str(st["stage"]), f"{len(serving)}/{len(st['peers'])}", f"{min(stp)}..{max(stp)} / {steps}",
                  f"{sum(p['throughput'] for p in serving):.0f}")
    losses = [tr.get("loss") for tr in snap["trainers"] if tr.get("loss") == tr.get("loss")]
    mb = snap["microbatches"]
    t.caption = (f"loss {losses[0]:.3f}" if losses else "loss -") + (
        f" | tokens {snap['tokens']} | microbatches {mb.get('completed', 0)}/{mb.get('submitted', 0)} "
        f"retried {mb.get('retried', 0)} abandoned {mb.get('abandoned', 0)}"
    ) + ("\n" + "\n".join(events[-3:]) if events else "")
    return t


def run_demo(
    preset: str = "small",
    stages: int = 3,
    replicas: int = 2,
    trainers: int = 1,
    steps: int = 30,
    out: Path = Path("runs/demo"),
    in_flight: int = 2,
    chaos: Optional[float] = None,
    chaos_last: bool = False,
    val_batches: int = 4,
    timeout: float = 1800.0,
    threads: int = 1,
    dashboard_port: Optional[int] = None,
    live: bool = True,
    on_tick: Optional[Callable[[dict], None]] = None,
    seed: int = 0,
    tokens: Optional[int] = None,
    train_seconds: Optional[float] = None,
    measure_divergence: bool = False,
    checkpoint_dir: Optional[Path] = None,
    checkpoint_every: int = 0,
    resume: Optional[Path] = None,
    node_args: Optional[list[str]] = None,
    residual: Optional[str] = None,
    link_mbps: Optional[float] = None,
    link_latency_ms: float = 0.0,
) -> dict:
    """Run a local swarm until every stage took ``steps`` steps, or the trainers reached ``tokens`` tokens, or
    ``train_seconds`` of training passed (whichever comes first); ``timeout`` (from the start) is a failure.

    ``measure_divergence``: at the end, stop the trainers, let the replicas settle and download every serving
    peer's state to report the largest parameter difference between replicas of each stage.
    ``checkpoint_dir``/``checkpoint_every``/``resume`` are passed to every node (``agora node`` options).
    ``link_mbps``/``link_latency_ms`` emulate each peer's internet link: every process throttles the tensor RPCs it
    sends (``AGORA_LINK``, see ``agora.netem``). DHT and averaging traffic is not capped; it is small here.
    """
    from agora.swarm.peer import make_dht
    from agora.swarm.status import swarm_status

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    manifest = demo_manifest(preset, stages, residual)
    manifest_path = out / "manifest.yaml"
    manifest_path.write_text(manifest.to_yaml())
    extra = list(node_args or [])
    if checkpoint_dir is not None:
        extra += ["--checkpoint-dir", str(checkpoint_dir), "--checkpoint-every", str(checkpoint_every)]
    if resume is not None:
        extra += ["--resume", str(resume)]
    env = {}
    if link_mbps is not None or link_latency_ms:
        env["AGORA_LINK"] = ",".join(
            ([f"{link_mbps:g}mbit"] if link_mbps is not None else []) + ([f"{link_latency_ms:g}ms"] if link_latency_ms else [])
        )
        console.print(f"link emulation: every peer's tensor RPCs throttled in the transport ({env['AGORA_LINK']}); "
                      f"network namespaces are not used by the demo")
    swarm = Swarm(manifest_path, out, threads=threads, extra_node_args=extra, env=env)
    rng = random.Random(seed)
    events: list[str] = []
    t0 = time.time()
    dht = None
    dash = None
    kills: list[dict] = []
    timeline: list[dict] = []
    finished = False
    divergence: Optional[dict] = None
    train_t0: Optional[float] = None
    try:
        maddr = swarm.start_bootstrap()
        dht = make_dht([maddr], client_mode=True)
        for s in range(manifest.n_stages):
            for _ in range(replicas):
                swarm.start_node(s)
        if dashboard_port is not None:
            dash = swarm._spawn("dashboard", ["--manifest", str(manifest_path), "--initial-peers", maddr,
                                              "--port", str(dashboard_port)])
            events.append(f"dashboard at http://127.0.0.1:{dashboard_port}/")
        _wait_for_layout(dht, manifest, replicas, swarm, timeout=180)
        train_t0 = time.time() - t0
        for i in range(trainers):
            swarm.start_trainer(i, trainers, in_flight, val_batches)
        next_kill = time.time() + chaos if chaos else None
        deadline = t0 + timeout
        with Live(console=console, refresh_per_second=2, transient=False) if live else _Null() as view:
            while time.time() < deadline:
                snap = swarm_status(dht, manifest)
                timeline.append(_timeline_point(snap, time.time() - t0))
                if view is not None:
                    view.update(progress_table(snap, steps, time.time() - t0, events))
                if on_tick:
                    on_tick(snap)
                if _done(snap, steps) or (tokens is not None and snap["tokens"] >= tokens) or (
                        train_seconds is not None and time.time() - t0 - train_t0 >= train_seconds):
                    finished = True
                    break
                dead = [c for c in swarm.children if c.role == "train" and not c.alive]
                if dead:
                    raise RuntimeError(f"trainer {dead[0].name} exited early; see {dead[0].log}")
                if next_kill and time.time() >= next_kill:
                    kill = _chaos_kill(swarm, snap, rng, chaos_last, events, t0)
                    if kill:
                        kills.append(kill)
                    next_kill = time.time() + chaos
                time.sleep(1.0)
        if not finished:
            events.append(f"timeout after {timeout:.0f}s")
        elif measure_divergence:
            swarm.stop([c for c in swarm.children if c.role == "train"], 90)
            divergence = measure_replica_divergence(dht, manifest)
    finally:
        if dht is not None:
            dht.shutdown()
        swarm.shutdown()
        if dash is not None:
            swarm.stop([dash], 10)
    wall = time.time() - t0
    summary = summarize(swarm, manifest, wall, steps, replicas, kills, timeline, t0)
    summary["finished"] = finished
    summary["train_started_s"] = train_t0
    summary["replica_divergence"] = divergence
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    from agora.report import write_swarm_report

    write_swarm_report(summary, out)
    return summary


class _Null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def _done(snap: dict, steps: int) -> bool:
    for st in snap["stages"]:
        serving = [p for p in st["peers"] if p["state"] == "serving"]
        if not serving or min(p["step"] for p in serving) < steps:
            return False
    return True


def _wait_for_layout(dht, manifest: Manifest, replicas: int, swarm: Swarm, timeout: float) -> None:
    from agora.swarm.status import swarm_status

    deadline = time.time() + timeout
    while time.time() < deadline:
        snap = swarm_status(dht, manifest)
        counts = [sum(p["state"] == "serving" for p in st["peers"]) for st in snap["stages"]]
        if all(c >= replicas for c in counts):
            return
        dead = [c for c in swarm.nodes(alive=False) if not c.alive]
        if dead:
            raise RuntimeError(f"node {dead[0].name} exited during start-up; see {dead[0].log}")
        time.sleep(0.5)
    raise TimeoutError(f"stage peers did not all start serving within {timeout:.0f}s (serving per stage: {counts})")


def _timeline_point(snap: dict, t: float) -> dict:
    """What the demo saw at time ``t``: tokens, completed microbatches, the slowest serving replica's step per
    stage, serving peers per stage, and per-stage work counters by peer (forward calls, from their records)."""
    serving = [[p for p in st["peers"] if p["state"] == "serving"] for st in snap["stages"]]
    return {
        "t": t,
        "tokens": snap["tokens"],
        "completed": int(snap["microbatches"].get("completed", 0)),
        "steps": [min([p["step"] for p in peers] or [0]) for peers in serving],
        "serving": [len(peers) for peers in serving],
        "work": [{p["short_id"]: int((p.get("metrics") or {}).get("forward", 0)) for p in st["peers"]}
                 for st in snap["stages"]],
    }


def _chaos_kill(swarm: Swarm, snap: dict, rng: random.Random, allow_last: bool, events: list, t0: float) -> dict:
    """SIGKILL one random serving stage peer (not the last serving one of its stage unless ``allow_last``) and
    start a replacement with ``--stage auto``. Returns what was done, or {} when no peer may be killed."""
    serving = {p["peer_id"]: st["stage"] for st in snap["stages"] for p in st["peers"] if p["state"] == "serving"}
    per_stage: dict[int, int] = {}
    for stage in serving.values():
        per_stage[stage] = per_stage.get(stage, 0) + 1
    candidates = []
    for c in swarm.nodes():
        info = c.current() or {}
        stage = serving.get(info.get("peer_id", ""))
        if stage is not None and (allow_last or per_stage[stage] > 1):
            candidates.append((c, info["peer_id"], stage))
    if not candidates:
        return {}
    victim, peer_id, stage = rng.choice(candidates)
    victim.kill_group()
    replacement = swarm.start_node(None)
    t = time.time() - t0
    events.append(f"{t:.0f}s: chaos killed {victim.name} (stage {stage}); started {replacement.name} with --stage auto")
    return {"t": t, "killed": victim.name, "peer_id": peer_id, "stage": stage, "replacement": replacement.name}


def measure_replica_divergence(dht, manifest: Manifest, settle_s: float = 45.0, timeout: float = 60.0) -> dict:
    """Largest |difference| of any parameter between the serving replicas of each stage (trainers stopped).

    Waits (up to ``settle_s``) until, per stage, every serving replica is at one step with nothing accumulated
    and no round running, then downloads each replica's state (``get_state``) and compares parameters.
    """
    import asyncio

    from agora.swarm.status import swarm_status

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
    from agora.swarm import transport
    from agora.swarm.node import GET_STATE

    p2p = await dht.replicate_p2p()
    stages: dict[str, dict] = {}
    for st in snap["stages"]:
        params: dict[str, dict] = {}
        steps: dict[str, int] = {}
        for p in [p for p in st["peers"] if p["state"] == "serving"]:
            meta = {"run_id": manifest.run_id, "manifest_hash": manifest.hash, "stage": st["stage"]}
            try:
                reply, tensors = await transport.call(p2p, p["peer_id"], manifest.run_id, GET_STATE, meta, [], timeout)
            except transport.RpcError as err:
                console.print(f"[yellow]state download from {p['short_id']} failed: {err}[/yellow]")
                continue
            params[p["short_id"]] = {n: t for n, t in zip(reply["names"], tensors) if n.startswith("param/")}
            steps[p["short_id"]] = reply["step"]
        ids = sorted(params)
        diff = 0.0
        for other in ids[1:]:
            for name, ref in params[ids[0]].items():
                diff = max(diff, float((ref.float() - params[other][name].float()).abs().max()))
        stages[str(st["stage"])] = {"replicas": len(ids), "steps": steps, "max_abs_diff": diff if len(ids) > 1 else None}
    diffs = [v["max_abs_diff"] for v in stages.values() if v["max_abs_diff"] is not None]
    return {"stages": stages, "max_abs_diff": max(diffs) if diffs else None}


def summarize(swarm: Swarm, manifest: Manifest, wall: float, steps: int, replicas: int,
              kills: list[dict], timeline: list[dict], t0: Optional[float] = None) -> dict:
    trainers = [s for c in swarm.children if c.role == "train" and (s := read_json(c.summary))]
    nodes = [(c, s) for c in swarm.children if c.role == "node" and (s := read_json(c.summary))]
    merged = [(p["wall_s"], i, p) for i, t in enumerate(trainers) for p in t.get("loss_curve", [])]
    curve = [{"tokens": sum_tokens, "loss": p["loss"], "wall_s": w}
             for w, p, sum_tokens in _cumulative(merged)]
    counts = {"submitted": 0, "completed": 0, "retried": 0, "abandoned": 0}
    for t in trainers:
        for k in counts:
            counts[k] += int(t.get("microbatches", {}).get(k, 0))
    tokens = sum(t.get("tokens", 0) for t in trainers)
    bytes_per_boundary: dict[str, int] = {}
    steps_per_stage: dict[str, int] = {}
    busy: dict[str, float] = {}
    stale_sum: dict[str, int] = {}
    stale_n: dict[str, int] = {}
    stale_max: dict[str, int] = {}
    for c, s in nodes:
        st = s["stage"]
        if st < manifest.n_stages - 1:
            key = f"{st}->{st + 1}"
            bytes_per_boundary[key] = bytes_per_boundary.get(key, 0) + s.get("bytes_sent_downstream", 0)
        steps_per_stage[str(st)] = max(steps_per_stage.get(str(st), 0), s.get("step", 0))
        busy[str(st)] = busy.get(str(st), 0.0) + s["counters"].get("busy_s", 0.0)
        stale_sum[str(st)] = stale_sum.get(str(st), 0) + s["counters"].get("staleness_sum", 0)
        stale_n[str(st)] = stale_n.get(str(st), 0) + s["counters"].get("backward", 0)
        stale_max[str(st)] = max(stale_max.get(str(st), 0), s["counters"].get("staleness_max", 0))
    cpu = {c.name: s.get("cpu_s", 0.0) for c, s in nodes}
    cpu.update({f"trainer{i}": t.get("cpu_s", 0.0) for i, t in enumerate(trainers)})
    val = [t["val_loss"] for t in trainers if t.get("val_loss") is not None]
    stage_procs = {str(s): max(1, sum(1 for c, x in nodes if x["stage"] == s)) for s in range(manifest.n_stages)}
    return {
        "kind": "swarm-demo",
        "run_id": manifest.run_id,
        "manifest_hash": manifest.hash,
        "stages": manifest.n_stages,
        "replicas": replicas,
        "trainers": len(trainers),
        "target_steps": steps,
        "tokens": tokens,
        "wall_s": wall,
        "cpu_s_total": sum(cpu.values()),
        "cpu_s_by_process": cpu,
        "tokens_per_s": tokens / wall if wall else 0.0,
        "tokens_per_cpu_s": tokens / max(1e-9, sum(cpu.values())),
        "loss_curve": curve,
        "first_loss": curve[0]["loss"] if curve else None,
        "final_loss": curve[-1]["loss"] if curve else None,
        "val_loss": sum(val) / len(val) if val else None,
        "steps_per_stage": steps_per_stage,
        "bytes_per_boundary": bytes_per_boundary,
        "microbatches": counts,
        "stage_utilisation": {k: v / (wall * stage_procs[k]) for k, v in busy.items()},
        "staleness_mean_per_stage": {k: stale_sum[k] / max(1, stale_n[k]) for k in stale_sum},
        "staleness_max_per_stage": stale_max,
        "rounds_ok": sum(s.get("rounds_ok", 0) for _, s in nodes),
        "rounds_failed": sum(s.get("rounds_failed", 0) for _, s in nodes),
        "chaos_kills": kills,
        "timeline": timeline,
        "completions": _completions(trainers, t0),
        "exits": {c.name: c.exit for c in swarm.children},
        "nodes": [{"name": c.name, "peer_id": s.get("peer_id"), "stage": s.get("stage"), "state": s.get("state"),
                   "step": s.get("step"), "fingerprint": s.get("fingerprint"), "moves": s.get("moves", 0),
                   "resyncs": s.get("resyncs", 0), "rounds_failed": s.get("rounds_failed", 0),
                   "aborted_rounds": s.get("aborted_rounds", 0), "local_steps": s.get("local_steps", 0)}
                  for c, s in nodes],
        "moves": sum(s.get("moves", 0) for _, s in nodes),
        "resyncs": sum(s.get("resyncs", 0) for _, s in nodes),
    }


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
