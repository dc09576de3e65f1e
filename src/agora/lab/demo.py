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

Emulated WAN (``--link-mbps X [--link-latency-ms Y]``), two backends (see :func:`plan_links`):

* ``netns`` (root, namespaces available): every peer process -- bootstrap, each node, each trainer, chaos
  replacements -- runs in its own network namespace on a bridge (``agora.lab.netem.NetnsTopology``), listening on and
  announcing its namespace address ``10.231.0.x``, its egress capped by the kernel (``tc tbf``) at X Mbit/s. That
  caps *all* its traffic, hivemind's DHT and averager included. The latency is still injected in the transport
  (``AGORA_LINK=Yms``, latency only, so the rate is never throttled twice): the kernel here has no ``netem``.
  The demo itself must read the DHT, yet peers exist only inside namespaces. It takes a namespace slot of its own
  and forks *only its DHT process* in there (``make_dht(netns=...)``, a per-thread ``setns`` around the fork);
  its main thread stays in the host namespace. This is the least invasive choice: the rest of the demo (progress,
  chaos, replica divergence over the DHT's daemon, which it reaches through a unix socket) works unchanged, and
  unlike reading only the peers' files it keeps every DHT-based check. The dashboard uses the same trick, so its
  page is still served on the host's 127.0.0.1. Namespaces are removed at the end, on errors, Ctrl-C and SIGTERM,
  with anything still running inside them; leftovers of a demo killed with SIGKILL are removed by the next one.
* ``transport`` (otherwise): every process throttles the tensor RPCs it sends (``AGORA_LINK=Xmbit,Yms``);
  hivemind's DHT and averaging traffic is not capped. The demo prints which backend it uses and why.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Optional

import yaml
from rich.console import Console
from rich.live import Live
from rich.table import Table

from agora.lab import netem
from agora.config import Manifest, load_manifest

console = Console(stderr=True)


def even_split(n_layers: int, n_stages: int) -> list[int]:
    if n_stages > n_layers:
        raise ValueError(f"--stages {n_stages} is more than the model's {n_layers} layers")
    base, extra = divmod(n_layers, n_stages)
    return [base + (1 if s < extra else 0) for s in range(n_stages)]


def averaging_section(spec: str) -> dict:
    """The manifest's ``averaging`` section from a command-line spec: ``powersgd``, ``powersgd,rank=8``,
    ``sparse,every=5,rho=0.1`` (unnamed settings keep their defaults; the manifest validates the result)."""
    scheme, *settings = [part.strip() for part in spec.split(",")]
    section: dict = {"scheme": scheme}
    for setting in settings:
        key, sep, value = setting.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"averaging spec {spec!r}: expected SCHEME[,KEY=VALUE...], e.g. 'sparse,every=5'")
        section[key.strip()] = yaml.safe_load(value)
    return section


def demo_manifest(preset: str, stages: int, residual: Optional[str] = None,
                  averaging: Optional[str] = None) -> Manifest:
    """The preset re-split into ``stages``; ``residual="dense"`` turns compression off (fp32 boundaries);
    ``averaging`` sets the replicas' averaging scheme (a spec for :func:`averaging_section`)."""
    m = load_manifest(preset)
    if averaging is not None:
        m = m.with_overrides(averaging=averaging_section(averaging))
    if stages != m.n_stages:
        m = m.with_overrides(stages=even_split(m.model.n_layers, stages))
    if residual == "dense":
        m = m.with_overrides(**{"residual.mode": "dense", "residual.k": None, "residual.wire_dtype": "fp32"})
    elif residual not in (None, "subspace"):
        raise ValueError(f"residual must be 'dense' or 'subspace', got {residual!r}")
    return m


