"""Signed DHT records, self-certifying peer ids, allow-lists and signed manifests."""

import dataclasses
import os

import pytest
from hivemind.dht.validation import CompositeValidator
from hivemind.p2p import PeerID
from hivemind.utils import MSGPackSerializer, get_dht_time

from agora.config import load_manifest
from agora.trust import identity as I

RUN = "tiny"


@pytest.fixture(scope="module")
def keys():
    return {name: I.generate_key() for name in ("victim", "attacker", "authority", "reader")}


def _stage_value(peer_id, stage=0, **extra):
    return {"peer_id": peer_id, "stage": stage, "state": "serving", "manifest_hash": "abc", "throughput": 1.0,
            "metrics": {"loss": float("nan")}, **extra}


def _record(validators, key_name, subkey, value):
    return I.sign_record_value(validators, key_name, subkey, value, get_dht_time() + 30)


def _reader(keys, **kw):
    return CompositeValidator(I.make_record_validators(RUN, 2, keys["reader"], **kw))


def test_peer_id_is_the_libp2p_id_of_the_identity_file(tmp_path, keys):
    path = tmp_path / "node.key"
    key = I.ensure_identity(path)
    assert I.ensure_identity(path).to_bytes() == key.to_bytes()  # loaded, not regenerated
    assert I.peer_id_of(key) == PeerID.from_identity(path.read_bytes()).to_base58()
    assert oct(os.stat(path).st_mode & 0o777) == "0o400"


def test_owner_signed_record_is_accepted(keys):
    v = keys["victim"]
    pid = I.peer_id_of(v)
    rec = _record(I.make_record_validators(RUN, 2, v), f"{RUN}_stage0", I.owner_subkey(pid, v), _stage_value(pid))
    assert _reader(keys).validate(rec)


def test_forged_record_claiming_another_peers_subkey_is_rejected(keys):
    v, a = keys["victim"], keys["attacker"]
    pid = I.peer_id_of(v)
    attacker_validators = I.make_record_validators(RUN, 2, a)
    # hivemind will not sign a subkey the attacker does not own: the value goes out unsigned.
    rec = _record(attacker_validators, f"{RUN}_stage0", I.owner_subkey(pid, v), _stage_value(pid, state="leaving"))
    assert not _reader(keys).validate(rec)
    # Nor does signing it with the attacker's own key help.
    body = dataclasses.replace(rec, value=MSGPackSerializer.dumps(_stage_value(pid)))
    sig = a.sign(MSGPackSerializer.dumps(dataclasses.astuple(body)))
    forged = dataclasses.replace(body, value=body.value + b"[signature:" + sig + b"]")
    assert not _reader(keys).validate(forged)


def test_own_subkey_with_someone_elses_peer_id_is_rejected(keys):
    v, a = keys["victim"], keys["attacker"]
    victim_pid = I.peer_id_of(v)
    val = I.make_record_validators(RUN, 2, a)
    # The attacker owns the subkey, but claims the victim's peer id (in the subkey and the value).
    rec = _record(val, f"{RUN}_stage0", I.owner_subkey(victim_pid, a), _stage_value(victim_pid))
    assert not _reader(keys).validate(rec)
    # ... or only in the value.
    rec = _record(val, f"{RUN}_stage0", I.owner_subkey(I.peer_id_of(a), a), _stage_value(victim_pid))
    assert not _reader(keys).validate(rec)


@pytest.mark.parametrize("value", [
    _stage_value("X", stage=1),  # a stage-0 record naming stage 1
    dict(_stage_value("X"), state="hacking"),
    dict(_stage_value("X"), throughput=-5.0),
    dict(_stage_value("X"), blob="x" * 9000),  # too large
    ["not", "a", "dict"],
])
def test_malformed_values_are_rejected(keys, value):
    a = keys["attacker"]
    pid = I.peer_id_of(a)
    if isinstance(value, dict):
        value = dict(value, peer_id=pid)
    rec = _record(I.make_record_validators(RUN, 2, a), f"{RUN}_stage0", I.owner_subkey(pid, a), value)
    assert not _reader(keys).validate(rec)


def test_unowned_subkeys_on_run_keys_are_rejected(keys):
    a = keys["attacker"]
    rec = _record(I.make_record_validators(RUN, 2, a), f"{RUN}_bans", "plain-subkey", {"banned": "x"})
    assert not _reader(keys).validate(rec)


