"""CPU time of a local swarm over a training window, per role and per process, read from outside by PID.

The demo starts every role, so it can see them all: it walks each role's process tree (its main process,
hivemind's DHT and averager processes, their ``p2pd`` daemons) with psutil when training starts, on every status
tick, and when training ends, before anything is stopped, and takes differences. A process that dies inside the
window counts up to its last sample (so at most one tick of its time is lost); one born inside it counts from
zero. Only each process's own user + system time is read, never the ``children_*`` time of children it reaped,
so nothing counts twice. The demo's own hivemind children (its DHT client and daemon) count as the role
``observer``; the demo's main process (the harness polling the swarm) is reported apart, outside the total.

Kinds of process: ``main`` (the role's own process), ``dht`` and ``averager`` (hivemind children, named by the
PIDs a node writes in its summary; otherwise the role's first forked child is its DHT and, on a node, later ones
are averagers), ``p2pd`` (libp2p daemons), ``other`` (e.g. ``torch_shm_manager``). A node's compute thread
(forward, backward, optimizer steps) is read the same way, by the thread id the node writes in its summary
(``compute_tid``); with more than one torch thread per node, torch's worker threads count under ``main``.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Optional

import psutil

from agora.lab.processes import Swarm

OBSERVER = "observer"  # the demo's own DHT client process and its daemon
SWARM_ROLES = ("bootstrap", "node", "train")  # the dashboard is a viewer, not part of the swarm


@dataclass(frozen=True)
class Root:
    """One role's process tree: ``pid`` its main process; ``helpers``: PIDs whose kind the role told us."""

    role: str
    pid: int
    node: bool = False
    helpers: dict[int, str] = field(default_factory=dict)
    count_root: bool = True  # False for the observer: the demo's main process is the harness, not the swarm


@dataclass(frozen=True)
class ProcSample:
    role: str
    kind: str
    cpu_s: float


Key = tuple[int, float]  # (pid, create time): a PID reused by the OS is another process


def sample(roots: list[Root], exclude: frozenset[int] = frozenset()) -> dict[Key, ProcSample]:
    """Every process of every root's tree, with its role, kind and CPU seconds so far. A root's tree stops at
    another root and at the ``exclude`` PIDs (the demo is the parent of every role, and of its dashboard)."""
    children: dict[int, list[psutil.Process]] = {}
    for proc in psutil.process_iter(["ppid"]):
        children.setdefault(proc.info["ppid"], []).append(proc)
    root_pids = {r.pid for r in roots} | exclude
    out: dict[Key, ProcSample] = {}
    for root in roots:
        try:
            main = psutil.Process(root.pid)
            tree = [(main, "main")] if root.count_root else []
            tree += _descendants(root, main, children, root_pids)
        except psutil.Error:
            continue
        for proc, kind in tree:
            try:
                with proc.oneshot():
                    t = proc.cpu_times()
                    key = (proc.pid, proc.create_time())
            except psutil.Error:
                continue
            out[key] = ProcSample(root.role, kind, t.user + t.system)
    return out


def _descendants(root: Root, main: psutil.Process, children: dict[int, list[psutil.Process]],
                 root_pids: set[int]) -> list[tuple[psutil.Process, str]]:
    """(process, kind) for every descendant of ``main`` outside other roots' trees."""
    found: list[tuple[psutil.Process, str]] = []
    forks = []  # direct children running the role's own program: hivemind's DHT and averager processes
    try:
        main_name = main.name()
    except psutil.Error:
        main_name = ""
    stack = [(main, 0)]
    while stack:
        parent, depth = stack.pop()
        for child in children.get(parent.pid, []):
            if child.pid in root_pids:
                continue
            try:
                name = child.name()
            except psutil.Error:
                continue
            if child.pid in root.helpers:
                kind = root.helpers[child.pid]
            elif name == "p2pd":
                kind = "p2pd"
            elif depth == 0 and name == main_name:
                forks.append(child)
                kind = ""  # decided below, by creation order
            else:
                kind = "other"
            found.append((child, kind))
            stack.append((child, depth + 1))
    forks.sort(key=_created)
    named = {p.pid: ("dht" if i == 0 and "dht" not in root.helpers.values() else
                     "averager" if root.node else "other") for i, p in enumerate(forks)}
    return [(p, kind or named[p.pid]) for p, kind in found]


def _created(proc: psutil.Process) -> float:
    try:
        return proc.create_time()
    except psutil.Error:
        return float("inf")


def thread_cpu(pids: list[int]) -> dict[tuple[int, int], float]:
    """CPU seconds of every thread of ``pids``, by (pid, native thread id)."""
    out: dict[tuple[int, int], float] = {}
    for pid in pids:
        try:
            for t in psutil.Process(pid).threads():
                out[(pid, t.id)] = t.user_time + t.system_time
        except psutil.Error:
            continue
    return out


def own_cpu() -> float:
    """CPU seconds of this process's own threads (its children not included)."""
    t = psutil.Process().cpu_times()
    return t.user + t.system


