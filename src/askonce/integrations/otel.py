"""OpenTelemetry: the question on spans, and W3C baggage as a second carrier.

* :class:`AskonceSpanProcessor` stamps every span started while a question is bound with
  ``askonce.key``, ``askonce.origin``, ``askonce.edge``, ``askonce.budget`` and ``askonce.path``, so
  a trace shows which question each span served and how much budget was left when it started.
* :func:`to_baggage` / :func:`from_baggage` move the question through OpenTelemetry baggage for
  stacks that already propagate baggage but cannot add a header. The baggage entry holds the very
  same ``askonce-question`` dictionary (the W3C propagator percent-encodes it), so it is parsed with
  the same strict, bounded, clamping parser, and a malformed entry is counted like a malformed
  header.

Needs ``opentelemetry-api`` (``pip install askonce[otel]``); the processor plugs into the SDK's
``TracerProvider.add_span_processor``.
"""

from __future__ import annotations

from typing import Any

from opentelemetry import baggage
from opentelemetry import context as otel_context

from askonce import _context, _stats, propagation
from askonce.core.question import Question
from askonce.core.wire import QUESTION_HEADER, Limits

BAGGAGE_KEY = QUESTION_HEADER


def attributes(q: Question) -> dict[str, Any]:
    """The span attributes for a question (OpenTelemetry attribute types only)."""
    return {
        "askonce.key": q.key,
        "askonce.origin": q.origin,
        "askonce.edge": q.edge,
        "askonce.budget": q.budget,
        "askonce.path": [str(h) for h in q.path],
    }


class AskonceSpanProcessor:
    """A span processor (duck-typed to the SDK's ``SpanProcessor``) stamping the bound question."""

    def on_start(self, span: Any, parent_context: Any = None) -> None:
        q = _context.current()
        if q is not None:
            span.set_attributes(attributes(q))

    def on_end(self, span: Any) -> None:
        return None

    def shutdown(self) -> None:
        return None

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True

    def _on_ending(self, span: Any) -> None:  # newer SDKs call this hook; nothing to do
        return None


def to_baggage(ctx: otel_context.Context | None = None, *,
               timeout: float | None = None) -> otel_context.Context:
    """A context whose baggage carries the bound question (``ctx`` unchanged if none is bound)."""
    frame = _context.current_frame()
    if frame is None:
        return ctx if ctx is not None else otel_context.get_current()
    value = propagation.question_header(frame, _stats.monotonic(), timeout)
    return baggage.set_baggage(BAGGAGE_KEY, value, context=ctx)


def from_baggage(ctx: otel_context.Context | None = None, *,
                 limits: Limits = Limits()) -> Question | None:
    """The question carried in baggage, parsed and clamped like a header.

    ``None`` if absent or malformed.
    """
    value = baggage.get_baggage(BAGGAGE_KEY, context=ctx)
    if not isinstance(value, str):
        return None
    return propagation.extract({QUESTION_HEADER: value}, limits=limits)
