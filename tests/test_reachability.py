"""Reachability: the dial-back a node asks of its peers before serving, `--reachability public`, and `agora doctor`,
on loopback and from a network namespace that refuses inbound connections (skipped where that cannot be built)."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hivemind.p2p import P2P

from agora.lab import netem
from agora.net.errors import RpcError
from agora.net import transport
from agora.net.reachability import (DIALBACK, DIRECT, UNKNOWN, UNREACHABLE, ConnectionPaths, DialbackServer,
                                    ReverseDialer, check_reachability, is_relayed, listening_port, register_hello)
from agora.ops.doctor import clock_skew

from swarm_util import kill_pids, processes_mentioning, wait_until

NS = "reach-test"
ENV = {**os.environ, "COLUMNS": "200"}  # rich wraps at 80 columns in a pipe; the checks read whole table rows


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_listening_port_and_clock_skew():
    assert listening_port(["/ip4/10.0.0.2/tcp/4321/p2p/QmaCpDMGvV2BGHeYERUEnRQAwe3N8SzbUtfsmvsqQLuvuJ"]) == 4321
    assert listening_port(["/ip4/10.0.0.2/udp/9/quic"]) is None
    assert clock_skew([]) is None
    # Records rewritten every 2.5 s look 0..2.5 s old with agreeing clocks; 30 s older when ours is 30 s ahead.
    assert abs(clock_skew([0.2, 1.1, 1.3, 2.4])) < 0.5
    assert clock_skew([30.2, 31.1, 31.3, 32.4]) == pytest.approx(30.0, abs=0.5)


def test_dialback_on_loopback():
    """A peer dials back only the address it sees the caller at: an open port is reachable, a closed one is not,
    and a second request within the period is refused (no port scanner for anyone)."""

    async def main():
        server_p2p = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        client_p2p = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                                      initial_peers=await server_p2p.get_visible_maddrs())
        listener = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", 0)
        open_port = listener.sockets[0].getsockname()[1]
        try:
            await DialbackServer(server_p2p, dial_timeout_s=2.0, every_s=0.0).register(NS)
            reach = await check_reachability(client_p2p, NS, open_port)
            assert reach.status == DIRECT, reach
            assert reach.answers[0]["tried"] == [f"127.0.0.1:{open_port}"], reach
            closed = _free_port()
            reach = await check_reachability(client_p2p, NS, closed)
            assert reach.status == UNREACHABLE and f"127.0.0.1:{closed}" in reach.explain(), reach
            assert f"Open TCP port {closed}" in reach.explain()
            with pytest.raises(RpcError) as err:  # a port out of range is refused, not dialled
                await transport.call(client_p2p, server_p2p.peer_id, NS, DIALBACK, {"port": 70000}, [], 10.0)
            assert err.value.code == "bad_metadata"
            await DialbackServer(server_p2p, every_s=60.0).register("limited")  # once per peer per minute
            assert (await check_reachability(client_p2p, "limited", open_port)).status == DIRECT
            limited = await check_reachability(client_p2p, "limited", open_port)
            assert limited.status == UNKNOWN and "rate_limited" in limited.explain(), limited
            assert (await check_reachability(client_p2p, "another-run", open_port)).status == UNKNOWN  # no handler
        finally:
            listener.close()
            await client_p2p.shutdown()
            await server_p2p.shutdown()

    asyncio.run(main())


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "agora.cli", *args]


def _wait_for_file(path: Path, proc: subprocess.Popen, timeout: float = 60.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and path.read_text().strip():
            return path.read_text().split()[0]
        assert proc.poll() is None, f"the bootstrap exited with {proc.returncode}"
        time.sleep(0.3)
    raise AssertionError(f"{path} was not written within {timeout:g}s")


def test_doctor_on_loopback(tmp_path):
    boot = subprocess.Popen(_cli("bootstrap", "--manifest", "tiny", "--maddr-file", str(tmp_path / "boot")),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        maddr = _wait_for_file(tmp_path / "boot", boot)
        port = _free_port()
        doc = subprocess.run(_cli("doctor", "--manifest", "tiny", "--initial-peers", maddr, "--port", str(port)),
                             capture_output=True, text=True, timeout=120, env=ENV)
        out = doc.stdout + doc.stderr
        assert doc.returncode == 0, out
        for line in ("manifest", "bootstrap", "run manifest", "memory", "disk"):
            assert any(row.startswith(f"│ {line} ") and "│ ok " in row for row in out.splitlines()), (line, out)
        assert f"direct: port {port} is reachable" in out, out
        assert "clock" in out and "this node would serve stage 0" in out, out
        # Another manifest under the same run id is refused, naming both hashes.
        other = tmp_path / "other.yaml"
        other.write_text((Path(__file__).parents[1] / "src/agora/presets/tiny.yaml").read_text()
                         .replace("lr: 0.003", "lr: 0.004"))
        bad = subprocess.run(_cli("doctor", "--manifest", str(other), "--initial-peers", maddr),
                             capture_output=True, text=True, timeout=120, env=ENV)
        assert bad.returncode == 1 and "manifest mismatch" in bad.stdout + bad.stderr, bad.stdout + bad.stderr
    finally:
        boot.terminate()
        try:
            boot.wait(timeout=20)
        except subprocess.TimeoutExpired:
            boot.kill()
        kill_pids(processes_mentioning(str(tmp_path)))


def _reported(summary: Path) -> bool:
    """Whether the node's summary holds the answer of its (background) reachability check."""
    try:
        return json.loads(summary.read_text()).get("reachability") is not None
    except (OSError, ValueError):
        return False


