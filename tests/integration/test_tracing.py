"""Request tracing: the spans of a miss, read from OpenTelemetry's in-memory exporter.

The product runs in this process (control plane, the router inside it, a real tritonserver
serving the demo family), so the SDK's in-memory exporter sees every span.  A miss that
evicts a variant must show, in one trace: the router's request, its ensure, the load, one
family control request that evicts and fills, and the inference sent to Triton, and nothing
else sent before the inference."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from control_plane.runtime.service import Service, ServiceConfig
from control_plane.triton.process import free_port
from domain import tracing
from mmctl.in_process_router import start_in_process_router
from tests.reference import expected_scores, scores_match
from tests.span_capture import capture

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def spans():
    yield capture()
    tracing.uninstall()


@pytest.fixture(scope="module")
def product(tmp_path_factory, spans):
    """The product in a thread of this process: 3 demo variants, one slot's room."""
    state = tmp_path_factory.mktemp("traced")
    cfg = ServiceConfig(state_dir=state / "state", fleet_size=3, demo=True, router_workers=0,
                        max_loaded=1, admin_port=free_port(), router_grpc_port=free_port(),
                        router_http_port=free_port(), triton_grpc_port=0, triton_http_port=0,
                        triton_metrics_port=0, reconcile_interval_s=30.0)
    service = Service(cfg, start_router=start_in_process_router)
    started, stop = threading.Event(), None
    failure: list[BaseException] = []

    async def run():
        nonlocal stop
        stop = asyncio.Event()
        try:
            await service.start()
        except BaseException as exc:
            failure.append(exc)
            started.set()
            raise
        started.set()
        try:
            await stop.wait()
        finally:
            await service.stop()

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_until_complete, args=(run(),), daemon=True)
    thread.start()
    assert started.wait(120), "the product did not start"
    assert not failure, failure
    yield service, f"127.0.0.1:{cfg.router_grpc_port}", loop
    loop.call_soon_threadsafe(stop.set)
    thread.join(60)


def scores(url: str, model: str, x: np.ndarray) -> np.ndarray:
    client = grpcclient.InferenceServerClient(url)
    inp = grpcclient.InferInput("FEATURES", list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    return client.infer(model, [inp]).as_numpy("SCORES")


def trace_of(exporter: InMemorySpanExporter, model: str) -> list:
    """The spans of the latest trace whose router span served ``model``, oldest first."""
    finished = exporter.get_finished_spans()
    root = [s for s in finished if s.name == "infer" and s.attributes.get("mms.model") == model][-1]
    return sorted((s for s in finished if s.context.trace_id == root.context.trace_id),
                  key=lambda s: s.start_time)


def test_a_miss_that_evicts_is_traced_as_ensure_one_control_request_and_the_inference(
        product, spans):
    service, url, _loop = product
    x = np.linspace(-1, 1, 2 * 64, dtype=np.float32).reshape(2, 64)
    repository = service.repository
    for model in ("cust001", "cust002"):  # cust002 takes cust001's only slot
        spans.clear()
        assert scores_match(scores(url, model, x), expected_scores(repository, model, x))
    trace = trace_of(spans, "cust002")
    names = [s.name for s in trace]
    root = trace[0]
    assert root.name == "infer" and root.kind is SpanKind.SERVER and root.parent is None
    inference = next(s for s in trace if s.name == "triton.infer")
    # Calls to another process that ended before the inference was sent: the miss's round
    # trips.  The ensure (the in-process router calls the manager) and one control request.
    before = [s for s in trace if s.kind is SpanKind.CLIENT and s.end_time <= inference.start_time]
    assert [s.name for s in before] == ["ensure", "family.load"], names
    fill = before[1]
    assert fill.attributes["mms.model"] == "cust002"
    assert fill.attributes["mms.evicting"] == "cust001"
    assert "triton.statistics" not in names and "family.status" not in names
    load = next(s for s in trace if s.name == "load")
    assert fill.parent.span_id == load.context.span_id  # the fill is the load's
    assert inference.parent.span_id == root.context.span_id
    assert all(s.context.trace_id == root.context.trace_id for s in trace)
    # A hit: the router's span and the inference, nothing else.
    spans.clear()
    assert scores_match(scores(url, "cust002", x), expected_scores(repository, "cust002", x))
    assert [s.name for s in trace_of(spans, "cust002")] == ["infer", "triton.infer"]


def test_a_reconcile_pass_runs_with_the_router_in_the_control_planes_process(product):
    """mmctl up --router-workers 0: the copies' autoscale reads the requests this router has
    on Triton (its copy queues); a reconcile pass that reads them raises nothing."""
    service, url, loop = product
    x = np.linspace(-1, 1, 64, dtype=np.float32).reshape(1, 64)
    assert scores_match(scores(url, "cust003", x), expected_scores(service.repository, "cust003", x))
    asyncio.run_coroutine_threadsafe(service.manager.step(), loop).result(60)

    async def outstanding():
        return service.manager.copies.load_of()

    load = asyncio.run_coroutine_threadsafe(outstanding(), loop).result(10)
    assert isinstance(load, dict) and all(n == 0 for n in load.values()), load
