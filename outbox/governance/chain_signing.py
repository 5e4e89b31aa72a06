"""Signing a run's exported record (``outbox audit export --sign``) and checking a signature.

Ed25519 over the record's canonical JSON (:func:`outbox.governance.chain.canonical`), with
the ``cryptography`` package of the ``audit`` extra; the chain itself
(:mod:`outbox.governance.chain`) needs no key. A signature says who exported the record;
the chain says whether the rows were altered since they were written.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from outbox.governance.chain import canonical

__all__ = ["public_key_of", "sign_record", "verify_signature"]


def _ed25519() -> Any:
    try:
        from cryptography.hazmat.primitives.asymmetric import ed25519
    except ImportError as exc:  # pragma: no cover - depends on the extra
        from outbox.errors import ConfigurationError

        raise ConfigurationError(
            "signing needs the 'cryptography' package: pip install 'agent-outbox[audit]'"
        ) from exc
    return ed25519


def _unsigned(record: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in record.items() if k != "signature"}


def public_key_of(private_pem: bytes) -> str:
    """The hex public key of an Ed25519 private key (PEM, PKCS#8)."""
    from cryptography.hazmat.primitives import serialization

    ed25519 = _ed25519()
    key = serialization.load_pem_private_key(private_pem, password=None)
    if not isinstance(key, ed25519.Ed25519PrivateKey):
        from outbox.errors import ConfigurationError

        raise ConfigurationError("the signing key is not an Ed25519 private key")
    return str(key.public_key().public_bytes_raw().hex())


def sign_record(record: Mapping[str, Any], private_pem: bytes) -> dict[str, Any]:
    """The record with an Ed25519 ``signature`` over its canonical JSON."""
    from cryptography.hazmat.primitives import serialization

    unsigned = _unsigned(record)
    key = serialization.load_pem_private_key(private_pem, password=None)
    public = public_key_of(private_pem)
    signature = key.sign(canonical(unsigned))  # type: ignore[call-arg,union-attr]
    return {
        **unsigned,
        "signature": {"algorithm": "ed25519", "public_key": public, "value": signature.hex()},
    }


def verify_signature(record: Mapping[str, Any], trusted_public_keys: Iterable[str] = ()) -> bool:
    """True when the record's signature holds (and its key is trusted, when keys are given)."""
    ed25519 = _ed25519()
    signature = record.get("signature") or {}
    trusted = list(trusted_public_keys)
    if signature.get("algorithm") != "ed25519" or (
        trusted and signature["public_key"] not in trusted
    ):
        return False
    key = ed25519.Ed25519PublicKey.from_public_bytes(bytes.fromhex(signature["public_key"]))
    try:
        key.verify(bytes.fromhex(signature["value"]), canonical(_unsigned(record)))
    except Exception:
        return False
    return True