class LocalAuthority:
    """An invitation-only run on one machine: an authority key, a signed manifest, a certified key per process.

    Exercises the same files and flags a real allow-listed run uses (``agora keygen`` / ``sign-manifest`` /
    ``certify``, then ``--identity`` and ``--certificate`` on every peer), so the demo proves the path end to end.
    """

    def __init__(self, keys_dir: Path):
        from agora.trust.identity import generate_key, save_private_key

        self.dir = Path(keys_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.key = generate_key()
        save_private_key(self.key, self.dir / "authority.key")
        self.run_id: Optional[str] = None  # set by secure()

    def secure(self, manifest: Manifest) -> Manifest:
        from agora.trust.identity import public_key_bytes

        self.run_id = manifest.run_id
        security = {"authority": public_key_bytes(self.key).decode(), "allow_list": True}
        return manifest.with_overrides(security=security)

    def sign(self, manifest_path: Path) -> None:
        from agora.trust.credentials import write_manifest_signature

        write_manifest_signature(manifest_path, self.key)

    def credentials(self, name: str) -> list[str]:
        """``--identity/--certificate`` arguments of a fresh certified key for process ``name``."""
        from agora.trust.identity import generate_key, save_private_key
        from agora.trust.credentials import certify

        if self.run_id is None:
            raise RuntimeError("LocalAuthority.secure() must run before credentials are issued")
        key = generate_key()
        save_private_key(key, self.dir / f"{name}.key")
        certify(self.key, self.run_id, key, self.dir / f"{name}.cert")
        return ["--identity", str(self.dir / f"{name}.key"), "--certificate", str(self.dir / f"{name}.cert")]


LINK_BACKENDS = ("auto", "netns", "transport")
STATUS_GIVE_UP_S = 120.0  # the demo fails when it could not read the swarm's status from the DHT for this long


@dataclass(frozen=True)
class LinkPlan:
    """How the demo emulates each peer's internet link (``backend``: none, transport or netns) and why."""

    backend: str
    reason: str
    mbps: Optional[float] = None
    latency_ms: float = 0.0

    @property
    def agora_link(self) -> Optional[str]:
        """``AGORA_LINK`` for every peer: the latency always (only the transport can add it here), the rate only
        when the kernel does not already cap it."""
        rate = self.mbps if self.backend == "transport" else None
        parts = [f"{rate:g}mbit"] if rate is not None else []
        if self.latency_ms:
            parts.append(f"{self.latency_ms:g}ms")
        return ",".join(parts) or None

    def describe(self) -> str:
        if self.backend == "none":
            return "link emulation: off"
        if self.backend == "netns":
            what = (f"each peer in its own network namespace, egress capped by tc tbf at {self.mbps:g} Mbit/s "
                    f"(all traffic: tensors, DHT, averaging)")
            if self.latency_ms:
                what += f"; {self.latency_ms:g} ms latency injected in the transport (AGORA_LINK={self.agora_link})"
        else:
            what = (f"tensor RPCs throttled in each peer's transport (AGORA_LINK={self.agora_link}); "
                    f"DHT and averaging uncapped")
        return f"link emulation ({self.backend}): {what}. Why: {self.reason}"

    def as_dict(self) -> dict:
        return {"backend": self.backend, "reason": self.reason, "mbps": self.mbps, "latency_ms": self.latency_ms,
                "agora_link": self.agora_link}


def plan_links(mbps: Optional[float], latency_ms: float = 0.0, backend: str = "auto") -> LinkPlan:
    """Pick the link-emulation backend: ``netns`` whenever a rate is capped and namespaces work (``auto``),
    ``transport`` otherwise or when asked. ``backend="netns"`` fails instead of falling back, for callers (tests,
    benchmarks) whose numbers would mean something else under the other backend."""
    if backend not in LINK_BACKENDS:
        raise ValueError(f"link backend must be one of {LINK_BACKENDS}, got {backend!r}")
    if mbps is not None and mbps <= 0:
        raise ValueError(f"link_mbps must be positive, got {mbps}")
    if latency_ms < 0:
        raise ValueError(f"link_latency_ms must be non-negative, got {latency_ms}")
    if mbps is None:
        if not latency_ms:
            return LinkPlan("none", "no --link-mbps / --link-latency-ms given")
        if backend == "netns":
            raise ValueError("the netns backend caps a rate: give --link-mbps")
        return LinkPlan("transport", "latency only: the transport adds it (the kernel has no netem qdisc here); "
                                     "nothing to cap, so no namespaces", None, latency_ms)
    if backend == "transport":
        return LinkPlan("transport", "asked for (--link-backend transport)", mbps, latency_ms)
    ok, why = netem.available()
    if ok:
        return LinkPlan("netns", "running as root with network namespaces, veth, bridge and tc tbf available",
                        mbps, latency_ms)
    if backend == "netns":
        raise RuntimeError(f"--link-backend netns: network namespaces unavailable ({why})")
    return LinkPlan("transport", f"network namespaces unavailable ({why}), so the in-transport throttle is used",
                    mbps, latency_ms)


@dataclass
class Child:
    role: str
    name: str
    proc: subprocess.Popen
    log: Path
    summary: Path
    stage: Optional[int] = None
    slot: Optional[netem.NetnsPeer] = None  # its network namespace (netns link emulation only)
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
                 env: Optional[dict[str, str]] = None, topology: Optional[netem.NetnsTopology] = None,
                 authority: Optional[LocalAuthority] = None):
        """``topology``: run every peer in a namespace of its own on this (entered) topology. ``authority``: an
        allow-listed run, every peer started with a certified key."""
        self.manifest_path = manifest_path
        self.authority = authority
        self.env = env or {}
        self.topology = topology
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
        if self.authority is not None and role in ("bootstrap", "node", "train"):
            cmd += self.authority.credentials(name)
        if role != "bootstrap":
            cmd += ["--summary", str(summary)]
        slot = None
        if self.topology is not None:
            slot = self.free_slot()
            if role == "dashboard":  # page on the host, DHT client in the namespace (see run_dashboard)
                cmd += ["--dht-host", slot.address, "--dht-netns", slot.netns]
            else:  # the whole peer in the namespace (ip netns exec execs in place: the pid stays the peer's)
                cmd = self.topology.exec_argv(slot.index, [*cmd, "--host", slot.address])
        # os.environ carries PYTHONPATH & co., so children import the same agora as this process.
        env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS=str(self.threads), **self.env)
        with open(log, "w") as log_file:
            proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        child = Child(role, name, proc, log, summary, stage, slot)
        self.children.append(child)
        return child

    def free_slot(self) -> netem.NetnsPeer:
        """A namespace for a new peer: one whose previous peer is gone with every process it started (chaos
        replacements reuse their victims' slots, so a long chaos run stays within the /24), else a new one."""
        if self.topology is None:
            raise RuntimeError("free_slot needs a Swarm started with a topology")
        taken = {c.slot.index for c in self.children if c.slot is not None and c.alive}
        for c in self.children:
            if (c.slot is not None and not c.alive and c.slot.index not in taken
                    and not netem.pids_in(c.slot.netns)):
                return c.slot
        return self.topology.add_peer()

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
    link_backend: str = "auto",
    allow_list: bool = False,
    averaging: Optional[str] = None,
) -> dict:
    """Run a local swarm until every stage took ``steps`` steps, or the trainers reached ``tokens`` tokens, or
    ``train_seconds`` of training passed (whichever comes first); ``timeout`` (from the start) is a failure.

    ``measure_divergence``: at the end, stop the trainers, let the replicas settle and download every serving
    peer's state to report the largest parameter difference between replicas of each stage.
    ``checkpoint_dir``/``checkpoint_every``/``resume`` are passed to every node (``agora node`` options).
    ``link_mbps``/``link_latency_ms`` emulate each peer's internet link, with the backend ``link_backend`` (auto,
    netns or transport; see the module docstring and :func:`plan_links`). The summary's ``link`` says which backend
    ran, why, and (netns) each process's namespace and address.
    ``allow_list``: an invitation-only run (``LocalAuthority``): signed manifest, every peer with a certified key.
    """
    from agora.net.dht import make_dht
    from agora.ops.status import swarm_status

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    manifest = demo_manifest(preset, stages, residual, averaging)
    if allow_list and measure_divergence:
        raise ValueError("measure_divergence downloads replica states from the demo process, which holds no "
                         "certificate: not available with allow_list")
    authority = LocalAuthority(out / "keys") if allow_list else None
    if authority is not None:
        manifest = authority.secure(manifest)
    manifest_path = out / "manifest.yaml"
    manifest_path.write_text(manifest.to_yaml())
    if authority is not None:
        authority.sign(manifest_path)
        console.print(f"allow-listed run: manifest signed by {out / 'keys' / 'authority.key'}; every peer gets a "
                      f"certified key in {out / 'keys'}")
    extra = list(node_args or [])
    if checkpoint_dir is not None:
        extra += ["--checkpoint-dir", str(checkpoint_dir), "--checkpoint-every", str(checkpoint_every)]
    if resume is not None:
        extra += ["--resume", str(resume)]
    plan = plan_links(link_mbps, link_latency_ms, link_backend)
    console.print(plan.describe())
    env = {"AGORA_LINK": plan.agora_link} if plan.agora_link else {}
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
    topology: Optional[netem.NetnsTopology] = None
    observer: Optional[netem.NetnsPeer] = None
    swarm: Optional[Swarm] = None
    with _sigterm_raises():
        try:
            if plan.backend == "netns":
                stale = netem.cleanup_stale()
                if stale:
                    console.print(f"removed namespaces left by a killed earlier run: {', '.join(stale)}")
                topology = netem.NetnsTopology(0, mbps=plan.mbps).__enter__()
            swarm = Swarm(manifest_path, out, threads=threads, extra_node_args=extra, env=env, topology=topology,
                          authority=authority)
            maddr = swarm.start_bootstrap()
            if topology is not None:
                observer = topology.add_peer()  # the demo's own DHT client: a (capped) peer like any other
                dht = make_dht([maddr], host=observer.address, client_mode=True, netns=observer.netns,
                                   manifest=manifest, writes=False)
            else:
                dht = make_dht([maddr], client_mode=True, manifest=manifest, writes=False)
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
                last_read = time.time()
                while time.time() < deadline:
                    try:
                        snap = swarm_status(dht, manifest)
                        last_read = time.time()
                    except TimeoutError:
                        # Under a kernel cap the demo's DHT reads share saturated links with the tensors: one
                        # slow read is a hiccup to ride out (as the dashboard does), minutes of them a failure.
                        if time.time() - last_read > STATUS_GIVE_UP_S:
                            raise
                        events.append(f"{time.time() - t0:.0f}s: swarm status read timed out; retrying")
                        time.sleep(1.0)
                        continue
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
            try:
                if dht is not None:
                    dht.shutdown()
                if swarm is not None:
                    swarm.shutdown()
                    if dash is not None:
                        swarm.stop([dash], 10)
            finally:  # also after a second Ctrl-C during the graceful part: no namespace outlives the demo
                if topology is not None:
                    topology.teardown()
    wall = time.time() - t0
    summary = summarize(swarm, manifest, wall, steps, replicas, kills, timeline, t0)
    summary["finished"] = finished
    summary["train_started_s"] = train_t0
    summary["replica_divergence"] = divergence
    summary["link"] = plan.as_dict() | ({
        "observer": {"netns": observer.netns, "address": observer.address} if observer else None,
        "peers": {c.name: {"netns": c.slot.netns, "address": c.slot.address} for c in swarm.children if c.slot},
        "tbf": {"burst_bytes": topology.burst_bytes, "queue_ms": topology.queue_ms},
    } if topology is not None else {})
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    from agora.lab.report import write_swarm_report

    write_swarm_report(summary, out)
    return summary


@contextlib.contextmanager
def _sigterm_raises() -> Iterator[None]:
    """Within the body, the first SIGTERM raises ``SystemExit`` (later ones are ignored), so the demo's cleanup --
    stopping its peers and deleting its network namespaces -- runs when it is terminated, not only on Ctrl-C.
    Only the main thread can own signal handlers; elsewhere (tests driving the demo from a thread) a no-op."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def _raise(signum: int, frame: object) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, _raise)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


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
    from agora.ops.status import swarm_status

    deadline = time.time() + timeout
    counts: list[int] = []
    while time.time() < deadline:
        try:
            snap = swarm_status(dht, manifest)
        except TimeoutError:  # a slow read on a capped link; the overall deadline still bounds the wait
            continue
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
    from agora.net import transport
    from agora.net.protocol import GET_STATE

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
        "averaging_scheme": manifest.averaging.scheme,
        "averaging_bytes_sent": sum(s.get("averaging_bytes_sent", 0) for _, s in nodes),
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
