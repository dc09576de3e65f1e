"""`agora demo --link-mbps` on the kernel backend: every peer in its own network namespace, capped by tc tbf.

Skipped unless this runs as root with working network namespaces (``agora.lab.netem.available()``). What is checked:
the run trains, each peer process (and its hivemind DHT process and libp2p daemon) really lives in a namespace of
its own that carries the tbf cap, the demo's own DHT client lives in a namespace while none of this process's
threads stays there, the dashboard's page is served on the host's loopback with live data from the namespaced
swarm, the replica check still reaches the peers, and at the end no namespace and no process of the run is left. A fast test without peers covers reusing a dead peer's namespace (chaos replacements).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import psutil
import pytest

from agora.lab import netem
from swarm_util import kill_pids, leftover_children, processes_mentioning

ok, reason = netem.available()
pytestmark = pytest.mark.skipif(not ok, reason=f"needs root and network namespaces: {reason}")


def _threads_namespaces() -> set[str]:
    """The network namespace of every thread of this process (setns(2) acts per thread)."""
    found = set()
    for tid in os.listdir("/proc/self/task"):
        try:
            found.add(os.readlink(f"/proc/self/task/{tid}/ns/net"))
        except OSError:  # the thread ended meanwhile
            continue
    return found


def test_demo_runs_every_peer_in_its_own_capped_namespace_and_removes_them(tmp_path: Path) -> None:
    from agora.lab.demo import run_demo

    out = tmp_path / "wan"
    home = os.readlink("/proc/self/ns/net")
    mine = f"agora-netem-{os.getpid()}-"
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    inside: dict[str, dict[int, list[str]]] = {}  # namespace -> {pid: cmdline} seen while training
    qdiscs: dict[str, str] = {}
    homes: set[str] = set()
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    pages: list[dict] = []

    def on_tick(snap: dict) -> None:
        homes.update(_threads_namespaces())
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/swarm", timeout=5) as reply:
                pages.append(json.loads(reply.read()))
        except OSError:  # not up yet, or its first DHT poll is still running
            pass
        for name in netem.list_namespaces():
            if not name.startswith(mine) or name.endswith("-hub"):
                continue
            for pid in netem.pids_in(name):
                try:
                    inside.setdefault(name, {})[pid] = psutil.Process(pid).cmdline()
                except psutil.Error:
                    continue
            if name not in qdiscs:
                qdiscs[name] = subprocess.run(["tc", "-n", name, "qdisc", "show", "dev", "eth0"], capture_output=True,
                                              text=True, timeout=10).stdout

    t0 = time.monotonic()
    try:
        summary = run_demo(preset="tiny", stages=2, replicas=2, steps=2, out=out, live=False, timeout=150,
                           val_batches=1, link_mbps=20, link_latency_ms=5, link_backend="netns", on_tick=on_tick,
                           measure_divergence=True, dashboard_port=port)
    finally:
        time.sleep(1)
        left_namespaces = [n for n in netem.list_namespaces() if n.startswith(mine)]
        left_procs = processes_mentioning(str(out))
        left_children = leftover_children(before)
        # A failed run must not leak into the next test: kill by PID and remove the namespaces it named.
        kill_pids(left_procs + [p.pid for p in left_children])
        for name in left_namespaces:
            netem.kill_inside(name)
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=20)
    print(f"netns demo: {time.monotonic() - t0:.1f} s, {summary['tokens_per_s']:.0f} tokens/s")
    assert left_namespaces == [], left_namespaces
    assert left_procs == [], left_procs
    assert left_children == [], left_children
    assert summary["finished"]
    assert min(summary["steps_per_stage"].values()) >= 2

    link = summary["link"]
    assert link["backend"] == "netns" and link["mbps"] == 20
    assert link["agora_link"] == "5ms"  # latency only: tbf caps the rate, the transport must not cap it again
    roles = {"bootstrap-1": "bootstrap", "dashboard-6": "dashboard", "train-7": "train",
             **{n: "node" for n in ("node0-2", "node0-3", "node1-4", "node1-5")}}
    assert set(link["peers"]) == set(roles)
    assert (out / "bootstrap.maddr").read_text().startswith("/ip4/10.231.0.")
    namespaces = [p["netns"] for p in link["peers"].values()] + [link["observer"]["netns"]]
    addresses = [p["address"] for p in link["peers"].values()] + [link["observer"]["address"]]
    assert len(set(namespaces)) == len(namespaces) and len(set(addresses)) == len(addresses)
    for name, peer in link["peers"].items():
        cmds = inside.get(peer["netns"], {}).values()
        clis = [c for c in cmds if "agora.cli" in c]
        # only this peer runs there (its process and hivemind's forks of it: same command line), bound to the
        # namespace's address, with its libp2p daemon
        assert {c[c.index("agora.cli") + 1] for c in clis} == {roles[name]}, (name, clis)
        assert len({tuple(c) for c in clis}) == 1, (name, clis)
        # the dashboard serves its page from the host and only forks its DHT client into the namespace
        host_flag = "--dht-host" if roles[name] == "dashboard" else "--host"
        assert clis[0][clis[0].index(host_flag) + 1] == peer["address"]
        assert any("p2pd" in " ".join(c) for c in cmds), (name, list(cmds))
        assert "tbf" in qdiscs[peer["netns"]] and "20Mbit" in qdiscs[peer["netns"]], qdiscs[peer["netns"]]
    # The demo's DHT client and daemon run in the observer slot, yet none of this process's threads stayed there.
    observer = inside.get(link["observer"]["netns"], {})
    assert observer and not any("agora.cli" in c for c in observer.values())
    assert any("p2pd" in " ".join(c) for c in observer.values())
    assert homes == {home} and _threads_namespaces() == {home}
    # The page, fetched from the host's loopback, shows the namespaced swarm serving.
    assert any(p["state"] == "serving" for page in pages for st in page["stages"] for p in st["peers"]), pages[-1:]
    # Replica averaging and the end-of-run state download both went through the capped namespaces.
    assert summary["rounds_ok"] > 0
    div = summary["replica_divergence"]
    assert all(v["replicas"] == 2 for v in div["stages"].values()), div


def test_a_dead_peers_namespace_is_reused_only_once_everything_in_it_is_gone(tmp_path: Path) -> None:
    from agora.lab.demo import Child, Swarm

    with netem.NetnsTopology(0, mbps=50) as topo:
        swarm = Swarm(tmp_path / "manifest.yaml", tmp_path, topology=topo)
        first = swarm.free_slot()
        proc = subprocess.Popen(topo.exec_argv(first.index, ["sleep", "30"]))
        swarm.children.append(Child("node", "node0-1", proc, tmp_path / "a.log", tmp_path / "a.json", 0, first))
        second = swarm.free_slot()
        assert second.index != first.index  # taken by a live peer
        swarm.children.append(Child("node", "node0-2", subprocess.Popen(topo.exec_argv(second.index, ["sleep", "30"])),
                                    tmp_path / "b.log", tmp_path / "b.json", 0, second))
        helper = subprocess.Popen(topo.exec_argv(first.index, ["sleep", "30"]))  # e.g. an orphaned daemon
        deadline = time.time() + 10  # `ip netns exec` enters the namespace a moment after Popen returns
        while helper.pid not in netem.pids_in(first.netns) and time.time() < deadline:
            time.sleep(0.05)
        proc.kill()
        proc.wait(timeout=10)
        assert swarm.free_slot().index == 2  # the peer is dead but something still runs in its namespace
        helper.kill()
        helper.wait(timeout=10)
        assert swarm.free_slot() == first
        names = topo.namespaces
    assert not set(names) & set(netem.list_namespaces())
    assert all(c.proc.poll() is not None for c in swarm.children)  # teardown killed what was left inside
