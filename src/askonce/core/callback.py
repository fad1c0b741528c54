"""Signed callbacks of async mode, sans-IO: which URLs a caller may give, the signature, the check.

A caller that asks a joining server ``Prefer: respond-async`` may add ``askonce-callback: <URL>``;
the server POSTs the answer there when the run ends, if the URL is one it allows (a callback URL
from a caller is a request the server makes on the caller's behalf: an SSRF vector, refused by
default). The POST carries the answer's body and content type, and these headers:

* ``askonce-callback-key``: the question key;
* ``askonce-callback-location``: the answer's status location (a GET there works too);
* ``askonce-callback-status``: the answer's status (``504``: the run ended without an answer);
* ``askonce-callback-timestamp``: when it was signed, integer seconds since the Unix epoch;
* ``askonce-callback-signature``: base64 of HMAC-SHA256 over :func:`canonical`.

The canonical string is, each field on a line of its own::

    askonce-callback-v1
    <key>
    <location>
    <status>
    <content type>
    <timestamp>
    <hex sha256 of the body>

A receiver refuses a callback older (or further in the future) than its ``max_age`` seconds; the
signature binds the timestamp, so an old callback cannot be made young. Secrets follow
:mod:`askonce.core.signing`: at least 16 bytes; the sender signs with the first of several, the
receiver accepts any of them (rotation without a flag day). Time is an argument: no clock here.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from urllib.parse import unquote, urlsplit

from askonce.core.signing import Secret, secret_keys

__all__ = ["CALLBACK", "HEADERS", "NO_ANSWER", "Callback", "CallbackError", "allowed",
           "callback_url", "canonical", "check", "prefix", "sign"]

CALLBACK = "askonce-callback"  # the request header a caller names its callback URL in
KEY, LOCATION = "askonce-callback-key", "askonce-callback-location"
STATUS = "askonce-callback-status"
TIMESTAMP, SIGNATURE = "askonce-callback-timestamp", "askonce-callback-signature"
HEADERS = (KEY, LOCATION, STATUS, TIMESTAMP, SIGNATURE)
NO_ANSWER = 504  # the status a callback carries when the run ended without an answer
MAX_URL = 2048
MAX_FIELD = 4096  # characters of one callback header (a location is at most this long)
_CONTEXT = "askonce-callback-v1"
_KEY = re.compile(r"[0-9A-Za-z_-]{16,64}")
_TOKEN = re.compile(r"[\x21-\x7e]+")  # visible ASCII: no space, no control, no line break


@dataclass(frozen=True, slots=True)
class Callback:
    """A verified callback: the answer to question ``key``, as the server sent it."""

    key: str
    location: str
    status: int
    content_type: str
    body: bytes
    timestamp: int


class CallbackError(ValueError):
    """A callback refused: ``reason`` is one token (``missing``, ``malformed``, ``signature``,
    ``stale``, ``future``, ``repeated``), the message one line."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def callback_url(raw: str) -> str | None:
    """``raw`` as a callback URL the server could POST to, normalised (scheme and host lower
    case, the port written out), or ``None``: not absolute http(s), a user name or fragment,
    dot segments, path parameters or commas (``/hooks/..;/admin`` escapes ``/hooks/`` on a servlet
    container; a comma is how a server joins repeated header lines), spaces or control
    characters, not ASCII, or longer than ``MAX_URL``."""
    if not isinstance(raw, str) or not 0 < len(raw) <= MAX_URL or not _TOKEN.fullmatch(raw):
        return None
    try:
        parts = urlsplit(raw)
        port = parts.port
    except ValueError:
        return None
    scheme, host = parts.scheme.lower(), parts.hostname
    if scheme not in ("http", "https") or not host or "@" in parts.netloc or parts.fragment \
            or "#" in raw or "\\" in raw:
        return None
    path = parts.path or "/"
    if not path.startswith("/"):
        return None
    decoded = unquote(path)
    segments = decoded.split("/")
    if "." in segments or ".." in segments or ";" in decoded or "," in decoded:
        return None
    port = port if port is not None else (443 if scheme == "https" else 80)
    where = f"[{host}]" if ":" in host else host
    query = f"?{parts.query}" if parts.query else ""
    return f"{scheme}://{where}:{port}{path}{query}"


