"""What the tests' ASGI apps share: reading a request's whole body."""

from __future__ import annotations

from typing import Any


async def read_body(receive: Any) -> bytes:
    """The request's body, every ``http.request`` message of it."""
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body", False):
            return body
