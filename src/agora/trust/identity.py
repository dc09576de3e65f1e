"""Who may write what in the DHT: owner-signed records, record shape limits, allow-lists, signed manifests.

Why: hivemind's DHT stores whatever anyone sends, so any peer could overwrite another peer's stage record, publish
huge values or announce a manifest. The validators here are hivemind ``RecordValidatorBase`` subclasses, so every
DHT node enforces them on store *and* on read:

* owner-only subkeys (``owner_subkey``) with self-certifying peer ids (``AgoraRecordValidator``, ``ensure_identity``);
* record shape and size limits (``AgoraRecordValidator``, ``RecordSizeValidator``);
* an optional allow-list of authority-signed peer certificates (``AllowListValidator``);
* signed manifests (``sign_manifest`` / ``verify_manifest``, re-exported from ``agora.config.signature``).

``agora.trust.credentials`` builds these validators for ``agora.net.dht.make_dht``. What each check enforces and
how the rest of agora relies on it: docs/TRUST.md.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Optional, Union

import base58
import multihash
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.protocol import DHTProtocol
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.proto import crypto_pb2
from hivemind.utils import MSGPackSerializer
from hivemind.utils.crypto import RSAPrivateKey

from agora.config.signature import (  # noqa: F401  (re-exported: the manifest's signature format lives with it)
    MANIFEST_DOMAIN,
    PublicKeyLike,
    public_key,
    public_key_bytes,
    sign_manifest,
    verify_manifest,
)

CERT_DOMAIN = b"agora-peer-cert-v1\x00"
CERT_FIELD = "cert"
RUN_KEY_SUFFIXES = ("_trainers", "_manifest", "_acks", "_bans", "_moving")
STAGE_STATES = ("joining", "syncing", "serving", "leaving")
MAX_VALUE_BYTES = 8192  # a stage record is ~1.7 KB (1.2 KB: its parameter sample); an acks record grows ~55 B per acknowledged peer
MAX_SUBKEY_BYTES = 1024

# ---------------------------------------------------------------------- keys


def generate_key() -> RSAPrivateKey:
    return RSAPrivateKey()


def _wrap_private(key: rsa.RSAPrivateKey) -> RSAPrivateKey:
    wrapped = RSAPrivateKey.__new__(RSAPrivateKey)  # hivemind's class has no loader; it only wraps this field
    wrapped._private_key = key
    return wrapped


def load_private_key(data: Union[bytes, str, Path]) -> RSAPrivateKey:
    """An RSA private key from a hivemind/libp2p identity file (protobuf), PEM or DER; a path or the bytes."""
    raw = Path(data).read_bytes() if isinstance(data, (str, Path)) else data
    candidates = []
    try:
        pb = crypto_pb2.PrivateKey.FromString(raw)
        if pb.key_type == crypto_pb2.KeyType.RSA and pb.data:
            candidates.append(pb.data)
    except Exception:  # not a protobuf: try PEM / DER below
        pass
    candidates.append(raw)
    for blob in candidates:
        for loader in (serialization.load_der_private_key, serialization.load_pem_private_key):
            try:
                key = loader(blob, password=None)
            except (ValueError, TypeError):
                continue
            if isinstance(key, rsa.RSAPrivateKey):
                return _wrap_private(key)
    raise ValueError("not an RSA private key (expected a hivemind identity file, PEM or DER)")


def save_private_key(key: RSAPrivateKey, path: Union[str, Path]) -> None:
    """Write ``key`` in hivemind's identity format, so the same file is the node's libp2p identity (mode 0400)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    blob = crypto_pb2.PrivateKey(key_type=crypto_pb2.KeyType.RSA, data=key.to_bytes()).SerializeToString()
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(blob)
    os.chmod(tmp, 0o400)
    os.replace(tmp, path)


def ensure_identity(path: Union[str, Path]) -> RSAPrivateKey:
    """Load the identity at ``path``, creating it first if missing. Pass ``path`` to ``DHT(identity_path=...)``."""
    if not Path(path).exists():
        save_private_key(generate_key(), path)
    return load_private_key(path)


