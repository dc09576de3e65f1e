"""Run-level security, wired end to end: signed manifests, allow-listed runs, certified records and RPCs.

The swarm here is real (hivemind DHTs and libp2p daemons on 127.0.0.1, stage nodes on this test's loop); the
intruder is a peer that does everything an honest one does, except that the authority never certified its key.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import pytest
import torch
from hivemind.utils import get_dht_time
from typer.testing import CliRunner

from agora.cli import app
from agora.config import ManifestError, load_manifest
from agora.trust import identity as I
from agora.net import transport
from agora.trust.credentials import CredentialError, load_credentials, save_certificate
from agora.net.protocol import FWD_BWD, GET_STATE
from agora.server.node import NodeOptions, StageNode
from agora.net.dht import Endpoint, JoinError, make_dht, visible_maddrs
from agora.net.records import announce, read_subkeys, stage_key, trainers_key

pytestmark = pytest.mark.usefixtures("one_torch_thread")
runner = CliRunner()


def _keygen(path) -> str:
    result = runner.invoke(app, ["keygen", str(path)])
    assert result.exit_code == 0, result.output
    return (path.parent / (path.name + ".pub")).read_text().strip()


@pytest.fixture(scope="module")
def run_files(tmp_path_factory):
    """An allow-listed tiny run: authority key, signed manifest, two certified peers and one uncertified key."""
    d = tmp_path_factory.mktemp("run")
    authority_pub = _keygen(d / "authority.key")
    base = load_manifest("tiny").model_dump(mode="json")
    base["run_id"] = "secure-tiny"
    base["security"] = {"authority": authority_pub, "allow_list": True}
    manifest_file = d / "run.yaml"
    manifest_file.write_text("# a run only certified peers may join\n" + json.dumps(base))
    result = runner.invoke(app, ["sign-manifest", str(manifest_file), "--key", str(d / "authority.key")])
    assert result.exit_code == 0, result.output
    for name in ("node0", "node1", "trainer", "intruder"):
        _keygen(d / f"{name}.key")
    for name in ("node0", "node1", "trainer"):
        result = runner.invoke(app, ["certify", str(d / f"{name}.key.pub"), "--key", str(d / "authority.key"),
                                     "--run", "secure-tiny", "--out", str(d / f"{name}.cert")])
        assert result.exit_code == 0, result.output
    return d


def test_signed_manifest_loads_and_a_tampered_copy_is_refused(run_files, tmp_path):
    m = load_manifest(str(run_files / "run.yaml"))
    assert m.security.allow_list and m.run_id == "secure-tiny"

    tampered = tmp_path / "run.yaml"
    tampered.write_text((run_files / "run.yaml").read_text().replace('"lr": 0.003', '"lr": 0.03'))
    assert tampered.read_text() != (run_files / "run.yaml").read_text()
    (tmp_path / "run.yaml.sig").write_bytes((run_files / "run.yaml.sig").read_bytes())
    with pytest.raises(ManifestError, match="does not match its signature"):
        load_manifest(str(tampered))
    # The CLI refuses it before starting anything, with the reason and exit code 2.
    proc = subprocess.run([sys.executable, "-m", "agora.cli", "node", "--manifest", str(tampered)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "does not match its signature" in proc.stderr.replace("\n", " ")

    unsigned = tmp_path / "unsigned.yaml"
    unsigned.write_text((run_files / "run.yaml").read_text())
    with pytest.raises(ManifestError, match="signature .* is missing"):
        load_manifest(str(unsigned))


def test_credentials_are_checked_before_joining(run_files):
    m = load_manifest(str(run_files / "run.yaml"))
    ok = load_credentials(m, str(run_files / "node0.key"), str(run_files / "node0.cert"))
    assert ok.peer_id == I.peer_id_of(ok.key)
    with pytest.raises(CredentialError, match="allow-listed: pass --identity"):
        load_credentials(m, None, None)
    with pytest.raises(CredentialError, match="pass --certificate"):
        load_credentials(m, str(run_files / "intruder.key"), None)
    with pytest.raises(CredentialError, match="issued for another key"):  # someone else's certificate
        load_credentials(m, str(run_files / "intruder.key"), str(run_files / "node0.cert"))
    # A certificate the intruder signs for itself with its own key is not the authority's.
    forged = I.issue_certificate(I.load_private_key(run_files / "intruder.key"), m.run_id,
                                 I.load_private_key(run_files / "intruder.key"))
    save_certificate(forged, run_files / "forged.cert")
    with pytest.raises(CredentialError, match="not the authority's"):
        load_credentials(m, str(run_files / "intruder.key"), str(run_files / "forged.cert"))
    with pytest.raises(JoinError) as err:
        make_dht(manifest=m, endpoint=Endpoint(identity=str(run_files / "intruder.key")))
    assert err.value.exit_code == 5
    # Read-only clients (status, dashboard) need no certificate.
    assert load_credentials(m, None, None, writes=False).certificate is None


def test_allow_listed_swarm_serves_certified_peers_only(run_files):
    m = load_manifest(str(run_files / "run.yaml"))
    f = run_files

    async def main():
        boot = make_dht(manifest=m, writes=False)  # `agora bootstrap --manifest`: enforces the run's rules too
        peers = visible_maddrs(boot)
        dhts = [boot]
        nodes = []
        try:
            for stage in (0, 1):
                dht = make_dht(peers, Endpoint(identity=str(f / f"node{stage}.key"),
                                               certificate=str(f / f"node{stage}.cert")), manifest=m)
                dhts.append(dht)
                node = StageNode(m, stage, dht, NodeOptions(stall_step_s=1e9))
                await node.start()
                nodes.append(node)
            trainer = make_dht(peers, Endpoint(identity=str(f / "trainer.key"), certificate=str(f / "trainer.cert")),
                               manifest=m, client_mode=True)
            dhts.append(trainer)
            # The intruder runs the same validators (so it could read and sign) but holds no certificate.
            intruder = make_dht(peers, Endpoint(identity=str(f / "intruder.key")),
                                manifest=m.with_overrides(**{"security.allow_list": False}), client_mode=True)
            dhts.append(intruder)
            tid, iid = str(trainer.peer_id), str(intruder.peer_id)

            record = {"peer_id": None, "manifest_hash": m.hash, "tokens": 0}
            assert announce(trainer, trainers_key(m.run_id), tid, dict(record, peer_id=tid))
            # Uncertified records are refused by every certified peer: the store fails, reads never show them.
            assert not announce(intruder, trainers_key(m.run_id), iid, dict(record, peer_id=iid))
            stage_rec = dict(nodes[0].record().to_value(), peer_id=iid)
            assert not announce(intruder, stage_key(m.run_id, 0), iid, stage_rec)
            # A forged record: the intruder's signature on a subkey that claims a certified peer's id.
            forged = I.owner_subkey(tid, I.load_private_key(f / "intruder.key"))
            ok = intruder.store(trainers_key(m.run_id), subkey=forged, value=dict(record, peer_id=tid, tokens=10**9),
                                expiration_time=get_dht_time() + 30)
            assert not ok
            seen = await asyncio.to_thread(read_subkeys, nodes[0].dht, trainers_key(m.run_id))
            assert tid in seen and iid not in seen and seen[tid]["tokens"] == 0
            stage0 = await asyncio.to_thread(read_subkeys, nodes[1].dht, stage_key(m.run_id, 0))
            assert set(stage0) == {nodes[0].peer_id}

            tokens = torch.randint(0, m.model.vocab_size, (2, m.model.seq_len), dtype=torch.int32)
            last = torch.randint(0, m.model.vocab_size, (2,), dtype=torch.int32)
            meta = {"run_id": m.run_id, "manifest_hash": m.hash, "stage": 0, "train": True}
            p2p_bad = await intruder.replicate_p2p()
            with pytest.raises(transport.RpcError) as err:
                await transport.call(p2p_bad, nodes[0].peer_id, m.run_id, FWD_BWD, meta, [tokens, last], timeout=20)
            assert err.value.code == "unauthorized"
            # The stage keeps serving certified callers, and the certified pipeline works end to end.
            p2p_ok = await trainer.replicate_p2p()
            reply, _ = await transport.call(p2p_ok, nodes[0].peer_id, m.run_id, FWD_BWD, meta, [tokens, last],
                                            timeout=30)
            assert reply["loss"] > 0 and reply["path"] == [n.peer_id for n in nodes]
            with pytest.raises(transport.RpcError) as err:  # state downloads are for certified replicas only
                await transport.call(p2p_bad, nodes[0].peer_id, m.run_id, GET_STATE,
                                     {"run_id": m.run_id, "manifest_hash": m.hash, "stage": 0}, [], timeout=20)
            assert err.value.code == "unauthorized"
            return nodes[0].counters.rejected_by_code
        finally:
            for node in nodes:
                await node.stop()
            for dht in dhts:
                dht.shutdown()

    rejected = asyncio.run(main())
    assert rejected.get("unauthorized") == 2