class SwarmMeter:
    """The CPU window of a demo's swarm: ``start()`` when training starts, ``tick()`` on every status read,
    ``mark()`` when the trainers are done, ``end()`` when the stages applied their work; then ``result()``."""

    def __init__(self, swarm: Swarm, observer_dht=None):
        self.swarm = swarm
        self.observer_pid = os.getpid()
        self.observer_dht_pid = getattr(observer_dht, "pid", None)
        self.first: dict[Key, ProcSample] = {}
        self.last: dict[Key, ProcSample] = {}
        self.threads0: dict[tuple[int, int], float] = {}
        self.threads1: dict[tuple[int, int], float] = {}
        self.t0 = self.t_mark = self.t1 = None
        self.own0 = self.own1 = 0.0
        self.at_mark: Optional[float] = None  # total CPU seconds of the window at mark()
        self.ended = False
        self.dead_at_end: set[Key] = set()

    def roots(self) -> list[Root]:
        roots = []
        for c in self.swarm.children:
            if c.role not in SWARM_ROLES:
                continue
            info = (c.current() or {}) if c.role == "node" else {}
            pids = info.get("helper_pids") or {}
            helpers = {pid: "averager" for pid in pids.get("averagers") or []}
            if pids.get("dht"):
                helpers[pids["dht"]] = "dht"
            roots.append(Root(c.name, c.proc.pid, node=c.role == "node", helpers=helpers))
        helpers = {self.observer_dht_pid: "dht"} if self.observer_dht_pid else {}
        roots.append(Root(OBSERVER, self.observer_pid, helpers=helpers, count_root=False))
        return roots

    def _node_pids(self) -> list[int]:
        return [c.proc.pid for c in self.swarm.children if c.role == "node" and c.alive]

    def _sample(self) -> dict[Key, ProcSample]:
        return sample(self.roots(), frozenset(c.proc.pid for c in self.swarm.children))

    def start(self) -> None:
        self.t0 = time.time()
        self.first = self._sample()
        self.last = dict(self.first)
        self.threads0 = thread_cpu(self._node_pids())
        self.own0 = own_cpu()

    def tick(self) -> None:
        """Refresh the last sample of every process (a process that dies later counts up to here)."""
        if self.t0 is not None and not self.ended:
            self.last.update(self._sample())

    def mark(self) -> None:
        """The trainers are done: what follows, until ``end()``, is the stages applying their last samples."""
        if self.t0 is not None and self.t_mark is None:
            self.tick()
            self.t_mark = time.time()
            self.at_mark = sum(self._deltas().values())

    def end(self) -> None:
        """The end of the training window, taken before anything is stopped."""
        if self.t0 is None or self.ended:
            return
        final = self._sample()
        self.last.update(final)
        self.dead_at_end = set(self.last) - set(final)
        self.threads1 = thread_cpu(self._node_pids())
        self.own1 = own_cpu()
        self.t1 = time.time()
        self.ended = True

    def _deltas(self) -> dict[Key, float]:
        return {k: max(0.0, s.cpu_s - (self.first[k].cpu_s if k in self.first else 0.0)) for k, s in self.last.items()}

    def result(self) -> Optional[dict]:
        """Per role and per kind of process CPU seconds of the window, with the compute / averaging / daemons /
        other breakdown (None when the window never started)."""
        if self.t0 is None:
            return None
        deltas = self._deltas()
        by_role: dict[str, float] = {}
        by_process: dict[str, dict[str, float]] = {}
        by_kind: dict[str, float] = {}
        for key, d in deltas.items():
            s = self.last[key]
            by_role[s.role] = by_role.get(s.role, 0.0) + d
            kinds = by_process.setdefault(s.role, {})
            kinds[s.kind] = kinds.get(s.kind, 0.0) + d
            by_kind[s.kind] = by_kind.get(s.kind, 0.0) + d
        compute = self._compute_by_node()
        total = sum(deltas.values())
        compute_s = sum(compute.values())
        averaging_s = by_kind.get("averager", 0.0)
        daemons_s = by_kind.get("dht", 0.0) + by_kind.get("p2pd", 0.0)
        end = self.t1 if self.t1 is not None else time.time()
        return {
            "ended": self.ended,  # False: the run stopped before the window's end was taken (last tick used)
            "seconds": end - self.t0,
            "drain_seconds": end - self.t_mark if self.t_mark is not None else None,
            "total_s": total,
            "drain_s": total - self.at_mark if self.at_mark is not None else None,
            "by_role": by_role,
            "by_process": by_process,
            "by_kind": by_kind,
            "compute_by_node": compute,
            "breakdown": {"compute": compute_s, "averaging": averaging_s, "daemons": daemons_s,
                          "other": total - compute_s - averaging_s - daemons_s},
            "round_wall_s": self._round_seconds(),
            "processes": len(deltas),
            "born_in_window": sum(1 for k in deltas if k not in self.first),
            "died_in_window": len(self.dead_at_end),
            "observer_main_s": self.own1 - self.own0 if self.ended else None,
        }

    def _compute_by_node(self) -> dict[str, float]:
        """CPU seconds of each node's compute thread (forward, backward, optimizer steps), by its summary's
        ``compute_tid``; a thread started inside the window counts from zero."""
        out = {}
        for c in self.swarm.children:
            tid = (c.current() or {}).get("compute_tid") if c.role == "node" else None
            key = (c.proc.pid, tid)
            if tid is not None and key in self.threads1:
                out[c.name] = self.threads1[key] - self.threads0.get(key, 0.0)
        return out

    def _round_seconds(self) -> dict[str, float]:
        """Seconds each node spent in averaging rounds (wall clock, waiting included), from its latest summary;
        over the node's life, which before training holds no round."""
        out = {}
        for c in self.swarm.children:
            seconds = (c.current() or {}).get("round_s") if c.role == "node" else None
            if seconds is not None:
                out[c.name] = seconds
        return out
