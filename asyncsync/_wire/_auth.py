"""The shared token and the HMAC challenge both handshakes use (control plane, attaching workers).

The token never travels: each side proves it knows it by a MAC over the other's random
nonce. Example::

    token = resolve_token("s3cret")
    nonce = new_nonce()
    assert welcome_mac(token, nonce) == mac(token, b"trainer", nonce)
"""

from __future__ import annotations

import hashlib
import hmac
import os
import struct

from ._messages import NONCE_BYTES

# The largest payload before authentication: an Auth frame (host, workers, pid, 2 x 32 bytes).
HANDSHAKE_LIMIT = 12 + 2 * NONCE_BYTES

__all__ = ["HANDSHAKE_LIMIT", "auth_mac", "mac", "new_nonce", "resolve_token", "welcome_mac"]


def resolve_token(token: str | bytes | None) -> bytes | None:
    """The shared secret: *token*, else ``ASYNCSYNC_TOKEN``, else None."""
    if token is None:
        token = os.environ.get("ASYNCSYNC_TOKEN") or None
    if token is None:
        return None
    raw = token.encode("utf-8") if isinstance(token, str) else bytes(token)
    if not raw:
        raise ValueError("the token is empty")
    return raw


def new_nonce() -> bytes:
    return os.urandom(NONCE_BYTES)


def mac(token: bytes, *parts: bytes) -> bytes:
    return hmac.new(token, b"".join(parts), hashlib.sha256).digest()


def auth_mac(token: bytes, challenge: bytes, host: int, num_workers: int) -> bytes:
    return mac(token, b"relay", challenge, struct.pack("!II", host, num_workers))


def welcome_mac(token: bytes, nonce: bytes) -> bytes:
    return mac(token, b"trainer", nonce)