def peer_id_of(key: PublicKeyLike) -> str:
    """The libp2p peer id (base58) of an RSA key: multihash sha256 of the protobuf-wrapped DER public key."""
    pub = public_key(key)._public_key
    der = pub.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    proto = crypto_pb2.PublicKey(key_type=crypto_pb2.RSA, data=der).SerializeToString()
    digest = multihash.encode(hashlib.sha256(proto).digest(), multihash.coerce_code("sha2-256"))
    return base58.b58encode(digest).decode()


def owner_subkey(peer_id: str, key: PublicKeyLike) -> bytes:
    """The subkey a peer writes its records under: its peer id, then the owner marker hivemind checks."""
    marker = RSASignatureValidator.PUBLIC_KEY_FORMAT.replace(b"_key_", public_key_bytes(key))
    return str(peer_id).encode() + marker


def parse_subkey(subkey: Any) -> tuple[str, Optional[bytes]]:
    """(peer id, owner public key bytes or None) of a subkey as stored (bytes) or as read back (bytes/str)."""
    raw = subkey.encode() if isinstance(subkey, str) else bytes(subkey)
    match = RSASignatureValidator._PUBLIC_KEY_RE.search(raw)
    if match is None:
        return raw.decode(errors="replace"), None
    return raw[: match.start()].decode(errors="replace"), match.group(1)


def subkey_peer_id(subkey: Any) -> str:
    return parse_subkey(subkey)[0]


# ---------------------------------------------------------------------- manifests and certificates


@dataclass(frozen=True)
class Certificate:
    """The authority's statement "the key ``public_key`` may take part in run ``run_id`` until ``expires``"."""

    run_id: str
    public_key: bytes
    expires: float  # unix time; 0 = never
    signature: bytes

    def to_value(self) -> dict:
        return {"run": self.run_id, "key": self.public_key.decode(), "exp": float(self.expires),
                "sig": self.signature.decode()}

    @classmethod
    def from_value(cls, value: Any) -> Optional["Certificate"]:
        try:
            return cls(str(value["run"]), str(value["key"]).encode(), float(value["exp"]), str(value["sig"]).encode())
        except (TypeError, KeyError, ValueError, AttributeError):
            return None


def _cert_message(run_id: str, key: bytes, expires: float) -> bytes:
    return CERT_DOMAIN + run_id.encode() + b"\x00" + key + b"\x00" + repr(float(expires)).encode()


def issue_certificate(authority: RSAPrivateKey, run_id: str, peer_key: PublicKeyLike,
                      expires: float = 0.0) -> Certificate:
    key = public_key_bytes(peer_key)
    return Certificate(run_id, key, float(expires), authority.sign(_cert_message(run_id, key, expires)))


def certificate_problem(cert: Optional[Certificate], authority: PublicKeyLike, run_id: str,
                        peer_key: PublicKeyLike, now: Optional[float] = None) -> Optional[str]:
    """Why ``cert`` does not admit ``peer_key`` to ``run_id`` (a phrase for error messages), or None if it does."""
    if cert is None:
        return "there is no certificate"
    if cert.public_key != public_key_bytes(peer_key):
        return "it was issued for another key"
    if cert.run_id != run_id:
        return f"it is for run {cert.run_id!r}"
    if cert.expires and (now if now is not None else time.time()) > cert.expires:
        return "it expired"
    try:
        ok = public_key(authority).verify(_cert_message(run_id, cert.public_key, cert.expires), cert.signature)
    except Exception:
        ok = False
    return None if ok else "its signature is not the authority's"


def verify_certificate(cert: Optional[Certificate], authority: PublicKeyLike, run_id: str,
                       peer_key: PublicKeyLike, now: Optional[float] = None) -> bool:
    return certificate_problem(cert, authority, run_id, peer_key, now) is None


# ---------------------------------------------------------------------- record validators


def run_key_ids(run_id: str, n_stages: int, extra_keys: Iterable[str] = ()) -> dict[bytes, str]:
    """DHT key ids (what validators see: hashes, not names) of the run's keys -> their names."""
    names = [f"{run_id}_stage{s}" for s in range(n_stages)] + [run_id + s for s in RUN_KEY_SUFFIXES]
    return {DHTID.generate(source=name).to_bytes(): name for name in [*names, *extra_keys]}


