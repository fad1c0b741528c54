"""Signed edge keys: originators prove they minted a key, so no one else can pass it off as theirs.

The ledger counts an arrival as *attributable* when its question says ``e`` (minted by a declared
originator). Anyone can write ``e``: a middle layer that re-mints, or a client that mints a fresh
key per retry to dodge the target's cap. With a secret shared by the originators and the targets
(never by the layers in between), an originator adds an HMAC of the key to the question as the
dictionary member ``s``, a byte sequence. An ``askonce-question`` value signed with the secret
``b"0123456789abcdef0123"``::

    v=1, k="01JD5Q3W8M0S3V2T8QK6Y7C2BZ4E9R1N0HAF", o=edge, e, b=2, s=:NNwQzqBMp7v3FKj9+1pDOg==:

``s`` is HMAC-SHA256 over ``"askonce-edge-key-v1\\0" + key`` truncated to 128 bits (the truncation
RFC 2104 allows; 2**-128 is the chance of a forged key passing), base64 in the structured-field
byte-sequence syntax. Version-1 parsers ignore unknown members, so a signed header is read by every
peer; a target that checks signatures treats ``e`` without a valid ``s`` as not attributable.

Verifying several secrets at once (``[new, old]``) lets a fleet rotate the secret without a flag
day. What a signature does not do: bind the budget, deadline or path (each hop rewrites them),
prevent the replay of a signed key (a replay is one more arrival of the same question, which the
ledger counts and the cap limits), or cover fan-out children derived by a layer that has no secret.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
from collections.abc import Mapping, Sequence

from askonce.core import wire
from askonce.core.wire import Malformed

__all__ = ["MEMBER", "mac", "secret_keys", "sign", "sign_header", "verify", "verify_edge",
           "verify_key"]

MEMBER = "s"
_CONTEXT = b"askonce-edge-key-v1\x00"
_MAC_BYTES = 16
_MIN_SECRET_BYTES = 16

Secret = bytes | str


def _secret(secret: Secret) -> bytes:
    raw = secret.encode("utf-8") if isinstance(secret, str) else secret
    if not isinstance(raw, bytes | bytearray) or len(raw) < _MIN_SECRET_BYTES:
        raise ValueError(f"a signing secret must be at least {_MIN_SECRET_BYTES} bytes")
    return bytes(raw)


def _secrets(secret: Secret | Sequence[Secret]) -> list[bytes]:
    if isinstance(secret, str | bytes | bytearray):
        return [_secret(secret)]
    out = [_secret(s) for s in secret]
    if not out:
        raise ValueError("verify needs at least one secret")
    return out


def secret_keys(secret: Secret | Sequence[Secret]) -> list[bytes]:
    """One secret or several (``[new, old]``: the first signs, all verify) as bytes;
    ``ValueError`` for one under 16 bytes, or none. Other signed things share this rule."""
    return _secrets(secret)


def _mac(key: str, secret: bytes) -> bytes:
    return hmac.new(secret, _CONTEXT + key.encode("utf-8", "surrogatepass"),
                    hashlib.sha256).digest()[:_MAC_BYTES]


def mac(key: str, secret: Secret) -> bytes:
    """The signature of ``key``: the bytes a question carries as ``s`` (``Question.sig``)."""
    return _mac(key, _secret(secret))


def sign(key: str, secret: Secret) -> str:
    """The signature of ``key`` as the base64 text that goes between the colons of ``s=:...:``."""
    return base64.b64encode(_mac(key, _secret(secret))).decode("ascii")


def sign_header(header: str, secret: Secret) -> str:
    """``header`` (an ``askonce-question`` value) with ``s`` appended if it declares an edge key.

    A header that is malformed, not an edge key, or already signed is returned unchanged: signing is
    for the originator that minted the key, and a second ``s`` would make the header malformed.
    """
    d = wire.parse_dictionary(header)
    if (isinstance(d, Malformed) or MEMBER in d or d.get("e") is not True
            or type(d.get("k")) is not str):
        return header
    return f"{header}, {MEMBER}=:{sign(str(d['k']), secret)}:"


def _fields(
    header_or_fields: str | bytes | Mapping[str, wire.Value],
) -> Mapping[str, wire.Value] | None:
    if isinstance(header_or_fields, Mapping):
        return header_or_fields
    text = header_or_fields
    if isinstance(text, bytes):
        if len(text) > wire.MAX_HEADER_CHARS:
            return None
        try:
            text = text.decode("ascii")
        except UnicodeDecodeError:
            return None
    d = wire.parse_dictionary(text)
    return None if isinstance(d, Malformed) else d


def verify(header_or_fields: str | bytes | Mapping[str, wire.Value],
           secret: Secret | Sequence[Secret]) -> bool:
    """True if the question's key ``k`` carries a valid ``s`` under ``secret`` (or any of several).

    Takes the raw header value, or the dictionary :func:`askonce.core.wire.parse_dictionary` made of
    it. Never raises for what arrived (a malformed header, a missing or oversized ``s``: ``False``);
    raises ``ValueError`` only for a bad secret.
    """
    keys = _secrets(secret)
    d = _fields(header_or_fields)
    if d is None:
        return False
    key, sig = d.get("k"), d.get(MEMBER)
    return type(key) is str and isinstance(sig, bytes) and _check(key, sig, keys)


def verify_key(key: str, sig: bytes | None, secret: Secret | Sequence[Secret]) -> bool:
    """:func:`verify` for a key and signature already parsed (a ``Question`` that carries ``s``)."""
    keys = _secrets(secret)
    return isinstance(key, str) and isinstance(sig, bytes) and _check(key, sig, keys)


def _check(key: str, sig: bytes, keys: list[bytes]) -> bool:
    if len(sig) > wire.MAX_SIG_BYTES:
        return False
    # Every secret is tried (no early exit): timing does not tell which one a forger came close to.
    ok = False
    for k in keys:
        ok |= hmac.compare_digest(_mac(key, k), sig)
    return ok


def verify_edge(header_or_fields: str | bytes | Mapping[str, wire.Value],
                secret: Secret | Sequence[Secret]) -> bool:
    """What a target that checks signatures records as ``edge``: ``e`` is set *and* ``s`` is
    valid."""
    d = _fields(header_or_fields)
    return d is not None and d.get("e") is True and verify(d, secret)
