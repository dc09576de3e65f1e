"""Link emulation: the in-transport token bucket, and the tc/netns testbed (skipped where it cannot run)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import pytest

from agora.lab import netem
from agora.lab.netem import LinkThrottle, NetnsTopology, parse_link_spec


def test_parse_link_spec():
    assert parse_link_spec("80mbit,50ms") == (80.0, 50.0)
    assert parse_link_spec("500kbit") == (0.5, 0.0)
    assert parse_link_spec("1gbit, 5ms") == (1000.0, 5.0)
    assert parse_link_spec("20ms") == (None, 20.0)
    with pytest.raises(ValueError):
        parse_link_spec("fast")


def test_from_env(monkeypatch):
    monkeypatch.delenv("AGORA_LINK", raising=False)
    assert LinkThrottle.from_env() is None
    monkeypatch.setenv("AGORA_LINK", "16mbit,10ms")
    t = LinkThrottle.from_env()
    assert t is not None and t.mbps == 16.0 and t.latency_s == pytest.approx(0.01)


def test_reserve_is_exact_token_bucket():
    now = [100.0]
    t = LinkThrottle(8.0, clock=lambda: now[0])  # 1 MB/s
    assert t.reserve(500_000) == pytest.approx(0.5)
    assert t.reserve(500_000) == pytest.approx(1.0)  # queued behind the first
    now[0] += 5.0  # idle: no credit without a burst
    assert t.reserve(100_000) == pytest.approx(0.1)
    b = LinkThrottle(8.0, burst_bytes=200_000, clock=lambda: now[0])
    assert b.reserve(100_000) == 0.0  # within the burst
    assert b.reserve(300_000) == pytest.approx(0.2)  # 400k total, 200k of credit
    assert LinkThrottle(None, latency_ms=5).reserve(10**9) == 0.0


def test_throttle_transfer_takes_at_least_bytes_over_rate():
    """1 MB in 64 KiB chunks at 16 Mbit/s + 20 ms latency: >= 0.5 s + 0.02 s, measured with time.monotonic."""
    nbytes, mbps, chunk = 1_000_000, 16.0, 65536
    throttle = LinkThrottle(mbps, latency_ms=20)

    async def transfer() -> float:
        t0 = time.monotonic()
        sent = 0
        while sent < nbytes:
            n = min(chunk, nbytes - sent)
            await throttle.send(n, latency=(sent == 0))
            sent += n
        return time.monotonic() - t0

    elapsed = asyncio.run(transfer())
    assert elapsed >= nbytes * 8 / (mbps * 1e6) + 0.02, elapsed
    assert elapsed < 5.0  # sanity: pacing, not stalling (generous for a loaded machine)
    assert throttle.bytes_sent == nbytes


def test_throttle_is_shared_by_concurrent_senders():
    """Two concurrent 250 kB messages on one 8 Mbit/s link: the pair takes >= 0.5 s, not 0.25 s."""
    throttle = LinkThrottle(8.0)

    async def one() -> None:
        for _ in range(5):
            await throttle.send(50_000, latency=False)

    async def both() -> float:
        t0 = time.monotonic()
        await asyncio.gather(one(), one())
        return time.monotonic() - t0

    assert asyncio.run(both()) >= 0.5


# ------------------------------------------------------------------------------------------ namespaces

ok, reason = netem.available()
needs_netns = pytest.mark.skipif(not ok, reason=f"namespace backend unavailable: {reason}")

SERVER = r"""
import socket, sys
nbytes = int(sys.argv[2])
srv = socket.socket(); srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind((sys.argv[1], 5201)); srv.listen(1)
print("ready", flush=True)
conn, _ = srv.accept()
got = 0
while got < nbytes:
    data = conn.recv(1 << 16)
    if not data:
        break
    got += len(data)
