"""Crash-only processes: SIGKILL of a role's main process (as the OOM killer does) leaves nothing behind.

Each role is started through the raw CLI; only its main process is killed (not its process group). Its helpers
(hivemind's DHT process, that process's p2pd, the averager process) must be gone within 5 s, and its port free:
a node restarted on the same ``--port`` serves again.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from swarm_util import kill_started

pytestmark = pytest.mark.slow

ORPHAN_DEADLINE_S = 5.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _port_is_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _agora(*args: str, log: Path) -> subprocess.Popen:
    # Its own session, like a process started from a shell; the test kills only the main process.
    return subprocess.Popen([sys.executable, "-m", "agora.cli", *args], stdout=log.open("w"),
                            stderr=subprocess.STDOUT, start_new_session=True)


def _wait_for(predicate, timeout: float, what: str, proc: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert proc.poll() is None, f"{what}: the process exited ({proc.returncode}): {log.read_text()[-2000:]}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}: {log.read_text()[-2000:]}"
        time.sleep(0.2)


def _serving(summary: Path) -> bool:
    try:
        return json.loads(summary.read_text()).get("state") == "serving"
    except (OSError, ValueError):
        return False


def _kill_main_and_check_tree(proc: subprocess.Popen, port: int, min_helpers: int) -> None:
    """SIGKILL ``proc`` alone; its whole tree must be gone within ORPHAN_DEADLINE_S and ``port`` free."""
    helpers = psutil.Process(proc.pid).children(recursive=True)
    names = sorted(p.name() for p in helpers)
    assert len(helpers) >= min_helpers, names
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)
    t0 = time.monotonic()
    gone, alive = psutil.wait_procs(helpers, timeout=ORPHAN_DEADLINE_S)
    left = [(p.pid, p.name()) for p in alive]
    for p in alive:  # the test cleans up after a failure too, by PID
        p.kill()
    assert not left, f"orphans {ORPHAN_DEADLINE_S:.0f}s after the main process died: {left} (of {names})"
    assert time.monotonic() - t0 <= ORPHAN_DEADLINE_S
    deadline = time.monotonic() + 2.0
    while not _port_is_free(port) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _port_is_free(port), f"port {port} still bound after the node's processes died"


def _cleanup(*procs: subprocess.Popen) -> None:
    kill_started(procs)


def test_a_killed_bootstrap_leaves_no_dht_process_and_frees_its_port(tmp_path):
    port = _free_port()
    maddr = tmp_path / "boot.maddr"
    log = tmp_path / "boot.log"
    boot = _agora("bootstrap", "--manifest", "tiny", "--port", str(port), "--maddr-file", str(maddr), log=log)
    try:
        _wait_for(lambda: maddr.exists() and maddr.read_text().strip(), 60, "the bootstrap peer", boot, log)
        _kill_main_and_check_tree(boot, port, min_helpers=2)  # the DHT process and its p2pd
    finally:
        _cleanup(boot)


def test_a_killed_node_leaves_nothing_behind_and_restarts_on_its_port(tmp_path):
    maddr = tmp_path / "boot.maddr"
    boot = _agora("bootstrap", "--manifest", "tiny", "--maddr-file", str(maddr), log=tmp_path / "boot.log")
    node = restarted = None
    try:
        _wait_for(lambda: maddr.exists() and maddr.read_text().strip(), 60, "the bootstrap peer", boot,
                  tmp_path / "boot.log")
        peer = maddr.read_text().split()[0]
        port = _free_port()
        args = ("node", "--manifest", "tiny", "--stage", "0", "--port", str(port), "--initial-peers", peer,
                "--rebalance-every", "0")
        summary, log = tmp_path / "node.json", tmp_path / "node.log"
        node = _agora(*args, "--summary", str(summary), log=log)
        _wait_for(lambda: _serving(summary), 120, "the node to serve", node, log)
        _kill_main_and_check_tree(node, port, min_helpers=3)  # DHT process, its p2pd, the averager process
        summary2, log2 = tmp_path / "node2.json", tmp_path / "node2.log"
        restarted = _agora(*args, "--summary", str(summary2), log=log2)
        _wait_for(lambda: _serving(summary2), 120, "the restarted node to serve on the same port", restarted, log2)
    finally:
        _cleanup(restarted, node, boot)
