"""The processes of a local swarm: start ``python -m agora.cli ROLE ...`` children, watch them, stop them.

Every child runs in its own session, so that it and its hivemind helper processes (DHT, averager, p2pd) can be
signalled and, if needed, killed as one group by PID, never by name. With a network-namespace topology every
peer runs in a namespace of its own (see ``docs/DEMO.md``).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

import psutil
from rich.console import Console

from agora.lab import netem
from agora.lab.demo_setup import LocalAuthority

console = Console(stderr=True)


@dataclass
class Child:
    """One process of the swarm: its ``agora.cli`` role (bootstrap, node, train, dashboard), a unique name such as
    ``node1-4``, its log and the JSON summary it writes; ``stage`` is the one it was started for (None: auto)."""

    role: str
    name: str
    proc: subprocess.Popen
    log: Path
    summary: Path
    stage: Optional[int] = None
    slot: Optional[netem.NetnsPeer] = None  # its network namespace (netns link emulation only)
    started: float = field(default_factory=time.time)
    exit: Optional[dict] = None  # {"graceful": bool, "seconds": float} once stopped or killed by the demo
    firewalled: bool = False  # its namespace drops inbound connections (``Swarm.start_node(refuse_inbound=True)``)

    def current(self) -> Optional[dict]:
        """The child's latest self-written summary (nodes rewrite it every few seconds while serving)."""
        return read_json(self.summary)

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def signal(self, sig: int) -> None:
        """Send ``sig`` to the child itself (not its group), if it still runs."""
        if self.alive:
            try:
                os.kill(self.proc.pid, sig)
            except ProcessLookupError:
                pass

    def kill_main(self) -> list:
        """SIGKILL the child's main process only, as the OOM killer does; returns its helper processes (hivemind's
        DHT/averager processes, p2pd) as they were just before, so the caller can check they exit on their own."""
        try:
            helpers = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.Error:
            helpers = []
        if self.exit is None and self.alive:
            self.exit = {"graceful": False, "seconds": None}
        self.signal(signal.SIGKILL)
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        return helpers

    def signal_group(self, sig: int) -> None:
        """Send ``sig`` to the child's whole session (e.g. SIGSTOP/SIGCONT: a laptop lid closing and opening)."""
        if self.alive:
            try:
                os.killpg(self.proc.pid, sig)
            except (ProcessLookupError, PermissionError):
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
        self.firewalled_slots: set[int] = set()  # namespaces with a firewall rule: never handed to another peer
        (out / "logs").mkdir(parents=True, exist_ok=True)
        (out / "procs").mkdir(parents=True, exist_ok=True)

    def _spawn(self, role: str, args: list[str], stage: Optional[int] = None, refuse_inbound: bool = False) -> Child:
        """Start ``python -m agora.cli ROLE ARGS`` (credentials, summary file and namespace added as needed);
        ``refuse_inbound``: in a namespace of its own whose firewall drops inbound connections."""
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
        if refuse_inbound and self.topology is None:
            raise RuntimeError("refuse_inbound needs a Swarm started with a topology")
        if self.topology is not None:
            slot = self.free_slot()
            if refuse_inbound:
                self.topology.refuse_inbound(slot.index)
                self.firewalled_slots.add(slot.index)
            if role == "dashboard":  # page on the host, DHT client in the namespace (see run_dashboard)
                cmd += ["--dht-host", slot.address, "--dht-netns", slot.netns]
            else:  # the whole peer in the namespace (ip netns exec execs in place: the pid stays the peer's)
                cmd = self.topology.exec_argv(slot.index, [*cmd, "--host", slot.address])
        # os.environ carries PYTHONPATH & co., so children import the same agora as this process.
        env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS=str(self.threads), **self.env)
        with open(log, "w") as log_file:
            proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        child = Child(role, name, proc, log, summary, stage, slot, firewalled=refuse_inbound)
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
                    and c.slot.index not in self.firewalled_slots
                    and not netem.pids_in(c.slot.netns)):
                return c.slot
        return self.topology.add_peer()

    def start_bootstrap(self, timeout: float = 60.0) -> str:
        """Start the bootstrap peer and return its first multiaddr once it has written it."""
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

    def start_node(self, stage: Optional[int], more_peers: Sequence[str] = (), refuse_inbound: bool = False,
                   extra_args: Sequence[str] = ()) -> Child:
        """Start a stage node for ``stage`` (None: ``--stage auto``, the node picks the weakest stage), joining
        through the bootstrap peer and ``more_peers`` (live peers' addresses: the bootstrap peer may be dead);
        ``refuse_inbound``: behind a firewall that drops inbound connections (a home router); ``extra_args``: more
        ``agora node`` options for this node only (later options win over the swarm's)."""
        peers = [self.maddr, *[p for p in more_peers if p != self.maddr]]
        args = ["--manifest", str(self.manifest_path), *[a for p in peers for a in ("--initial-peers", p)],
                "--stage", "auto" if stage is None else str(stage), "--threads", str(self.threads),
                *self.extra_node_args, *extra_args]
        return self._spawn("node", args, stage, refuse_inbound)

    def start_trainer(self, index: int, count: int, in_flight: int, val_batches: int,
                      max_tokens: Optional[int] = None, settle_s: float = 0.0, eval_every_steps: int = 0) -> Child:
        """Start trainer ``index`` of ``count`` (its data shard ``index/count``); ``max_tokens``: stop after that
        many tokens (None: train until stopped); ``settle_s``: then wait up to that long for the stages to apply
        them before validating; ``eval_every_steps``: also validate during training (``agora train``)."""
        args = ["--manifest", str(self.manifest_path), "--initial-peers", self.maddr, "--shard", f"{index}/{count}",
                "--in-flight", str(in_flight), "--val-batches", str(val_batches)]
        if max_tokens is not None:
            args += ["--max-tokens", str(max_tokens)]
        if settle_s > 0:
            args += ["--settle-s", f"{settle_s:g}"]
        if eval_every_steps:
            args += ["--eval-every-steps", str(eval_every_steps)]
        return self._spawn("train", args)

    def start_dashboard(self, port: int) -> Child:
        """Start the live dashboard, its page served on the host's 127.0.0.1:``port``."""
        return self._spawn("dashboard", ["--manifest", str(self.manifest_path), "--initial-peers", self.maddr,
                                         "--port", str(port)])

    def nodes(self, alive: bool = True) -> list[Child]:
        """The stage nodes: only running ones, or (``alive=False``) every node ever started."""
        return [c for c in self.children if c.role == "node" and (c.alive or not alive)]

    def wait_exit(self, children: list[Child], timeout: float) -> list[Child]:
        """Wait up to ``timeout`` seconds for ``children`` to exit by themselves (recording how); returns those
        still running."""
        t0 = time.time()
        for c in children:
            try:
                c.proc.wait(timeout=max(0.1, t0 + timeout - time.time()))
            except subprocess.TimeoutExpired:
                continue
            if c.exit is None:
                c.exit = {"graceful": c.proc.returncode == 0, "seconds": time.time() - t0,
                          "returncode": c.proc.returncode}
        return [c for c in children if c.alive]

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

    def bootstrap(self) -> Optional[Child]:
        return next((c for c in self.children if c.role == "bootstrap"), None)

    def trainers(self) -> list[Child]:
        """Every trainer ever started, running or not."""
        return [c for c in self.children if c.role == "train"]

    def shutdown(self) -> None:
        """Stop everything gracefully, trainers first (they flush their summaries), the bootstrap peer last."""
        self.stop(self.trainers(), 90)
        self.stop(self.nodes(alive=False), 40)
        self.stop([c for c in self.children if c.role == "bootstrap"], 15)


def read_json(path: Path) -> Optional[dict]:
    """The JSON in ``path``, or None while it is missing or half-written."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None