class _FakeDaemon:
    """Stands in for hivemind's P2P in ConnectionPaths: a fixed connection list (or a daemon that does not answer)."""

    def __init__(self, infos, fail=False):
        self.infos, self.fail = infos, fail

    async def list_peers(self):
        if self.fail:
            raise asyncio.TimeoutError()
        return self.infos


def test_connection_paths_tell_relayed_from_direct_connections():
    from types import SimpleNamespace

    relay = "/ip4/10.0.0.1/tcp/4001/p2p/QmRelay/p2p-circuit"
    assert is_relayed(relay) and not is_relayed("/ip4/10.0.0.2/tcp/4002")
    paths = ConnectionPaths()
    infos = [SimpleNamespace(peer_id="QmA", addrs=["/ip4/10.0.0.2/tcp/4002"]),
             SimpleNamespace(peer_id="QmB", addrs=[relay]),
             SimpleNamespace(peer_id="QmC", addrs=[relay])]
    asyncio.run(paths.sample(_FakeDaemon(infos)))
    asyncio.run(paths.sample(_FakeDaemon(infos[:2])))
    asyncio.run(paths.sample(_FakeDaemon([], fail=True)))
    out = paths.summary()
    assert out["samples"] == 2 and out["failed"] == 1
    assert out["direct_peers"] == 1 and out["relayed_peers"] == 2 and out["relayed_max"] == 2
    assert out["relayed_peer_ids"] == ["QmB", "QmC"]