def test_allow_list(keys):
    v, a, z = keys["victim"], keys["attacker"], keys["authority"]
    cert = I.issue_certificate(z, RUN, v)
    reader = _reader(keys, authority=z)
    pid_v, pid_a = I.peer_id_of(v), I.peer_id_of(a)
    ok = _record(I.make_record_validators(RUN, 2, v, authority=z, certificate=cert), f"{RUN}_stage1",
                 I.owner_subkey(pid_v, v), _stage_value(pid_v, stage=1))
    assert reader.validate(ok)
    assert b"sig" in ok.value  # the certificate travels inside the signed value ...
    stripped = reader.strip_value(ok)
    assert MSGPackSerializer.loads(stripped).keys() == _stage_value(pid_v, stage=1).keys()  # ... gone for readers

    # No certificate; a copied certificate (of another key); a certificate for another run; an expired one.
    for certificate in (None, cert, I.issue_certificate(z, "other-run", a), I.issue_certificate(z, RUN, a, 1.0)):
        forged = dict(_stage_value(pid_a, stage=1))
        if certificate is not None:
            forged["cert"] = certificate.to_value()
        rec = _record(I.make_record_validators(RUN, 2, a), f"{RUN}_stage1", I.owner_subkey(pid_a, a), forged)
        assert not reader.validate(rec)
    # A certificate signed by someone else than the authority.
    self_signed = I.issue_certificate(a, RUN, a)
    rec = _record(I.make_record_validators(RUN, 2, a, authority=z, certificate=self_signed), f"{RUN}_stage1",
                  I.owner_subkey(pid_a, a), _stage_value(pid_a, stage=1))
    assert not reader.validate(rec)
    # Foreign keys are refused under an allow-list (no free storage), allowed without one.
    foreign = _record(I.make_record_validators(RUN, 2, v), "someone_elses_key", "sub", {"x": 1})
    assert not reader.validate(foreign)
    assert _reader(keys).validate(foreign)


def test_manifest_signature(keys):
    z, a = keys["authority"], keys["attacker"]
    data = load_manifest("tiny").to_yaml().encode()
    sig = I.sign_manifest(data, z)
    assert I.verify_manifest(data, sig, z.get_public_key())
    assert I.verify_manifest(data, sig, I.public_key_bytes(z))  # the ssh-rsa text form works too
    assert not I.verify_manifest(data.replace(b"lr: 0.003", b"lr: 0.3"), sig, z.get_public_key())
    assert not I.verify_manifest(data, I.sign_manifest(data, a), z.get_public_key())
    assert not I.verify_manifest(data, b"garbage", z.get_public_key())


def test_keys_round_trip(tmp_path, keys):
    k = keys["victim"]
    I.save_private_key(k, tmp_path / "k")
    assert I.load_private_key(tmp_path / "k").to_bytes() == k.to_bytes()
    assert I.load_private_key(k.to_bytes()).to_bytes() == k.to_bytes()  # raw DER
    with pytest.raises(ValueError):
        I.load_private_key(b"not a key")
    pid, owner = I.parse_subkey(I.owner_subkey("QmPeer", k))
    assert pid == "QmPeer" and owner == I.public_key_bytes(k)
    assert I.parse_subkey("plain") == ("plain", None)


def test_two_real_dhts_refuse_forged_and_uncertified_records(tmp_path, keys):
    """In-process hivemind DHTs on loopback: the allow-listed node never stores or returns bad records."""
    import hivemind

    z = keys["authority"]
    ka, kb = I.ensure_identity(tmp_path / "a.key"), I.ensure_identity(tmp_path / "b.key")
    a = b = None
    try:
        a = hivemind.DHT(host_maddrs=["/ip4/127.0.0.1/tcp/0"], identity_path=str(tmp_path / "a.key"), start=True,
                         record_validators=I.make_record_validators(RUN, 2, ka, authority=z,
                                                                    certificate=I.issue_certificate(z, RUN, ka)))
        # b is not certified and runs without the allow-list: it will try to write anyway.
        b = hivemind.DHT(initial_peers=a.get_visible_maddrs(), host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                         identity_path=str(tmp_path / "b.key"), start=True,
                         record_validators=I.make_record_validators(RUN, 2, kb))
        pa, pb = str(a.peer_id), str(b.peer_id)
        assert pa == I.peer_id_of(ka) and pb == I.peer_id_of(kb)
        exp = get_dht_time() + 30
        key = f"{RUN}_stage0"
        assert a.store(key, _stage_value(pa), exp, subkey=I.owner_subkey(pa, ka))
        b.store(key, _stage_value(pb), exp, subkey=I.owner_subkey(pb, kb))  # uncertified
        assert not b.store(key, _stage_value(pa, state="leaving"), exp, subkey=I.owner_subkey(pa, ka))  # forged
        found = a.get(key, latest=True)
        seen = {I.subkey_peer_id(sub): item.value for sub, item in found.value.items()}
        assert list(seen) == [pa] and seen[pa]["state"] == "serving" and "cert" not in seen[pa]
    finally:
        for dht in (b, a):
            if dht is not None:
                dht.shutdown()