def _simple(value: Any, depth: int = 0) -> bool:
    if value is None or isinstance(value, (bool, int, str)):
        return True
    if isinstance(value, float):
        return True  # NaN is a legitimate "unknown" (loss before the first step)
    if isinstance(value, (list, tuple)):
        return depth < 3 and len(value) <= 1024 and all(_simple(v, depth + 1) for v in value)
    if isinstance(value, dict):
        return depth < 3 and len(value) <= 1024 and all(
            isinstance(k, str) and len(k) <= 128 and _simple(v, depth + 1) for k, v in value.items()
        )
    return False


def _decode(blob: bytes) -> Any:
    try:
        return MSGPackSerializer.loads(blob)
    except Exception:
        return _DECODE_FAILED


_DECODE_FAILED = object()


class _KeyCache:
    """Parsed public keys / derived peer ids, dropped on pickling (hivemind may ship validators to its process)."""

    def __init__(self) -> None:
        self._peer_ids: dict[bytes, Optional[str]] = {}

    def peer_id(self, key: bytes) -> Optional[str]:
        if key not in self._peer_ids:
            if len(self._peer_ids) > 4096:
                self._peer_ids.clear()
            try:
                self._peer_ids[key] = peer_id_of(key)
            except Exception:
                self._peer_ids[key] = None
        return self._peer_ids[key]


class RecordSizeValidator(RecordValidatorBase):
    """Refuses any record (any key) whose stored value, signature and certificate included, exceeds ``max_bytes``:
    storage on other peers is not free."""

    def __init__(self, max_bytes: int = 4 * MAX_VALUE_BYTES):
        self.max_bytes = max_bytes

    def validate(self, record: DHTRecord) -> bool:
        return len(record.value) <= self.max_bytes and len(record.subkey) <= MAX_SUBKEY_BYTES

    @property
    def priority(self) -> int:
        return 20  # first on validation: before anyone parses the value


class AgoraRecordValidator(RecordValidatorBase):
    """Shape, size and ownership rules for the run's keys (``run_key_ids``); other keys pass (see the allow-list).

    A record on a run key must: be under ``max_value_bytes``; use an owner subkey (``require_owner``); decode to a
    msgpack dict of simple values; carry ``peer_id`` equal to the subkey's peer id if it carries one; come from the
    peer id of the owner key (``bind_peer_id``); and, on a stage key, name that stage and a known state.
    """

    def __init__(self, run_id: str, n_stages: int, max_value_bytes: int = MAX_VALUE_BYTES,
                 require_owner: bool = True, bind_peer_id: bool = True, extra_keys: Iterable[str] = ()):
        self.run_id = run_id
        self.keys = run_key_ids(run_id, n_stages, extra_keys)
        self.max_value_bytes = max_value_bytes
        self.require_owner = require_owner
        self.bind_peer_id = bind_peer_id
        self._cache = _KeyCache()

    def __getstate__(self):
        state = self.__dict__.copy()
        state["_cache"] = None
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._cache = _KeyCache()

    def validate(self, record: DHTRecord) -> bool:
        name = self.keys.get(record.key)
        if name is None:
            return True
        if len(record.value) > self.max_value_bytes or len(record.subkey) > MAX_SUBKEY_BYTES:
            return False
        if record.subkey in DHTProtocol.RESERVED_SUBKEYS:
            return False  # agora always writes one subkey per peer
        subkey = _decode(record.subkey)
        if not isinstance(subkey, (bytes, str)):
            return False
        peer, owner = parse_subkey(subkey)
        if owner is None and self.require_owner:
            return False
        value = _decode(record.value)
        if not isinstance(value, dict) or not _simple(value):
            return False
        if "peer_id" in value and value["peer_id"] != peer:
            return False
        if owner is not None and self.bind_peer_id and self._cache.peer_id(owner) != peer:
            return False
        if name.startswith(f"{self.run_id}_stage"):
            stage = int(name[len(f"{self.run_id}_stage"):])
            if value.get("stage") != stage or value.get("state") not in STAGE_STATES:
                return False
            for field in ("throughput", "step", "queue", "samples"):
                v = value.get(field, 0)
                if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                    return False
        return True

    @property
    def priority(self) -> int:
        return 5  # validated after RSASignatureValidator (10) has checked and stripped the signature