def allowed(url: str, prefixes: Iterable[str]) -> bool:
    """Whether the normalised ``url`` starts with one of ``prefixes`` (each normalised alike: a
    prefix ``http://127.0.0.1:8001/hooks/`` allows that path and below, nothing else)."""
    return any(url.startswith(p) for p in prefixes)


def prefix(raw: str) -> str:
    """An allowed prefix as the constructor takes it, normalised; ``ValueError`` unless it is an
    absolute http(s) URL whose path ends with ``/`` (so ``http://h:1/a`` cannot allow
    ``http://h:1/admin``) and has no query."""
    url = callback_url(raw) if isinstance(raw, str) else None
    if url is None or not url.endswith("/") or "?" in url:
        raise ValueError(f"a callback prefix must be an absolute http(s) URL whose path ends "
                         f"with '/', got {raw!r}")
    return url


def canonical(key: str, location: str, status: int, content_type: str, timestamp: int,
              body: bytes) -> bytes:
    """What the signature is over (see the module docstring)."""
    lines = (_CONTEXT, key, location, str(status), content_type, str(timestamp),
             hashlib.sha256(body).hexdigest())
    return "\n".join(lines).encode("utf-8", "surrogatepass")


def sign(secret: Secret | Sequence[Secret], key: str, location: str, status: int,
         content_type: str, timestamp: int, body: bytes) -> dict[str, str]:
    """The headers of a callback POST (but the content type), signed with ``secret`` (the first
    of several)."""
    first = secret_keys(secret)[0]
    mac = hmac.new(first, canonical(key, location, status, content_type, timestamp, body),
                   hashlib.sha256).digest()
    return {KEY: key, LOCATION: location, STATUS: str(status), TIMESTAMP: str(timestamp),
            SIGNATURE: base64.b64encode(mac).decode("ascii")}


def check(headers: Mapping[str, str], body: bytes, secret: Secret | Sequence[Secret],
          now: float, max_age: float) -> Callback:
    """The callback ``headers`` (lower-case names) and ``body`` carry, if signed with ``secret``
    (any of several) and at most ``max_age`` seconds away from ``now``; else
    :class:`CallbackError`. ``ValueError`` for a bad secret is the receiver's own mistake."""
    keys = secret_keys(secret)
    fields = {}
    for name in HEADERS:
        value = headers.get(name)
        if value is None:
            raise CallbackError("missing", f"callback refused: no {name} header")
        if not 0 < len(value) <= MAX_FIELD or not _TOKEN.fullmatch(value):
            raise CallbackError("malformed", f"callback refused: {name} is malformed")
        fields[name] = value
    content_type = headers.get("content-type", "")
    if len(content_type) > MAX_FIELD or not content_type.isascii():
        raise CallbackError("malformed", "callback refused: content-type is malformed")
    key, status, stamp = fields[KEY], fields[STATUS], fields[TIMESTAMP]
    if not _KEY.fullmatch(key):
        raise CallbackError("malformed", f"callback refused: {KEY} is not a question key")
    if not (status.isascii() and status.isdigit() and len(status) == 3 and int(status) >= 100):
        raise CallbackError("malformed", f"callback refused: {STATUS} is not a status")
    if not (stamp.isascii() and stamp.isdigit() and len(stamp) <= 12):
        raise CallbackError("malformed", f"callback refused: {TIMESTAMP} is not seconds")
    try:
        mac = base64.b64decode(fields[SIGNATURE], validate=True)
    except (binascii.Error, ValueError):
        raise CallbackError("malformed", f"callback refused: {SIGNATURE} is not base64") from None
    text = canonical(key, fields[LOCATION], int(status), content_type, int(stamp), body)
    ok = False
    for k in keys:  # every secret is tried: timing does not tell which one came close
        ok |= hmac.compare_digest(hmac.new(k, text, hashlib.sha256).digest(), mac)
    if not ok:
        raise CallbackError("signature", "callback refused: the signature does not match")
    age = now - int(stamp)
    if age > max_age:
        raise CallbackError("stale", f"callback refused: signed {age:.0f} s ago, over {max_age} s")
    if -age > max_age:
        raise CallbackError("future", f"callback refused: signed {-age:.0f} s in the future")
    return Callback(key, fields[LOCATION], int(status), content_type, body, int(stamp))
