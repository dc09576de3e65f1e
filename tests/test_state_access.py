"""The front door to the weights: a stage's state goes to its own replicas and to the manifest's readers only.

In-process swarms (real DHTs and libp2p daemons on 127.0.0.1). The "script" is what anyone can write: a DHT peer of
the run that calls ``get_state`` on every stage, then pretends to be a joining replica of one stage after another.
"""

from __future__ import annotations

import asyncio
import sys
import time

import pytest
import torch

from swarm_util import local_swarm, wait_until
from agora.config import load_manifest
from agora.net.dht import Endpoint, make_dht
from agora.net.records import PeerState, StageRecord, announce, read_subkeys, stage_key
from agora.net.state_transfer import StateSnapshots, fetch_state
from agora.net.transport import RpcError
from agora.server.node import NodeOptions, StageNode
from agora.server.state_access import StateAccess, ledger_key, read_ledger
from agora.trust.identity import ensure_identity, peer_id_of

PERIOD_S = 6.0


def _manifest(tmp_path, downloads_per_period: int = 4):
    reader_key = tmp_path / "operator.key"
    reader = peer_id_of(ensure_identity(reader_key))
    m = load_manifest("tiny").with_overrides(**{
        "security.state_access.readers": [reader], "security.state_access.period_s": PERIOD_S,
        "security.state_access.downloads_per_period": downloads_per_period})
    return m, reader_key


def _meta(m, stage: int) -> dict:
    return {"run_id": m.run_id, "manifest_hash": m.hash, "stage": stage}


async def _claim(dht, m, stage: int, state: str) -> None:
    """What the script announces: its own (signed) record at ``stage`` in ``state``."""
    rec = StageRecord(peer_id=str(dht.peer_id), stage=stage, state=state, manifest_hash=m.hash)
    await asyncio.get_running_loop().run_in_executor(
        None, announce, dht, stage_key(m.run_id, stage), str(dht.peer_id), rec.to_value())


async def _refused(p2p, node: StageNode, m) -> RpcError:
    with pytest.raises(RpcError) as err:
        await fetch_state(p2p, node.peer_id, m.run_id, _meta(m, node.stage_index), timeout=30)
    return err.value


def test_a_script_gets_no_stage_a_joiner_gets_one_and_a_reader_gets_all(tmp_path):
    m, reader_key = _manifest(tmp_path)

    async def main():
        async with local_swarm(m, [0, 1], NodeOptions(stall_step_s=1e9)) as (boot, peers, nodes):
            # Give stage 1 a state of its own (as if trained), so a joiner's copy is verifiable.
            tail = nodes[1]
            step, names, tensors = tail.runtime.export_state()
            tensors = [t + 0.01 if n.startswith("param/") else t for n, t in zip(names, tensors)]

            def set_state():
                tail.runtime.import_state(5, names, tensors)
                tail.sync._set_fingerprint()

            await tail.run_compute(set_state)
            await tail.announce()

            script = make_dht(peers, manifest=m)
            reader = make_dht(peers, Endpoint(identity=str(reader_key)), client_mode=True, manifest=m, writes=False)
            try:
                p2p = await script.replicate_p2p()
                # 1. Anyone in the run calls get_state on every stage: nothing.
                out = {"open": [(await _refused(p2p, n, m)).code for n in nodes]}
                # 2. It announces itself as a joiner of stage 0: that stage, and only that one.
                await _claim(script, m, 0, PeerState.SYNCING.value)
                first, _, got = await fetch_state(p2p, nodes[0].peer_id, m.run_id, _meta(m, 0), timeout=30)
                out["joined_0"] = len(got)
                await _claim(script, m, 1, PeerState.SYNCING.value)  # still syncing at 0 too
                out["both"] = str(await _refused(p2p, nodes[1], m))
                await _claim(script, m, 0, PeerState.LEAVING.value)  # "left" stage 0 a moment ago
                out["after_0"] = str(await _refused(p2p, nodes[1], m))
                ledger = await asyncio.get_running_loop().run_in_executor(None, read_ledger, boot, m)
                out["ledger"] = ledger.get(str(script.peer_id), [])
                # A page token issued to one peer is no grant for another.
                snaps = StateSnapshots()
                token = snaps.add(1, None, ["a"], [torch.zeros(3)], owner="someone")
                with pytest.raises(RpcError, match="issued to another peer"):
                    snaps.serve(token, 0, owner="someone-else")
                # 3. A period later the script may take stage 1 (UPM's rotations make that copy useless with the
                # stage-0 one; without them this is what remains possible: docs/TRUST.md).
                await asyncio.sleep(PERIOD_S + 1.0)
                await _claim(script, m, 1, PeerState.SYNCING.value)
                reply, _, _ = await fetch_state(p2p, nodes[1].peer_id, m.run_id, _meta(m, 1), timeout=30)
                out["later_1"] = reply["step"]
                # 4. The reader named in the manifest downloads every stage, with no record at all.
                rp2p = await reader.replicate_p2p()
                out["reader"] = [(await fetch_state(rp2p, n.peer_id, m.run_id, _meta(m, n.stage_index), 30))[0]["step"]
                                 for n in nodes]
                # 5. A real joiner of stage 1 syncs.
                dht = make_dht(peers, manifest=m)
                joiner = StageNode(m, 1, dht, NodeOptions(stall_step_s=1e9))
                try:
                    await joiner.start()
                    out["joiner"] = (joiner.step, joiner.sync.resyncs, joiner.sync.fingerprint == tail.sync.fingerprint)
                finally:
                    await joiner.stop()
                    dht.shutdown()
                out["refused"] = [n.counters.rejected_by_code.get("unauthorized", 0) for n in nodes]
                out["granted"] = [n.state_access.granted for n in nodes]
                return out
            finally:
                script.shutdown()
                reader.shutdown()

    out = asyncio.run(main())
    assert out["open"] == ["unauthorized", "unauthorized"]
    assert out["joined_0"] > 0
    assert "also announces stage 0" in out["both"]
    assert "held stage 0" in out["after_0"] and "security.state_access.period_s" in out["after_0"]
    assert 0 in [stage for stage, _ in out["ledger"]]  # the grant is witnessed in the DHT, not only in memory
    assert out["later_1"] == 5
    assert out["reader"] == [0, 5]
    assert out["joiner"] == (5, 1, True)
    assert out["refused"][0] >= 1 and out["refused"][1] >= 3
    assert out["granted"][0] == 1 and out["granted"][1] == 2  # the script (twice refused, then once) + the joiner


