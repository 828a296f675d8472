"""Request tracing with OpenTelemetry, off by default.

A request's trace is one span in the router (``infer``), with a child for each call it makes
on its way: the ensure of a miss (router worker to control plane), the control plane's own
work for that ensure and every call it makes to Triton (a family's fill, a model's load, an
unload, a warm-up), and the inference sent to Triton.  The W3C ``traceparent`` header joins
them across processes: the router worker sends it with the ensure, the control plane reads
it, and the inference carries it on to Triton, whose own tracing (``--trace-config
mode=opentelemetry``) can join the same trace.

``--trace-exporter`` (``MMS_TRACE_EXPORTER``) turns it on, in the control plane and its
router workers alike (``TRACE_EXPORTER``, domain.settings):

* ``otlp``: OTLP over HTTP to ``OTEL_EXPORTER_OTLP_ENDPOINT`` (a collector, Jaeger, Tempo;
  ``otlp=http://host:4318/v1/traces`` names the endpoint);
* ``console``: each span as one JSON line on stderr;
* ``file=PATH``: each span as one JSON line appended to PATH (benchmarks read it).

Without an exporter nothing is set up: the OpenTelemetry API's tracer is a no-op, and a span
costs a function call.  Spans never carry a request's data or a secret: model names,
servers, outcomes and sizes only.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import sys
from collections.abc import Mapping, MutableMapping
from typing import IO

from opentelemetry import propagate, trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from domain.errors import InvalidInput

log = logging.getLogger(__name__)

TRACER_NAME = "mms"
EXPORTERS = ("otlp", "console", "file=PATH")
TRACEPARENT = "traceparent"

__all__ = ["SpanKind", "Status", "StatusCode", "configure", "enabled", "inject", "install", "span",
           "traced", "tracer", "uninstall"]


_enabled = False  # set by configure/install: off, a span is a null context (no SDK call)


def enabled() -> bool:
    return _enabled


def tracer() -> trace.Tracer:
    """The product's tracer (a no-op until ``configure`` installs an exporter)."""
    return trace.get_tracer(TRACER_NAME)


def span(name: str, kind: SpanKind = SpanKind.INTERNAL, parent: Mapping[str, str] | None = None,
         **attributes):
    """``with span("ensure", SpanKind.CLIENT, model=...)``: a span, child of the current one or
    of the trace context in the headers ``parent`` (a caller's ``traceparent``); attributes
    are named ``mms.<key>``.  A null context while tracing is off."""
    if not _enabled:
        return contextlib.nullcontext()
    return tracer().start_as_current_span(
        name, context=propagate.extract(parent) if parent is not None else None, kind=kind,
        attributes={f"mms.{k}": v for k, v in attributes.items() if v is not None})


def traced(name: str, kind: SpanKind = SpanKind.CLIENT):
    """Decorator of an async method that calls another process (Triton, mostly): a span
    ``name`` around each call, with the model (a first argument that is a string) and the
    callee's address (``self.grpc_url``) as attributes."""
    def decorate(method):
        @functools.wraps(method)
        async def call(self, *args, **kwargs):
            if not _enabled:
                return await method(self, *args, **kwargs)
            model = args[0] if args and isinstance(args[0], str) else None
            with span(name, kind, model=model, server=getattr(self, "grpc_url", None)):
                return await method(self, *args, **kwargs)
        return call
    return decorate


def inject(carrier: MutableMapping[str, str] | None = None) -> MutableMapping[str, str]:
    """The current trace context as headers (``traceparent``) added to ``carrier``; nothing
    is added while tracing is off or no span is recording."""
    carrier = {} if carrier is None else carrier
    if _enabled:
        propagate.inject(carrier)
    return carrier


def install(provider) -> None:
    """Use ``provider`` (an SDK ``TracerProvider`` with its own processors: a test's
    in-memory exporter, a host application's setup) and turn the spans on."""
    global _enabled
    if trace.get_tracer_provider() is not provider:
        trace.set_tracer_provider(provider)  # once per process: OpenTelemetry keeps the first
    _enabled = True


def uninstall() -> None:
    """Turn the spans off again (OpenTelemetry keeps its provider: a test's, say)."""
    global _enabled
    _enabled = False


def _json_lines(stream: IO[str]):
    from opentelemetry.sdk.trace.export import ConsoleSpanExporter

    def one_line(readable_span) -> str:
        return readable_span.to_json(indent=None) + "\n"

    return ConsoleSpanExporter(out=stream, formatter=one_line)


def exporter_for(setting: str):
    """The span exporter a ``--trace-exporter`` value names; InvalidInput for any other."""
    kind, _, argument = setting.partition("=")
    kind = kind.strip().lower()
    if kind == "otlp":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        return OTLPSpanExporter(endpoint=argument or None)
    if kind == "console" and not argument:
        return _json_lines(sys.stderr)
    if kind == "file" and argument:
        try:
            stream = open(argument, "a", buffering=1)  # noqa: SIM115  (open while tracing runs)
        except OSError as exc:
            raise InvalidInput(f"--trace-exporter {setting}: cannot append to {argument}: "
                               f"{exc.strerror}") from None
        return _json_lines(stream)
    raise InvalidInput(f"--trace-exporter {setting!r} is not one of {', '.join(EXPORTERS)} "
                       "(or leave it unset: no tracing)")


@functools.cache
def configure(setting: str | None, service: str) -> bool:
    """Install a tracer provider that exports this process's spans as ``setting`` says
    (None or empty: nothing, the no-op tracer stays); True when tracing is on.  Once per
    process: OpenTelemetry keeps the first provider set."""
    if not setting:
        return False
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    exporter = exporter_for(setting)
    provider = TracerProvider(resource=Resource.create({"service.name": service}))
    provider.add_span_processor(BatchSpanProcessor(exporter))
    install(provider)
    log.info("tracing on: %s spans exported (%s)", service, setting.partition("=")[0])
    return True