conn.sendall(b"k"); conn.close(); print(got, flush=True)
"""

CLIENT = r"""
import socket, sys, time
nbytes = int(sys.argv[2])
s = socket.create_connection((sys.argv[1], 5201), timeout=30)
t0 = time.monotonic()
s.sendall(b"\0" * nbytes)
assert s.recv(1) == b"k"
print(time.monotonic() - t0, flush=True)
"""


@needs_netns
def test_netns_tbf_caps_a_tcp_transfer_and_teardown_removes_everything():
    nbytes, mbps = 1_000_000, 16.0  # ~0.5 s at the cap
    with NetnsTopology(2, mbps=mbps) as topo:
        names = topo.namespaces
        assert all(name in netem.list_namespaces() for name in names)
        qdisc = topo.run(1, ["tc", "qdisc", "show", "dev", "eth0"]).stdout
        assert "tbf" in qdisc and "16Mbit" in qdisc, qdisc
        server = topo.popen(0, [sys.executable, "-c", SERVER, topo.peers[0].address, str(nbytes)],
                            stdout=subprocess.PIPE, text=True)
        assert server.stdout.readline().strip() == "ready"
        client = topo.run(1, [sys.executable, "-c", CLIENT, topo.peers[0].address, str(nbytes)], timeout=60)
        assert client.returncode == 0, client.stderr
        elapsed = float(client.stdout.strip())
        assert server.wait(timeout=30) == 0 and int(server.stdout.readline()) == nbytes
        # tbf counts L2 bytes (headers included, ~4.6% on top of the payload), the full 16 KiB bucket lets the
        # first burst through at once: the payload time bound B*8/X still holds.
        assert elapsed >= nbytes * 8 / (mbps * 1e6), elapsed
        print(f"netns tcp: {nbytes} B at {mbps} Mbit/s took {elapsed:.3f} s (bound {nbytes * 8 / mbps / 1e6:.3f} s)")
    assert not set(names) & set(netem.list_namespaces())
    assert server.poll() is not None


@needs_netns
def test_netns_cleanup_on_error_in_body_and_in_setup(monkeypatch):
    with pytest.raises(ZeroDivisionError):
        with NetnsTopology(2, mbps=10) as topo:
            names = topo.namespaces
            sleeper = topo.popen(0, ["sleep", "30"])
            1 / 0
    assert not set(names) & set(netem.list_namespaces())
    assert sleeper.poll() is not None  # killed at teardown

    real_tc = netem._tc
    calls = {"n": 0}

    def failing_tc(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:  # second peer's qdisc: setup fails half-way
            raise RuntimeError("injected tc failure")
        return real_tc(*args, **kwargs)

    monkeypatch.setattr(netem, "_tc", failing_tc)
    topo = NetnsTopology(2, mbps=10)
    with pytest.raises(RuntimeError, match="injected"):
        topo.__enter__()
    assert not set(topo.namespaces) & set(netem.list_namespaces())
    assert topo.created == []


def test_cleanup_stale_only_touches_dead_creators(monkeypatch):
    listed = ["agora-netem-999999999-0-hub", f"agora-netem-{__import__('os').getpid()}-0-p0", "someone-elses-ns"]
    deleted = []
    monkeypatch.setattr(netem, "list_namespaces", lambda: listed)

    def fake_ip(*args, check=True):
        deleted.append(args[-1])
        return subprocess.CompletedProcess(args, 0, "", "")

    monkeypatch.setattr(netem, "_ip", fake_ip)
    assert netem.cleanup_stale() == ["agora-netem-999999999-0-hub"]
    assert deleted == ["agora-netem-999999999-0-hub"]


def test_demo_link_plan_uses_namespaces_when_possible_and_says_why_not(monkeypatch):
    """``agora demo --link-mbps``: the kernel cap when namespaces work (latency alone left to the transport, so the
    rate is never throttled twice), else the in-transport throttle with the reason; forcing netns never falls back."""
    from agora.lab.demo import plan_links

    monkeypatch.setattr(netem, "available", lambda refresh=False: (True, "ok"))
    plan = plan_links(20, 30)
    assert (plan.backend, plan.agora_link) == ("netns", "30ms")
    assert plan_links(20).agora_link is None
    assert plan_links(20, 30, "transport").agora_link == "20mbit,30ms"
    assert plan_links(None, 30).backend == "transport" and plan_links(None, 30).agora_link == "30ms"
    assert plan_links(None, 0).backend == "none"

    monkeypatch.setattr(netem, "available", lambda refresh=False: (False, "needs root (network namespaces and tc)"))
    plan = plan_links(20, 30)
    assert (plan.backend, plan.agora_link) == ("transport", "20mbit,30ms")
    assert "needs root" in plan.reason and "needs root" in plan.describe()
    with pytest.raises(RuntimeError, match="needs root"):
        plan_links(20, 30, "netns")
    with pytest.raises(ValueError):
        plan_links(20, 0, "carrier-pigeon")