def test_reverse_dialer_opens_a_connection_to_a_caller_on_loopback():
    """A peer never connected to a caller (the caller is a libp2p DHT client, as a trainer's daemon is, so nothing
    connects to it unasked): one round of the dialer opens a connection to it, found through the peer both joined
    by, a second round finds it open, and a caller that does not exist counts as failed."""

    async def main():
        boot = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        boot_addrs = [str(a) for a in await boot.get_visible_maddrs()]
        caller = await P2P.create(initial_peers=boot_addrs, host_maddrs=["/ip4/127.0.0.1/tcp/0"], dht_mode="client")
        node = await P2P.create(initial_peers=boot_addrs, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        try:
            await register_hello(caller, NS)
            # The precondition, not the feature: both have joined through boot (their daemons bootstrap in the
            # background, and on a busy machine the node once looked the caller up before boot knew it).
            joined = {str(caller.peer_id), str(node.peer_id)}

            async def boot_holds_both() -> bool:
                return joined <= {str(i.peer_id) for i in await boot.list_peers()}

            await wait_until(boot_holds_both, 20, "the caller and the node to join through boot")
            before = {str(i.peer_id) for i in await node.list_peers()}
            targets = [str(caller.peer_id)]
            dialer = ReverseDialer(node, NS, callers=lambda: _ready(targets), timeout_s=10.0)
            await dialer.round()
            after = {str(i.peer_id) for i in await node.list_peers()}
            first = dialer.summary()
            await dialer.round()
            targets.append("QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N")  # a peer id nobody runs
            await dialer.round()
            return str(caller.peer_id), before, after, first, dialer.summary()
        finally:
            for p in (caller, node, boot):
                await p.shutdown()

    caller_id, before, after, first, last = asyncio.run(main())
    assert caller_id not in before and caller_id in after
    assert first["opened"] == 1 and first["failed"] == 0
    assert last["opened"] == 1 and last["failed"] == 1 and last["rounds"] == 3


async def _ready(value):
    return value


fw_ok, fw_reason = netem.firewall_available()


@pytest.mark.skipif(not fw_ok, reason=f"cannot build a namespace that refuses inbound connections: {fw_reason}")
def test_namespace_that_refuses_inbound(tmp_path):
    """A peer that can dial out but not be dialled (a home router): `doctor` says it is not directly reachable,
    `--reachability public` refuses to start (exit 6) naming the port and what to open, and with `auto` it serves
    the head stage of a training run. The trainer (a DHT client nobody dials) reaches it only over the connection
    the node opens to it (ReverseDialer): the run completes and the node computed every microbatch."""
    with netem.NetnsTopology(4) as topo:
        boot_host, home_host, head_host, trainer_host = (p.address for p in topo.peers)
        topo.refuse_inbound(1)
        boot = topo.popen(0, _cli("bootstrap", "--manifest", "tiny", "--host", boot_host, "--maddr-file",
                                  str(tmp_path / "boot")), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        maddr = _wait_for_file(tmp_path / "boot", boot)
        port = str(_free_port())
        doc = topo.run(1, _cli("doctor", "--manifest", "tiny", "--initial-peers", maddr, "--host", home_host,
                               "--port", port), timeout=180, env=ENV)
        out = doc.stdout + doc.stderr
        rows = out.splitlines()
        assert any(r.startswith("│ bootstrap ") and "│ ok " in r for r in rows), out  # dialling out works
        assert any(r.startswith("│ reachability ") and "│ warn " in r for r in rows), out
        assert f"{home_host}:{port}" in out and "relayed: port" in out, out
        public = topo.run(1, _cli("node", "--manifest", "tiny", "--initial-peers", maddr, "--host", home_host,
                                  "--port", port, "--stage", "1", "--reachability", "public"), timeout=180, env=ENV)
        text = " ".join((public.stdout + public.stderr).split())
        assert public.returncode == 6, text[-3000:]
        assert f"port {port} is not reachable" in text and f"Open TCP port {port}" in text, text[-3000:]

        home_summary, head_summary = tmp_path / "home.json", tmp_path / "head.json"
        home = topo.popen(1, _cli("node", "--manifest", "tiny", "--initial-peers", maddr, "--host", home_host,
                                  "--stage", "0", "--summary", str(home_summary)),
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        head = topo.popen(2, _cli("node", "--manifest", "tiny", "--initial-peers", maddr, "--host", head_host,
                                  "--stage", "1", "--summary", str(head_summary)),
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and home.poll() is None and not _reported(home_summary):
            time.sleep(0.5)
        tokens = 3 * 16 * 64  # three target batches of the tiny manifest
        trained = topo.run(3, _cli("train", "--manifest", "tiny", "--initial-peers", maddr, "--host", trainer_host,
                                   "--max-tokens", str(tokens), "--summary", str(tmp_path / "train.json")),
                           timeout=300, env=ENV)
        assert trained.returncode == 0, (trained.stdout + trained.stderr)[-3000:]
        status = topo.run(3, _cli("status", "--manifest", "tiny", "--initial-peers", maddr, "--json"), timeout=120)
        assert status.returncode == 0, status.stderr[-2000:]
        stages = json.loads(status.stdout)["stages"]
        assert [[p["reachability"] for p in st["peers"]] for st in stages] == [["relayed"], ["direct"]], stages
        for proc in (home, head):
            proc.terminate()
        log = home.communicate(timeout=60)[0]
        head.wait(timeout=60)
        assert "Restarting this peer's libp2p daemon in relay mode" in log, log[-3000:]
        assert "Serving meanwhile over connections this node opens to the peers that call it" in log, log[-3000:]
        reach = json.loads(home_summary.read_text())["reachability"]
        assert reach["status"] == "unreachable" and reach["answers"], reach
        # The node nobody can dial computed the head of every microbatch the trainer completed, over the connection
        # it opened to the trainer itself (the trainer's DHT never dials anyone who has not dialled it).
        trainer = json.loads((tmp_path / "train.json").read_text())
        completed = trainer["microbatches"]["completed"]
        assert completed * 8 * 64 >= tokens, trainer["microbatches"]
        home_out = json.loads(home_summary.read_text())
        assert home_out["counters"]["forward"] >= completed, log[-2000:]
        assert home_out["reverse_dial"]["opened"] >= 1 and home_out["reverse_dial"]["rounds"] >= 1, home_out
        assert home_out["connections"]["samples"] >= 1 and home_out["connections"]["direct_peers"] >= 2, home_out
        assert trainer["called"][home_out["peer_id"]]["delivered"] >= completed, trainer["called"]
        # A reachable node opens no connections to its callers.
        assert json.loads(head_summary.read_text())["reverse_dial"]["rounds"] >= 1
        assert json.loads(head_summary.read_text())["reverse_dial"]["opened"] == 0