class AllowListValidator(RecordValidatorBase):
    """Only certified keys may write: records on the run's keys need a valid certificate of the owner key.

    ``certificate``: this node's own certificate; ``sign_value`` adds it to every record this node writes under
    its own key (so no caller has to), and ``strip_value`` removes it before the application reads the value.
    ``allow_foreign_keys=False`` (default) also refuses records on keys that are not the run's.
    """

    def __init__(self, run_id: str, n_stages: int, authority: PublicKeyLike,
                 certificate: Optional[Certificate] = None, allow_foreign_keys: bool = False,
                 extra_keys: Iterable[str] = ()):
        self.run_id = run_id
        self.keys = run_key_ids(run_id, n_stages, extra_keys)
        self.authority = public_key_bytes(authority)
        self.certificate = certificate
        self.allow_foreign_keys = allow_foreign_keys

    def validate(self, record: DHTRecord) -> bool:
        if record.key not in self.keys:
            return self.allow_foreign_keys
        subkey = _decode(record.subkey)
        if not isinstance(subkey, (bytes, str)):
            return False
        _, owner = parse_subkey(subkey)
        value = _decode(record.value)
        if owner is None or not isinstance(value, dict):
            return False
        cert = Certificate.from_value(value.get(CERT_FIELD))
        return verify_certificate(cert, self.authority, self.run_id, owner)

    def sign_value(self, record: DHTRecord) -> bytes:
        if self.certificate is None or record.key not in self.keys:
            return record.value
        subkey = _decode(record.subkey)
        if not isinstance(subkey, (bytes, str)) or parse_subkey(subkey)[1] != self.certificate.public_key:
            return record.value
        value = _decode(record.value)
        if not isinstance(value, dict):
            return record.value
        return MSGPackSerializer.dumps(dict(value, **{CERT_FIELD: self.certificate.to_value()}))

    def strip_value(self, record: DHTRecord) -> bytes:
        value = _decode(record.value)
        if isinstance(value, dict) and CERT_FIELD in value:
            return MSGPackSerializer.dumps({k: v for k, v in value.items() if k != CERT_FIELD})
        return record.value

    @property
    def priority(self) -> int:
        # Signing runs in increasing priority: the certificate goes in before RSASignatureValidator (10) signs.
        # Validation runs in decreasing priority: after the signature check, before AgoraRecordValidator (5).
        return 7


def make_record_validators(run_id: str, n_stages: int, private_key: RSAPrivateKey,
                           authority: Optional[PublicKeyLike] = None, certificate: Optional[Certificate] = None,
                           max_value_bytes: int = MAX_VALUE_BYTES,
                           allow_foreign_keys: bool = False) -> list[RecordValidatorBase]:
    """The validators every peer of a run passes to ``hivemind.DHT(record_validators=...)``.

    Without ``authority`` the run is permissionless but records are still owner-signed and self-certifying. With
    it, only keys certified by the authority can write the run's keys; ``allow_foreign_keys`` decides whether
    other keys may be stored at all (a live swarm needs it: hivemind's averager matchmaking writes unsigned records
    under its own keys, so those are let through and averaging groups are checked against the run's certified
    replicas after each round instead).
    """
    validators: list[RecordValidatorBase] = [
        RecordSizeValidator(),
        RSASignatureValidator(private_key),
        AgoraRecordValidator(run_id, n_stages, max_value_bytes),
    ]
    if authority is not None:
        validators.append(AllowListValidator(run_id, n_stages, authority, certificate,
                                             allow_foreign_keys=allow_foreign_keys))
    return validators


def sign_record_value(validators: Iterable[RecordValidatorBase], key: str, subkey: Any, value: Any,
                      expiration_time: float) -> DHTRecord:
    """The record as hivemind would store it (serialised, certificate added, signed): for tests and tools."""
    from hivemind.dht.validation import CompositeValidator

    composite = CompositeValidator(validators)
    record = DHTRecord(DHTID.generate(source=key).to_bytes(), MSGPackSerializer.dumps(subkey),
                       MSGPackSerializer.dumps(value), expiration_time)
    return dataclasses.replace(record, value=composite.sign_value(record))
