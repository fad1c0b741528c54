"""Signed edge keys through real gRPC servers on 127.0.0.1: ``edge_secret=`` on the server interceptors.

Two originators (sync, ``grpc.aio``) mint and sign a key for each request that arrives without one, and
relay it through the askonce client interceptor to one of two targets (sync, ``grpc.aio``) whose ledger
checks the signature. The targets' ledgers remember how each key was recorded.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from grpc import aio

import askonce
from askonce import RetryPolicy
from askonce.client import ClientPolicy
from askonce.core import wire
from askonce.core.backoff import NO_WAIT
from askonce.core.ledger import Ledger, LedgerPolicy
from askonce.core.question import Hop
from askonce.core.wire import QUESTION_HEADER
from askonce.integrations._server import LEDGER_LOCK, UNSIGNED
from askonce.integrations.grpc import (
    AskonceClientInterceptor,
    AskonceServerInterceptor,
    AsyncAskonceClientInterceptor,
    AsyncAskonceServerInterceptor,
    channel_options,
)
from grpc_servers import ServerSet, plain_call, start_sync

SERVICE = "askonce.test.Signed"
SECRET = b"0123456789abcdef0123"
OLD_SECRET = "an older secret, still accepted"
DAY = 86_400.0
MODES = ["sync", "aio"]


def method(name: str) -> str:
    return f"/{SERVICE}/{name}"


class Recording:
    """A core ledger that also remembers, per key, whether it was recorded as an edge key and by whom."""

    def __init__(self) -> None:
        self.inner = Ledger(LedgerPolicy(window=DAY))
        self.by_key: dict[str | None, tuple[bool, str | None]] = {}

    def record(self, now: float, operation: str, *, key: str | None, edge: bool = False,
               origin: str | None = None, **kw: Any) -> bool:
        self.by_key[key] = (edge, origin)
        return self.inner.record(now, operation, key=key, edge=edge, origin=origin, **kw)


def _seen() -> bytes:
    q = askonce.current()
    assert q is not None
    return json.dumps({"key": q.key, "edge": q.edge, "sig": (q.sig or b"").hex()}).encode()


def _policy() -> ClientPolicy:
    return ClientPolicy(layer="web", bucket=None, retry=RetryPolicy(attempts=1, backoff=NO_WAIT))


def sync_handlers() -> grpc.GenericRpcHandler:
    def echo(request: bytes, ctx: grpc.ServicerContext) -> bytes:
        return _seen()

    def relay(request: bytes, ctx: grpc.ServicerContext) -> bytes:  # request: the target's address
        with grpc.insecure_channel(request.decode(), options=channel_options()) as ch:
            channel = grpc.intercept_channel(ch, AskonceClientInterceptor(_policy(), idempotent=True))
            return channel.unary_unary(method("Echo"))(b"", timeout=5)  # type: ignore[no-any-return]

    return grpc.method_handlers_generic_handler(SERVICE, {
        "Echo": grpc.unary_unary_rpc_method_handler(echo), "Relay": grpc.unary_unary_rpc_method_handler(relay)})


def aio_handlers() -> grpc.GenericRpcHandler:
    async def echo(request: bytes, ctx: Any) -> bytes:
        return _seen()

    async def relay(request: bytes, ctx: Any) -> bytes:
        interceptor = AsyncAskonceClientInterceptor(_policy(), idempotent=True)
        async with aio.insecure_channel(request.decode(), options=channel_options(),
                                        interceptors=[interceptor]) as ch:
            return await ch.unary_unary(method("Echo"))(b"", timeout=5)  # type: ignore[no-any-return]

    return grpc.method_handlers_generic_handler(SERVICE, {
        "Echo": grpc.unary_unary_rpc_method_handler(echo), "Relay": grpc.unary_unary_rpc_method_handler(relay)})


class Servers(ServerSet):
    """Per mode, an originator (``originator=True`` and the secret) and a target (a ledger and the secrets)."""

    def __init__(self) -> None:
        super().__init__()
        self.ledgers = {"sync": Recording(), "aio": Recording()}
        self.urls: dict[str, str] = {}
        for role, interceptor in (
            ("originator", AskonceServerInterceptor(layer="web", originator=True, edge_secret=SECRET)),
            ("target", AskonceServerInterceptor(layer="billing", ledger=self.ledgers["sync"],
                                                edge_secret=[SECRET, OLD_SECRET])),
        ):
            _, self.urls[f"sync-{role}"] = self.add_sync(sync_handlers(), interceptors=[interceptor])
        for role, ainterceptor in (
            ("originator", AsyncAskonceServerInterceptor(layer="web", originator=True,
                                                         edge_secret=(SECRET, OLD_SECRET))),
            ("target", AsyncAskonceServerInterceptor(layer="billing", ledger=self.ledgers["aio"],
                                                     edge_secret=SECRET)),
        ):
            _, self.urls[f"aio-{role}"] = self.add_aio(aio_handlers(), interceptors=[ainterceptor])


@pytest.fixture(scope="module")
def servers() -> Iterator[Servers]:
    s = Servers()
    yield s
    s.close()


def seen_by(url: str, name: str, request: bytes = b"", metadata: tuple[tuple[str, str], ...] = ()) -> dict[str, Any]:
    """What the handler saw, from a call without askonce on the client side (nothing arrives at the first server)."""
    code, _, body = plain_call(url, method(name), request, metadata)
    if body is None:
        raise RuntimeError(f"{name} failed with {code}")
    return json.loads(body)  # type: ignore[no-any-return]


def signed_question(secret: bytes | str | None) -> tuple[tuple[str, str], ...]:
    key = askonce.propagation.new_key()
    sig = None if secret is None else askonce.core.signing.mac(key, secret)
    value = wire.format_question(key, "edge", True, 2, 5.0, (Hop("edge", 1),), sig)
    return ((QUESTION_HEADER, value),)


@pytest.mark.parametrize("target", MODES)
@pytest.mark.parametrize("originator", MODES)
def test_a_key_minted_by_a_grpc_originator_is_signed_and_verified_as_an_edge_key_at_the_target(
        originator: str, target: str, servers: Servers) -> None:
    seen = seen_by(servers.urls[f"{originator}-originator"], "Relay", servers.urls[f"{target}-target"].encode())
    assert seen["edge"] is True
    assert askonce.core.signing.verify_key(seen["key"], bytes.fromhex(seen["sig"]), SECRET)  # the first secret signs
    assert not askonce.core.signing.verify_key(seen["key"], bytes.fromhex(seen["sig"]), OLD_SECRET)
    assert servers.ledgers[target].by_key[seen["key"]] == (True, "web")  # attributable to the originator


@pytest.mark.parametrize("target", MODES)
def test_a_forged_or_unsigned_edge_key_is_recorded_as_unsigned_not_attributable(target: str,
                                                                                servers: Servers) -> None:
    ledger = servers.ledgers[target]
    before = askonce.stats().get("ledger.edge.unsigned", 0)
    with LEDGER_LOCK:
        attributable = ledger.inner.report(time.time()).find(method("Echo"))
    base = 0 if attributable is None else attributable.attributable
    keys = {}
    for name, secret in (("signed", SECRET), ("forged", b"not the originators' secret!"), ("unsigned", None)):
        seen = seen_by(servers.urls[f"{target}-target"], "Echo", metadata=signed_question(secret))
        assert seen["edge"] is True  # the handler sees the question as it came; only the ledger judges
        keys[name] = seen["key"]
    assert ledger.by_key[keys["signed"]] == (True, "edge")
    assert ledger.by_key[keys["forged"]] == (False, UNSIGNED)
    assert ledger.by_key[keys["unsigned"]] == (False, UNSIGNED)
    assert askonce.stats()["ledger.edge.unsigned"] == before + 2
    with LEDGER_LOCK:
        op = ledger.inner.report(time.time()).find(method("Echo"))
    assert op is not None and op.attributable == base + 1 and op.reminted_by[UNSIGNED] >= 2


def test_the_older_secret_still_verifies_while_rotating(servers: Servers) -> None:
    seen = seen_by(servers.urls["sync-target"], "Echo", metadata=signed_question(OLD_SECRET))
    assert servers.ledgers["sync"].by_key[seen["key"]] == (True, "edge")  # the sync target accepts both


def test_an_originator_without_the_secret_mints_keys_the_target_does_not_attribute(servers: Servers) -> None:
    unsigned, url = start_sync(sync_handlers(), interceptors=[AskonceServerInterceptor(layer="web", originator=True)],
                               workers=2)
    try:
        seen = seen_by(url, "Relay", servers.urls["sync-target"].encode())
    finally:
        unsigned.stop(None)
    assert seen["edge"] is True and seen["sig"] == ""
    assert servers.ledgers["sync"].by_key[seen["key"]] == (False, UNSIGNED)


@pytest.mark.parametrize("interceptor", [AskonceServerInterceptor, AsyncAskonceServerInterceptor])
@pytest.mark.parametrize("secret", [b"short", "", [], [SECRET, b"short"], 42, [42]])
def test_a_bad_edge_secret_is_refused_with_value_error(interceptor: Any, secret: Any) -> None:
    with pytest.raises(ValueError, match="edge_secret"):
        interceptor(layer="billing", edge_secret=secret)
