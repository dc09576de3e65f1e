"""Link emulation for throughput experiments: an in-transport throttle and a network-namespace testbed.

Why two backends: the results we compare against were measured over slow links (80-300 Mb/s, tens of ms).
:class:`LinkThrottle` (``agora.net.throttle``, re-exported here) paces each process's egress in-process: no
privileges, and our only way to inject latency where the ``netem`` qdisc is missing, but hivemind's averager and
DHT traffic bypass it. :class:`NetnsTopology` (defined here) builds real, kernel-enforced caps (``tc tbf``) between
network namespaces, which also catch TCP slow start, queueing and libp2p framing.

:func:`entered` (``agora.net.netns``, re-exported) moves the calling thread into a namespace for a moment;
:func:`cleanup_stale` removes a crashed process's leftovers; :func:`available` says whether root, ``ip`` and ``tc``
are there. How the throttle is configured and timed, the topology's layout and its isolation: docs/NETEM.md.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import re
import shutil
import subprocess
import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

from agora.net.netns import NETNS_RUN_DIR, entered
from agora.net.throttle import LinkThrottle, parse_link_spec

__all__ = ["LinkThrottle", "NetnsTopology", "NetnsPeer", "available", "cleanup_stale", "entered", "parse_link_spec",
           "pids_in"]

# ------------------------------------------------------------------------------------------ namespace backend

SUBNET = "10.231.0"  # a /24 used only inside namespaces created here
_NAME = re.compile(r"^agora-netem-(?P<pid>\d+)-(?P<serial>\d+)-(?:hub|p\d+)$")
_serial = itertools.count()
_available: Optional[Tuple[bool, str]] = None


def _run(argv: Sequence[str], check: bool = True, timeout: float = 20.0) -> subprocess.CompletedProcess:
    proc = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return _run(["ip", *args], check=check)


def _tc(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return _run(["tc", *args], check=check)


def list_namespaces() -> List[str]:
    out = _ip("netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def available(refresh: bool = False) -> Tuple[bool, str]:
    """Whether namespaces, veth, bridge and tbf work here: ``(True, "ok")`` or ``(False, reason)``.

    Probes once per process by building (and removing) a throwaway namespace with a bridge, a veth and a tbf.
    """
    global _available
    if _available is not None and not refresh:
        return _available
    if os.name != "posix" or not hasattr(os, "geteuid") or os.geteuid() != 0:
        _available = (False, "needs root (network namespaces and tc)")
        return _available
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            _available = (False, f"'{tool}' (iproute2) not found")
            return _available
    name = f"agora-netem-{os.getpid()}-{next(_serial)}-hub"
    try:
        _ip("netns", "add", name)
        _ip("-n", name, "link", "add", "br0", "type", "bridge")
        _ip("-n", name, "link", "add", "v0", "type", "veth", "peer", "name", "v1")
        _ip("-n", name, "link", "set", "v0", "up")
        _tc("-n", name, "qdisc", "add", "dev", "v0", "root", "tbf", "rate", "8mbit", "burst", "16384",
            "latency", "50ms")
        _available = (True, "ok")
    except (RuntimeError, OSError, subprocess.SubprocessError) as err:
        _available = (False, f"probe failed: {err}")
    finally:
        _ip("netns", "del", name, check=False)
    return _available


def firewall_available() -> Tuple[bool, str]:
    """Whether :meth:`NetnsTopology.refuse_inbound` can work here: namespaces, and ``iptables`` on the PATH (the
    Makefile installs it as root, like the browser)."""
    ok, reason = available()
    if not ok:
        return ok, reason
    if shutil.which("iptables") is None:
        return False, "iptables is not installed (`apt-get install iptables` as root; `make install` does it)"
    return True, ""


def cleanup_stale() -> List[str]:
    """Delete namespaces named by this module whose creating process is gone; returns the names removed.

    Processes still running inside such a namespace are killed first: a creator killed with SIGKILL (no teardown)
    leaves its peers running there, cut off from everything, and only our code ever starts processes in them.
    """
    removed = []
    for name in list_namespaces():
        match = _NAME.match(name)
        if not match or _pid_alive(int(match["pid"])):
            continue
        kill_inside(name)
        if _ip("netns", "del", name, check=False).returncode == 0:
            removed.append(name)
    return removed


def _ns_id(path: str) -> Optional[Tuple[int, int]]:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def pids_in(netns: str) -> List[int]:
    """PIDs of processes whose (main thread's) network namespace is the named one, from /proc.

    Read directly rather than with ``ip netns pids`` so that callers can poll it cheaply and tests can fake
    namespaces without running ``ip``.
    """
    target = _ns_id(os.path.join(NETNS_RUN_DIR, netns))
    if target is None:
        return []
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and _ns_id(f"/proc/{entry}/ns/net") == target:
            found.append(int(entry))
    return found


def kill_inside(netns: str, timeout: float = 5.0) -> List[int]:
    """SIGKILL every process inside ``netns`` (never this process) and wait up to ``timeout`` s until they are
    gone; returns the PIDs that were signalled. Only for namespaces this module created."""
    if not _NAME.match(netns):
        raise ValueError(f"refusing to kill processes in a namespace this module did not name: {netns!r}")
    victims = [pid for pid in pids_in(netns) if pid != os.getpid()]
    for pid in victims:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, 9)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(pid != os.getpid() for pid in pids_in(netns)):
        time.sleep(0.05)
    return victims


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@dataclass(frozen=True)
class NetnsPeer:
    index: int
    netns: str
    address: str  # inside the namespace only, e.g. 10.231.0.1
    device: str = "eth0"


class NetnsTopology:
    """N peer namespaces on a bridge (in a hub namespace), each peer's egress capped with ``tc tbf``.

    :param n: number of peers to create on entry (at most 250 in all; :meth:`add_peer` adds more later)
    :param mbps: egress cap of every peer in Mbit/s (None: uncapped)
    :param burst_bytes: tbf bucket size; a transfer of B bytes takes at least ``(B - burst)*8/X`` seconds
      (the bucket starts full). Must hold at least one packet: >= 2 KiB, 16 KiB is safe at any rate.
    :param queue_ms: tbf ``latency``: how long a packet may queue before being dropped (not a delay!)
    """

    MAX_PEERS = 250

    def __init__(self, n: int, *, mbps: Optional[float] = None, burst_bytes: int = 16384, queue_ms: float = 50.0):
        if not 0 <= n <= self.MAX_PEERS:
            raise ValueError(f"n must be in 0..{self.MAX_PEERS}, got {n}")
        if mbps is not None and mbps <= 0:
            raise ValueError(f"mbps must be positive or None, got {mbps}")
        if burst_bytes < 2048:
            raise ValueError("burst_bytes must hold at least one full packet (>= 2048)")
        self.n, self.mbps, self.burst_bytes, self.queue_ms = n, mbps, burst_bytes, queue_ms
        self._base = f"agora-netem-{os.getpid()}-{next(_serial)}"
        self.hub = f"{self._base}-hub"
        self.peers: List[NetnsPeer] = []
        self.created: List[str] = []
        self._procs: List[subprocess.Popen] = []
        self._hub_ready = False

    @property
    def namespaces(self) -> List[str]:
        """Every namespace this topology has (hub first), created or about to be created on entry."""
        peers = [p.netns for p in self.peers] or [f"{self._base}-p{i}" for i in range(self.n)]
        return [self.hub] + peers

    def __enter__(self) -> "NetnsTopology":
        ok, reason = available()
        if not ok:
            raise RuntimeError(f"network namespaces unavailable: {reason}")
        try:
            self._setup()
        except BaseException:
            self.teardown()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.teardown()

    def _add_namespace(self, name: str) -> None:
        _ip("netns", "add", name)
        self.created.append(name)
        _ip("-n", name, "link", "set", "lo", "up")

    def _setup(self) -> None:
        self._add_namespace(self.hub)
        _ip("-n", self.hub, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.hub, "link", "set", "br0", "up")
        self._hub_ready = True
        for _ in range(self.n):
            self.add_peer()

    def add_peer(self) -> NetnsPeer:
        """Create one more peer namespace on the bridge (capped at ``mbps``) and return it.

        Any failure half-way leaves the namespace in ``created``, so teardown still removes it.
        """
        if not self._hub_ready:
            raise RuntimeError("add_peer needs an entered topology (use `with NetnsTopology(...)`)")
        index = len(self.peers)
        if index >= self.MAX_PEERS:
            raise RuntimeError(f"a topology holds at most {self.MAX_PEERS} peers")
        peer = NetnsPeer(index, f"{self._base}-p{index}", f"{SUBNET}.{index + 1}")
        self._add_namespace(peer.netns)
        self.peers.append(peer)
        port = f"v{peer.index}"
        # Both ends are created in namespaces we own; the root namespace never sees them.
        _ip("-n", self.hub, "link", "add", port, "type", "veth", "peer", "name", peer.device, "netns", peer.netns)
        _ip("-n", self.hub, "link", "set", port, "master", "br0")
        _ip("-n", self.hub, "link", "set", port, "up")
        _ip("-n", peer.netns, "addr", "add", f"{peer.address}/24", "dev", peer.device)
        _ip("-n", peer.netns, "link", "set", peer.device, "up")
        if self.mbps is not None:
            self.set_rate(peer.index, self.mbps, add=True)
        return peer

    def set_rate(self, index: int, mbps: float, *, add: bool = False) -> None:
        """(Re)cap peer ``index``'s egress at ``mbps``."""
        peer = self.peers[index]
        _tc("-n", peer.netns, "qdisc", "add" if add else "replace", "dev", peer.device, "root", "tbf",
            "rate", f"{mbps}mbit", "burst", str(self.burst_bytes), "latency", f"{self.queue_ms}ms")

    def refuse_inbound(self, index: int) -> None:
        """Peer ``index`` can dial out but refuses inbound TCP connections, as behind a home router or a cloud NAT:
        a firewall rule in its namespace drops every connection-opening SYN (replies to its own connections pass).
        Needs ``iptables`` (see :func:`firewall_available`)."""
        _run(self.exec_argv(index, ["iptables", "-A", "INPUT", "-p", "tcp", "--syn", "-j", "DROP"]))

    def exec_argv(self, index: int, argv: Sequence[str]) -> List[str]:
        return ["ip", "netns", "exec", self.peers[index].netns, *argv]

    def popen(self, index: int, argv: Sequence[str], **kwargs) -> subprocess.Popen:
        """Start ``argv`` inside peer ``index``; it is killed at teardown if still running."""
        proc = subprocess.Popen(self.exec_argv(index, argv), **kwargs)
        self._procs.append(proc)
        return proc

    def run(self, index: int, argv: Sequence[str], timeout: float = 60.0, **kwargs) -> subprocess.CompletedProcess:
        kwargs.setdefault("capture_output", True)
        kwargs.setdefault("text", True)
        return subprocess.run(self.exec_argv(index, argv), timeout=timeout, **kwargs)

    def teardown(self) -> None:
        """Kill our processes, delete every namespace we created (the bridge and veths go with them).

        Besides the processes started with :meth:`popen`, anything else still running inside one of our namespaces
        is killed too (callers may start processes there with :meth:`exec_argv`, and those may have forked
        helpers): ``ip netns del`` only removes the name, and a namespace with a process left inside lives on.
        """
        self._hub_ready = False
        for proc in self._procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in self._procs:
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)
        self._procs.clear()
        for name in self.created:
            kill_inside(name)
        errors: Dict[str, str] = {}
        for name in reversed(self.created):
            result = _ip("netns", "del", name, check=False)
            if result.returncode != 0 and name in list_namespaces():
                errors[name] = result.stderr.strip()
        self.created = [name for name in self.created if name in errors]
        if errors:
            raise RuntimeError(f"could not delete namespaces: {errors}")