def test_downloads_per_identity_are_rate_limited(tmp_path):
    m, _ = _manifest(tmp_path, downloads_per_period=2)

    async def main():
        async with local_swarm(m, [0, 1], NodeOptions(stall_step_s=1e9)) as (boot, peers, nodes):
            script = make_dht(peers, manifest=m)
            try:
                p2p = await script.replicate_p2p()
                await _claim(script, m, 0, PeerState.SYNCING.value)
                codes = []
                for _ in range(3):
                    try:
                        await fetch_state(p2p, nodes[0].peer_id, m.run_id, _meta(m, 0), timeout=30)
                        codes.append("ok")
                    except RpcError as err:
                        codes.append(err.code)
                return codes
            finally:
                script.shutdown()

    assert asyncio.run(main()) == ["ok", "ok", "rate_limited"]


def test_a_peer_that_served_one_stage_gets_no_other_within_the_period(tmp_path):
    """Serving is witnessed by the other replicas in the state ledger: a peer that served stage 0 and stopped
    announcing it cannot take stage 1's state within the period, whatever it writes itself."""
    m, _ = _manifest(tmp_path)

    async def main():
        async with local_swarm(m, [0, 0, 1], NodeOptions(stall_step_s=1e9)) as (boot, peers, nodes):
            x, y, tail = nodes
            loop = asyncio.get_running_loop()

            def seen_by_y() -> bool:
                raw = read_subkeys(boot, ledger_key(m.run_id))
                holders = raw.get(y.peer_id, {}).get("holders", {})
                return holders.get(x.peer_id, [None])[0] == 0

            t0 = time.monotonic()
            while not await loop.run_in_executor(None, seen_by_y):
                assert time.monotonic() - t0 < 30, "stage 0's other replica never witnessed x in the state ledger"
                await asyncio.sleep(0.5)
            await x.stop()  # leaves stage 0 (its record says "leaving"); its DHT and identity stay
            await _claim(x.dht, m, 1, PeerState.SYNCING.value)
            p2p = await x.dht.replicate_p2p()
            refused = str(await _refused(p2p, tail, m))
            # The same identity restarted at stage 1 knows from the ledger how long to wait instead of being refused.
            async def run_io(fn, *args):  # x's own executor is shut down with it
                return await loop.run_in_executor(None, fn, *args)

            again = StateAccess(m, x.peer_id, x.dht, run_io)
            return refused, await again.own_wait(1), await again.own_wait(0)

    refused, wait_other, wait_same = asyncio.run(main())
    assert "held stage 0" in refused
    assert 0 < wait_other <= PERIOD_S + 3 and wait_same == 0


def test_export_from_a_live_swarm_needs_a_reader_identity(tmp_path):
    """The raw CLI: ``agora export --initial-peers`` is refused with a message that says what to do, and works with
    ``--identity`` of a reader named in the manifest."""
    m, reader_key = _manifest(tmp_path)
    manifest_path = tmp_path / "manifest.yaml"
    manifest_path.write_text(m.to_yaml())

    async def export(*extra: str) -> tuple[int, str]:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "agora.cli", "export", "--manifest", str(manifest_path), *extra,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
        try:
            out, _ = await asyncio.wait_for(proc.communicate(), 180)
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
        return proc.returncode, out.decode()

    async def main():
        async with local_swarm(m, [0, 1], NodeOptions(stall_step_s=1e9)) as (boot, peers, nodes):
            await wait_until(lambda: all(n.state == PeerState.SERVING for n in nodes), 30, "nodes serving")
            args = ["--out", str(tmp_path / "model"), "--timeout", "30",
                    *[a for p in peers for a in ("--initial-peers", p)]]
            return await export(*args), await export(*args, "--identity", str(reader_key))

    (rc_open, out_open), (rc_reader, out_reader) = asyncio.run(main())
    assert rc_open == 2 and "security.state_access.readers" in out_open and "unauthorized" in out_open, out_open
    assert rc_reader == 0 and "exported run" in out_reader, out_reader
    assert (tmp_path / "model").is_dir()
