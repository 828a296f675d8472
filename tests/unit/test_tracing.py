"""domain.tracing: off by default, one setting turns it on, and the trace context travels."""

from __future__ import annotations

import json

import pytest
from opentelemetry.sdk.trace.export import SimpleSpanProcessor

from domain import tracing
from domain.errors import InvalidInput
from tests.span_capture import capture


@pytest.fixture
def recording():
    yield capture()
    tracing.uninstall()


def test_off_a_span_is_a_null_context_and_nothing_is_injected():
    assert not tracing.enabled()
    with tracing.span("infer", model="m") as current:
        assert current is None
        assert tracing.inject() == {}


def test_on_the_traceparent_of_the_current_span_is_injected_and_parents_the_far_side(recording):
    with tracing.span("ensure", tracing.SpanKind.CLIENT, model="m1") as client:
        headers = tracing.inject({"authorization": "kept"})
    assert headers["authorization"] == "kept"
    trace_id = format(client.get_span_context().trace_id, "032x")
    assert headers["traceparent"].split("-")[1] == trace_id
    with tracing.span("ensure", tracing.SpanKind.SERVER, parent=headers, model="m1"):
        pass
    client_span, server_span = recording.get_finished_spans()
    assert server_span.parent.span_id == client_span.context.span_id
    assert server_span.attributes["mms.model"] == "m1"


def test_a_traced_call_records_its_failure(recording):
    class Admin:
        grpc_url = "127.0.0.1:1"

        @tracing.traced("triton.load")
        async def load(self, model):
            raise RuntimeError("refused")

    import asyncio

    with pytest.raises(RuntimeError):
        asyncio.run(Admin().load("cust001"))
    (span,) = recording.get_finished_spans()
    assert span.name == "triton.load" and not span.status.is_ok
    assert span.attributes == {"mms.model": "cust001", "mms.server": "127.0.0.1:1"}


@pytest.mark.parametrize("setting", ["jaeger", "file=", "console=x", "otlp-grpc"])
def test_an_unknown_exporter_is_a_clear_error(setting):
    with pytest.raises(InvalidInput, match="otlp, console, file=PATH"):
        tracing.exporter_for(setting)


def test_the_file_exporter_writes_one_json_span_per_line(tmp_path):
    from opentelemetry.sdk.trace import TracerProvider as Provider

    path = tmp_path / "spans.jsonl"
    provider = Provider()
    provider.add_span_processor(SimpleSpanProcessor(tracing.exporter_for(f"file={path}")))
    with provider.get_tracer("t").start_as_current_span("infer"):
        pass
    provider.shutdown()
    (line,) = path.read_text().splitlines()
    assert json.loads(line)["name"] == "infer"
