"""The manifest's signature format: which bytes an authority signs and how a peer checks them.

Why here and not in ``agora.trust``: loading a manifest refuses a file whose ``.sig`` does not verify, and the
manifest (``agora.config``) is the bottom layer that everything else reads. ``agora.trust.identity`` builds the
rest of the run's identity rules (owner-signed records, certificates) on these key helpers.
"""

from __future__ import annotations

from typing import Union

from hivemind.utils.crypto import RSAPrivateKey, RSAPublicKey

MANIFEST_DOMAIN = b"agora-manifest-v1\x00"

PublicKeyLike = Union[RSAPublicKey, RSAPrivateKey, bytes, str]


def public_key_bytes(key: PublicKeyLike) -> bytes:
    """The OpenSSH text form (``ssh-rsa AAAA...``) that hivemind puts into ``[owner:...]``."""
    if isinstance(key, RSAPrivateKey):
        key = key.get_public_key()
    if isinstance(key, RSAPublicKey):
        return key.to_bytes()
    if isinstance(key, str):
        key = key.encode()
    if key.startswith(b"[owner:") and key.endswith(b"]"):
        key = key[len(b"[owner:"):-1]
    return key.strip()


def public_key(key: PublicKeyLike) -> RSAPublicKey:
    return key if isinstance(key, RSAPublicKey) else RSAPublicKey.from_bytes(public_key_bytes(key))


def sign_manifest(manifest_yaml_bytes: bytes, authority: RSAPrivateKey) -> bytes:
    """Base64 RSA-PSS signature of the exact manifest bytes (sign the file you distribute, verify before parsing)."""
    return authority.sign(MANIFEST_DOMAIN + bytes(manifest_yaml_bytes))


def verify_manifest(manifest_yaml_bytes: bytes, signature: bytes, authority: PublicKeyLike) -> bool:
    try:
        return public_key(authority).verify(MANIFEST_DOMAIN + bytes(manifest_yaml_bytes), signature)
    except Exception:  # malformed key or signature: not verified
        return False
