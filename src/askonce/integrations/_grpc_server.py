"""gRPC server side: the sync and ``grpc.aio`` server interceptors, the reply in trailing metadata.

Imported through :mod:`askonce.integrations.grpc`, which re-exports
:class:`AskonceServerInterceptor` and :class:`AsyncAskonceServerInterceptor`; the module docstring
there describes both sides. The metadata names both sides share (``grpc-retry-pushback-ms``, the
binary keys) live here, so that the client module imports this one and never the other way round.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any, NoReturn

import grpc
from grpc import aio

from askonce._stats import count
from askonce.core.wire import QUESTION_HEADER, REPLY_HEADER, Limits, Reply, format_reply
from askonce.integrations._server import Answer, Arrival, LedgerLike, Secret, Server, ServerOptions

__all__ = ["AskonceServerInterceptor", "AsyncAskonceServerInterceptor"]

Code = grpc.StatusCode
PUSHBACK = "grpc-retry-pushback-ms"
_REFUSAL = {"cap": Code.RESOURCE_EXHAUSTED, "deadline": Code.DEADLINE_EXCEEDED}
_QUESTION_BIN = QUESTION_HEADER + "-bin"
REPLY_BIN = REPLY_HEADER + "-bin"

Metadata = Iterable[tuple[str, str | bytes]]


def _trailing(existing: Metadata | None, reply: Reply) -> tuple[tuple[str, str | bytes], ...]:
    """The handler's trailing metadata with the reply added (a handler's own reply is replaced)."""
    kept = [(k, v) for k, v in existing or ()
            if k != REPLY_HEADER and not (reply.dnr and k == PUSHBACK)]
    kept.append((REPLY_HEADER, format_reply(reply)))
    if reply.dnr:
        kept.append((PUSHBACK, "-1"))  # clients retrying with gRPC's own retry policy stop too
    return tuple(kept)


def _failed(ctx: Any) -> bool:
    code = getattr(ctx, "code", None)
    status = code() if callable(code) else None
    return status is not None and status != Code.OK


def _method(details: Any) -> str:
    return str(details.method)


def _refusal(answer: Answer) -> tuple[grpc.StatusCode, str]:
    return (_REFUSAL.get(answer.reply.reason or "", Code.UNAVAILABLE),
            answer.body.decode("ascii").strip())


class _Serving:
    """What the sync and aio server interceptors share: options, and which handlers they wrap."""

    def __init__(self, *, layer: str, originator: bool = False, limits: Limits = Limits(),
                 budget: int = 2, deadline: float | None = 30.0, ledger: LedgerLike | None = None,
                 principal: Callable[[Any], str] | None = None,
                 operation: Callable[[Any], str] | None = None, shed_deadline: bool = True,
                 edge_secret: Secret | Sequence[Secret] | None = None,
                 trust: bool | Callable[[Any], bool] | None = None) -> None:
        self.server = Server(ServerOptions(
            layer=layer, originator=originator, limits=limits, budget=budget, deadline=deadline,
            ledger=ledger, principal=principal, operation=operation, shed_deadline=shed_deadline,
            edge_secret=edge_secret, trust=trust,
        ))  # fmt: skip

    def _wrap(self, handler: Any, details: Any,
              wrap: Callable[[Any, Any, list[str | bytes]], Any]) -> Any:
        if handler is None or handler.response_streaming:
            return handler  # response streams pass through: not bound, no reply
        values: list[str | bytes] = []
        for k, v in details.invocation_metadata or ():
            if k == QUESTION_HEADER:
                values.append(v)
            elif k == _QUESTION_BIN:  # the question is ASCII metadata; a binary one is not read
                count("malformed.question.binary")
        kinds = (handler.request_deserializer, handler.response_serializer)
        if handler.request_streaming:
            return grpc.stream_unary_rpc_method_handler(wrap(handler.stream_unary, details, values),
                                                        *kinds)
        return grpc.unary_unary_rpc_method_handler(wrap(handler.unary_unary, details, values),
                                                   *kinds)


class AskonceServerInterceptor(_Serving, grpc.ServerInterceptor):
    """Sync server: ``grpc.server(pool, interceptors=[AskonceServerInterceptor(layer="billing")])``.

    Options as :class:`askonce.integrations.asgi.AskonceASGIMiddleware` (``edge_secret`` included,
    no ``cancel_on_disconnect``), with ``principal`` and ``operation`` called on the
    ``grpc.HandlerCallDetails``; the default operation is the method name.
    """

    def intercept_service(self, continuation: Any,
                          handler_call_details: grpc.HandlerCallDetails) -> Any:
        return self._wrap(continuation(handler_call_details), handler_call_details, self._behavior)

    def _behavior(self, behavior: Callable[[Any, Any], Any], details: Any,
                  values: list[str | bytes]) -> Any:
        server = self.server

        def serve(request: Any, ctx: grpc.ServicerContext) -> Any:
            with server.arrive(values, details, _method) as arrival:
                if arrival.answer is not None:
                    ctx.set_trailing_metadata(_trailing((), arrival.answer.reply))
                    ctx.abort(*_refusal(arrival.answer))
                try:
                    response = behavior(request, ctx)
                except Exception as exc:
                    _sync_failure(server, arrival, ctx, exc)
                    raise
                ctx.set_trailing_metadata(_trailing(_existing(ctx), arrival.reply(_failed(ctx))))
                return response

        return serve


def _existing(ctx: Any) -> Metadata | None:
    getter = getattr(ctx, "trailing_metadata", None)
    return getter() if callable(getter) else None


def _sync_failure(server: Server, arrival: Arrival, ctx: grpc.ServicerContext,
                  exc: Exception) -> None:
    # The sync server sends the trailing metadata as it stands when the handler's exception reaches
    # it, so the reply can be written after the handler's own abort.
    answer = server.failure(arrival, exc)
    if answer is not None:
        ctx.set_trailing_metadata(_trailing(_existing(ctx), answer.reply))
        ctx.abort(Code.UNAVAILABLE, answer.body.decode("ascii").strip())
    ctx.set_trailing_metadata(_trailing(_existing(ctx), arrival.reply(True)))


class _AioContext:
    """The servicer context an aio handler sees: the real one, except that ``abort`` adds the reply.

    ``grpc.aio`` sends the trailing metadata as it stands when ``abort`` is called, so the reply
    cannot be added once the handler has aborted.
    """

    __slots__ = ("_arrival", "_ctx")

    def __init__(self, ctx: Any, arrival: Arrival) -> None:
        self._ctx = ctx
        self._arrival = arrival

    def __getattr__(self, name: str) -> Any:
        return getattr(self._ctx, name)

    async def abort(self, code: grpc.StatusCode, details: str = "",
                    trailing_metadata: Metadata = ()) -> NoReturn:
        base = trailing_metadata or self._ctx.trailing_metadata()
        await self._ctx.abort(code, details, _trailing(base, self._arrival.reply(True)))
        raise AssertionError("grpc.aio abort() returned")  # it always raises

    async def abort_with_status(self, status: grpc.Status) -> NoReturn:
        await self.abort(status.code, status.details, status.trailing_metadata)


class AsyncAskonceServerInterceptor(_Serving, aio.ServerInterceptor):
    """The ``grpc.aio`` server interceptor.

    ``aio.server(interceptors=[AsyncAskonceServerInterceptor(layer="billing")])``. Options as
    :class:`AskonceServerInterceptor`. The handler gets a context whose ``abort`` adds the reply;
    everything else is the real context's.
    """

    async def intercept_service(self, continuation: Any,
                                handler_call_details: grpc.HandlerCallDetails) -> Any:
        return self._wrap(await continuation(handler_call_details), handler_call_details,
                          self._behavior)

    def _behavior(self, behavior: Callable[[Any, Any], Awaitable[Any]], details: Any,
                  values: list[str | bytes]) -> Any:
        server = self.server
        # grpc.aio runs a sync handler in its migration_thread_pool.
        if not inspect.iscoroutinefunction(behavior):
            return _sync_on_aio(server, behavior, details, values)

        async def serve(request: Any, ctx: aio.ServicerContext[Any, Any]) -> Any:
            with server.arrive(values, details, _method) as arrival:
                if arrival.answer is not None:
                    code, text = _refusal(arrival.answer)
                    await ctx.abort(code, text, _trailing((), arrival.answer.reply))
                try:
                    response = await behavior(request, _AioContext(ctx, arrival))
                except aio.AbortError:
                    raise  # aborted through _AioContext: the reply is already on its way
                except Exception as exc:
                    answer = server.failure(arrival, exc)
                    if answer is not None:
                        await ctx.abort(Code.UNAVAILABLE, answer.body.decode("ascii").strip(),
                                        _trailing(ctx.trailing_metadata(), answer.reply))
                    ctx.set_trailing_metadata(_trailing(ctx.trailing_metadata(),
                                                        arrival.reply(True)))
                    raise
                ctx.set_trailing_metadata(_trailing(ctx.trailing_metadata(),
                                                    arrival.reply(_failed(ctx))))
                return response

        return serve


class _SyncAioContext:
    """The context a *sync* handler on a ``grpc.aio`` server sees: as :class:`_AioContext`,
    ``abort`` adds the reply; and what the handler sets is remembered, since that context cannot
    tell its trailing metadata or code."""

    __slots__ = ("_arrival", "_code", "_ctx", "_trailing")

    def __init__(self, ctx: Any, arrival: Arrival) -> None:
        self._ctx = ctx
        self._arrival = arrival
        self._code: grpc.StatusCode | None = None
        self._trailing: Metadata = ()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._ctx, name)

    def set_trailing_metadata(self, trailing_metadata: Metadata) -> None:
        self._trailing = tuple(trailing_metadata)
        self._ctx.set_trailing_metadata(self._trailing)

    def trailing_metadata(self) -> Metadata:
        return self._trailing

    def set_code(self, code: grpc.StatusCode) -> None:
        self._code = code
        self._ctx.set_code(code)

    def code(self) -> grpc.StatusCode | None:
        return self._code

    def abort(self, code: grpc.StatusCode, details: str = "",
              trailing_metadata: Metadata = ()) -> NoReturn:
        self._ctx.abort(code, details,
                        _trailing(trailing_metadata or self._trailing, self._arrival.reply(True)))
        raise AssertionError("grpc.aio abort() returned")  # it always raises

    def abort_with_status(self, status: grpc.Status) -> NoReturn:
        self.abort(status.code, status.details, status.trailing_metadata)


def _sync_on_aio(server: Server, behavior: Callable[[Any, Any], Any], details: Any,
                 values: list[str | bytes]) -> Callable[[Any, Any], Any]:
    """The aio server's ``serve`` for a sync handler.

    Run in the server's thread pool, as grpc.aio runs it.
    """

    def serve(request: Any, ctx: Any) -> Any:
        with server.arrive(values, details, _method) as arrival:
            if arrival.answer is not None:
                ctx.abort(*_refusal(arrival.answer), _trailing((), arrival.answer.reply))
            seen = _SyncAioContext(ctx, arrival)
            try:
                response = behavior(request, seen)
            except aio.AbortError:
                raise  # aborted through _SyncAioContext: the reply is already on its way
            except Exception as exc:
                answer = server.failure(arrival, exc)
                if answer is not None:
                    ctx.abort(Code.UNAVAILABLE, answer.body.decode("ascii").strip(),
                              _trailing(seen.trailing_metadata(), answer.reply))
                ctx.set_trailing_metadata(_trailing(seen.trailing_metadata(), arrival.reply(True)))
                raise
            ctx.set_trailing_metadata(_trailing(seen.trailing_metadata(),
                                                arrival.reply(_failed(seen))))
            return response

    return serve
