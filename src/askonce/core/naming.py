"""How an operation is named when the framework cannot say: the fallback the servers and the
audit of access logs share, and the bound on every operation name."""

from __future__ import annotations

import re

MAX_OPERATION_CHARS = 160  # an operation name longer than this is cut: names are bounded

_ID_SEGMENT = re.compile(
    r"[0-9]+"  # numbers
    r"|[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}"  # UUIDs
    r"|[0-9a-fA-F]{16,}"  # hex digests, object ids
    r"|(?=[A-Za-z_-]*[0-9])[0-9A-Za-z_-]{20,}"  # long opaque tokens with a digit (ULID, base64)
)


# The methods of RFC 9110 and PATCH: any other method a caller sends is named OTHER, so that
# invented methods cannot make operation names without bound.
_METHODS = frozenset({"CONNECT", "DELETE", "GET", "HEAD", "OPTIONS", "PATCH", "POST", "PUT",
                      "TRACE"})


def method_name(method: str) -> str:
    """The method as an operation name says it: a standard one as it is, any other ``OTHER``."""
    return method if method in _METHODS else "OTHER"


def path_template(method: str, path: str) -> str:
    """The fallback operation name: ``"GET /items/{id}"`` for ``GET /items/42``.

    Numeric, UUID, long hex and long opaque segments become ``{id}``; the name is bounded in length.
    Used when the framework's route table cannot be read.
    """
    segments = path.split("/")
    out = "/".join("{id}" if _ID_SEGMENT.fullmatch(s) else s for s in segments)
    return f"{method} {out}"[:MAX_OPERATION_CHARS]
