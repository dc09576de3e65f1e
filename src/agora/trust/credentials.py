"""A peer's credentials for a run (identity key, authority certificate) and the run's membership check for RPCs.

Why a peer always has a key: records are owner-signed (``agora.trust.identity``), and the signing key must be
the libp2p identity of the DHT, so that the peer id in a record is provably the writer's. Without ``--identity`` a
peer gets a fresh ephemeral key (a new peer id per start, like before); with it, the same id across restarts, which
an allow-listed run needs because the authority certifies one key.

Allow-listed runs (``security.allow_list`` in the manifest): records on the run's keys need a valid certificate of
the writer's key, so "has a record in the run" means "is certified". ``agora.net.members.RunMembers`` turns that into the RPC check:
libp2p authenticates the caller's peer id on every stream, and a stage serves a caller only if that id holds a
record of the run (a stage node or a trainer). Open runs skip the check: anyone may announce a record there, so it
would only add latency, and rate limits plus SENTINEL are what protects an open run.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from hivemind.utils.crypto import RSAPrivateKey

from agora.config import Manifest, signature_path
from agora.trust.identity import (
    Certificate,
    certificate_problem,
    issue_certificate,
    ensure_identity,
    make_record_validators,
    peer_id_of,
    sign_manifest,
)

logger = logging.getLogger("agora.credentials")



class CredentialError(ValueError):
    """Credentials that cannot take part in the run; the message says what to do."""


@dataclass
class Credentials:
    identity_path: str
    key: RSAPrivateKey
    certificate: Optional[Certificate]
    ephemeral_dir: Optional[str] = None  # removed once the DHT has read the identity

    @property
    def peer_id(self) -> str:
        return peer_id_of(self.key)

    def discard_ephemeral(self) -> None:
        if self.ephemeral_dir:
            shutil.rmtree(self.ephemeral_dir, ignore_errors=True)
            self.ephemeral_dir = None


def load_certificate(path: str | Path) -> Certificate:
    try:
        cert = Certificate.from_value(json.loads(Path(path).read_text()))
    except (OSError, ValueError) as err:
        raise CredentialError(f"cannot read certificate {path}: {err}") from None
    if cert is None:
        raise CredentialError(f"{path} is not an agora certificate (expected the JSON written by `agora certify`)")
    return cert


def save_certificate(cert: Certificate, path: str | Path) -> None:
    Path(path).write_text(json.dumps(cert.to_value(), indent=1) + "\n")


def write_manifest_signature(manifest_path: Path, authority: RSAPrivateKey) -> Path:
    """Sign the manifest file's exact bytes as the run's authority; returns the ``FILE.sig`` written."""
    sig = signature_path(manifest_path)
    sig.write_bytes(sign_manifest(manifest_path.read_bytes(), authority) + b"\n")
    return sig


def certify(authority: RSAPrivateKey, run_id: str, peer_key, out: str | Path, expires: float = 0.0) -> Certificate:
    """Admit ``peer_key`` (any public-key form) to ``run_id`` and save the certificate at ``out``."""
    cert = issue_certificate(authority, run_id, peer_key, expires=expires)
    save_certificate(cert, out)
    return cert


def load_credentials(manifest: Manifest, identity: Optional[str], certificate: Optional[str],
                     writes: bool = True) -> Credentials:
    """The key and certificate this peer uses in ``manifest``'s run, checked before anything is started.

    ``writes``: the role announces records (nodes, trainers, the bootstrap). Read-only clients (status, dashboard)
    need no certificate even in an allow-listed run: validators check what they read, not who reads.
    """
    security = manifest.security
    ephemeral = None
    if identity is None:
        if security.allow_list and writes:
            raise CredentialError(
                f"run {manifest.run_id!r} is allow-listed: pass --identity KEYFILE (the key your certificate was "
                f"issued for) and --certificate CERT (from the organiser: `agora certify`)")
        ephemeral = tempfile.mkdtemp(prefix="agora-id-")
        identity = os.path.join(ephemeral, "identity.key")
    try:
        key = ensure_identity(identity)
    except (OSError, ValueError) as err:
        raise CredentialError(f"cannot use identity {identity}: {err}") from None
    cert = None
    if certificate is not None:
        cert = load_certificate(certificate)
        if security.authority is None:
            raise CredentialError(f"--certificate given, but the manifest of run {manifest.run_id!r} names no "
                                  f"authority (security.authority): nothing could check it")
        reason = certificate_problem(cert, security.authority, manifest.run_id, key)
        if reason is not None:
            raise CredentialError(f"certificate {certificate} is not valid for run {manifest.run_id!r} with identity "
                                  f"{identity}: {reason}")
    elif security.allow_list and writes:
        raise CredentialError(f"run {manifest.run_id!r} is allow-listed: pass --certificate CERT, the authority's "
                              f"certificate for your key (peer id {peer_id_of(key)}; send the organiser "
                              f"{identity}.pub or the output of `agora keygen`)")
    return Credentials(identity, key, cert, ephemeral)


def record_validators(manifest: Manifest, creds: Credentials) -> list:
    """hivemind record validators for this run: owner-signed self-certifying records, plus the allow-list."""
    authority = manifest.security.authority if manifest.security.allow_list else None
    return make_record_validators(manifest.run_id, manifest.n_stages, creds.key, authority=authority,
                                  certificate=creds.certificate, allow_foreign_keys=True)
