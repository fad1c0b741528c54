"""OpenTelemetry: real SDK spans carry the question; baggage round-trips through the W3C propagator."""

from __future__ import annotations

from opentelemetry.baggage.propagation import W3CBaggagePropagator
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

import askonce
from askonce.integrations.otel import AskonceSpanProcessor, from_baggage, to_baggage


def test_spans_started_inside_a_question_carry_it() -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(AskonceSpanProcessor())
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("test")

    with tracer.start_as_current_span("outside"):
        pass

    @askonce.retry(layer="svc")
    def work() -> None:
        with tracer.start_as_current_span("inside"):
            pass

    with askonce.question(budget=2, origin="web") as q:
        work()
    spans = {s.name: s for s in exporter.get_finished_spans()}
    assert "askonce.key" not in (spans["outside"].attributes or {})
    attrs = spans["inside"].attributes or {}
    assert attrs["askonce.key"] == q.key and attrs["askonce.origin"] == "web" and attrs["askonce.edge"] is True
    assert attrs["askonce.budget"] == 2 and tuple(attrs["askonce.path"]) == ("svc:1",)


def test_baggage_round_trip_through_the_w3c_propagator() -> None:
    with askonce.question(budget=3, deadline=10.0) as q:
        ctx = to_baggage(timeout=2.0)
    carrier: dict[str, str] = {}
    W3CBaggagePropagator().inject(carrier, context=ctx)
    assert "baggage" in carrier
    got = from_baggage(W3CBaggagePropagator().extract(carrier))
    assert got is not None and got.key == q.key and got.budget == 3


def test_malformed_baggage_is_counted_and_ignored() -> None:
    before = askonce.stats().get("malformed.question.version", 0)
    carrier = {"baggage": "askonce-question=v%3D7%2C%20b%3D1"}
    assert from_baggage(W3CBaggagePropagator().extract(carrier)) is None
    assert askonce.stats()["malformed.question.version"] == before + 1


def test_no_question_no_baggage() -> None:
    assert from_baggage(to_baggage()) is None
