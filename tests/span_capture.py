"""One in-memory span exporter per test process: OpenTelemetry takes its tracer provider
once, so every test that reads spans shares this one (and clears it first)."""

from __future__ import annotations

import functools

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from domain import tracing


@functools.cache
def _provider() -> tuple[TracerProvider, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider, exporter


def capture() -> InMemorySpanExporter:
    """Turn the product's spans on, into the shared exporter (cleared)."""
    provider, exporter = _provider()
    tracing.install(provider)
    exporter.clear()
    return exporter
