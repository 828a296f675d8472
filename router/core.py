"""The data plane core: resolve, rate-limit, ensure, forward, record.  Transport-free.

The gRPC and HTTP front ends only convert wire messages and call into ``Router``.  The
router runs in the control plane's process and reads the manager's state directly, so a
request for a loaded model pays no remote call besides the one to Triton.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import AsyncIterator, Callable, NoReturn

import grpc
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from tritonclient.grpc import service_pb2, service_pb2_grpc

from control_plane.errors import ControlPlaneError
from control_plane.manager import ModelManager, TritonServer

from .canary import CanaryController
from .errors import (
    BackendUnavailable,
    InvalidRequest,
    PermissionDenied,
    RateLimited,
    RequestTimeout,
    RouterError,
    from_control_plane,
)
from .ratelimit import TokenBucket
from .routes import Decision, RouteTable
from .shadow import ShadowItem, ShadowMirror, outputs_of
from .stats import StatsBook

log = logging.getLogger(__name__)

LATENCY_BUCKETS_S = (0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
                     1, 2.5, 5, 10, 30)
GRPC_MESSAGE_LIMIT_BYTES = 64 * 1024 * 1024
INFER_METHOD = "/inference.GRPCInferenceService/ModelInfer"
BYTES_CACHE_MAX = 4096


@dataclass
class RouterConfig:
    load_timeout_s: float = 120.0
    request_timeout_s: float = 60.0
    max_request_bytes: int = 16 * 1024 * 1024
    shadow_queue_size: int = 64
    shadow_workers: int = 2
    shadow_timeout_s: float = 5.0
    shadow_log_dir: Path | None = None
    canary_interval_s: float = 1.0


@dataclass
class Call:
    decision: Decision
    start: float
    server: TritonServer | None = None
    code: str = "OK"


class RouterMetrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        r = self.registry = registry or CollectorRegistry()
        self.requests = Counter("mmr_requests_total", "Inference requests by route and variant",
                                ["route", "model", "variant", "code"], registry=r)
        self.latency = Histogram("mmr_request_seconds", "End-to-end router latency",
                                 ["route", "variant"], buckets=LATENCY_BUCKETS_S, registry=r)
        self.cold_waits = Counter("mmr_cold_load_waits_total",
                                  "Requests that waited for a model to load", ["model"], registry=r)
        self.cold_wait_seconds = Histogram("mmr_cold_load_wait_seconds", "Time waiting for a load",
                                           ["model"], buckets=LATENCY_BUCKETS_S, registry=r)
        self.rate_limited = Counter("mmr_rate_limited_total", "Requests rejected by a rate limit",
                                    ["limit"], registry=r)
        self.shadow_dropped = Counter("mmr_shadow_dropped_total", "Mirrors dropped (queue full)",
                                      ["route"], registry=r)
        self.shadow_results = Counter("mmr_shadow_results_total",
                                      "Shadow outcomes: match, diverged, error, timeout",
                                      ["route", "result"], registry=r)
        self.refused = Counter("mmr_refused_total", "Model-control calls refused on the public port",
                               ["api"], registry=r)
        self.inflight = Gauge("mmr_inflight_requests", "Requests in flight", registry=r)


class Router:
    def __init__(self, manager: ModelManager, table: RouteTable, config: RouterConfig | None = None,
                 metrics: RouterMetrics | None = None, rng: random.Random | None = None):
        self.manager = manager
        self.table = table
        self.config = config or RouterConfig()
        self.metrics = metrics or RouterMetrics()
        self.stats = StatsBook(clock=time.time)
        self.canaries = CanaryController(table, self.stats)
        self.rng = rng or random.Random()
        self._buckets: dict[str, tuple[dict, TokenBucket]] = {}
        self._channels: dict[str, tuple[grpc.aio.Channel, service_pb2_grpc.GRPCInferenceServiceStub, object]] = {}
        self._suffixes: dict[tuple, bytes] = {}
        self._name_overrides: dict[str, bytes] = {}
        self._metric_children: dict[tuple, tuple] = {}
        self.shadow = ShadowMirror(self._send_shadow, self.config.shadow_log_dir,
                                   self.config.shadow_queue_size, self.config.shadow_workers,
                                   self.config.shadow_timeout_s, self.metrics)
        self._canary_task: asyncio.Task | None = None

    async def start(self) -> None:
        self.shadow.start()
        self._canary_task = asyncio.get_running_loop().create_task(self._canary_loop())

    async def stop(self) -> None:
        if self._canary_task:
            self._canary_task.cancel()
        await self.shadow.stop()
        for channel, *_ in self._channels.values():
            await channel.close()

    async def _canary_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.canary_interval_s)
            self.canaries.step()

    # ------------------------------------------------------------------ pieces
    def stub(self, server: TritonServer) -> service_pb2_grpc.GRPCInferenceServiceStub:
        entry = self._channels.get(server.spec.grpc_url)
        if entry is None:
            channel = grpc.aio.insecure_channel(server.spec.grpc_url, options=[
                ("grpc.max_send_message_length", GRPC_MESSAGE_LIMIT_BYTES),
                ("grpc.max_receive_message_length", GRPC_MESSAGE_LIMIT_BYTES),
            ])
            # The raw ModelInfer callable sends and receives bytes: the router never
            # re-serializes a request or parses a response it only passes through.
            entry = self._channels[server.spec.grpc_url] = (
                channel, service_pb2_grpc.GRPCInferenceServiceStub(channel),
                channel.unary_unary(INFER_METHOD, request_serializer=None, response_deserializer=None))
        return entry[1]

    def raw_infer(self, server: TritonServer):
        self.stub(server)
        return self._channels[server.spec.grpc_url][2]

    def check_limits(self, *names: str) -> None:
        for name in names:
            spec = self.table.limits.get(name)
            if spec is None:
                continue
            cached = self._buckets.get(name)
            if cached is None or cached[0] != spec:
                cached = self._buckets[name] = (spec, TokenBucket(spec["qps"], spec["burst"]))
            ok, retry_after_s = cached[1].try_acquire()
            if not ok:
                self.metrics.rate_limited.labels(name).inc()
                raise RateLimited(
                    f"rate limit for {name} is {spec['qps']:g} requests/s (burst {spec['burst']:g}); "
                    f"retry in {retry_after_s:.3f}s", retry_after_s)

    def decide(self, logical: str, user_id: str | None) -> Decision:
        try:
            decision = self.table.resolve(logical, user_id)
        except ControlPlaneError as exc:
            raise from_control_plane(exc) from exc
        if decision.model == logical:
            self.check_limits(logical)
        else:
            self.check_limits(logical, decision.model)
        return decision

    async def server_for(self, model: str) -> TritonServer:
        """The server with ``model`` READY; waits (bounded) for a load on a miss."""
        server = self.manager.ready_server_of(model)
        if server is not None:
            return server
        self.metrics.cold_waits.labels(model).inc()
        start = time.perf_counter()
        try:
            await asyncio.wait_for(asyncio.shield(self.manager.ensure(model)), self.config.load_timeout_s)
        except asyncio.TimeoutError:
            raise RequestTimeout(f"{model} did not finish loading within {self.config.load_timeout_s:.0f}s; "
                                 "the load goes on, retry shortly") from None
        except ControlPlaneError as exc:
            raise from_control_plane(exc) from exc
        finally:
            self.metrics.cold_wait_seconds.labels(model).observe(time.perf_counter() - start)
        server = self.manager.ready_server_of(model)
        if server is None:
            raise BackendUnavailable(f"{model} was unloaded before the request could be sent; retry")
        return server

    def record(self, decision: Decision, latency_s: float, code: str, known: bool = True) -> None:
        ok = code == "OK"
        # Adapters share their base's series: adapter names are chosen by clients.
        route = decision.logical.split(":", 1)[0] if known else "unknown"
        key = (route, decision.model if known else "unknown", decision.variant, code)
        children = self._metric_children.get(key)
        if children is None:  # labels() lookups cost more than the increments themselves
            children = self._metric_children[key] = (
                self.metrics.requests.labels(*key),
                self.metrics.latency.labels(route, decision.variant))
        children[0].inc()
        children[1].observe(latency_s)
        if not decision.scope.startswith(("exp:", "canary:")):
            return  # per-variant windows feed experiments and canaries only
        self.stats.record(decision.scope, decision.variant, latency_s * 1000, ok,
                          decision.randomly_assigned)

    # ------------------------------------------------------------------ inference
    @contextlib.asynccontextmanager
    async def serving(self, logical: str, user_id: str | None) -> AsyncIterator["Call"]:
        """Decide, rate-limit, ensure and lease for one request; record it when done.

        The body sets ``call.code`` to the outcome ("OK" or a status name)."""
        start = time.perf_counter()
        decision = self.decide(logical, user_id)
        call = Call(decision, start)
        rec = None
        sent = False
        self.metrics.inflight.inc()
        try:
            # The lease is taken before any wait for a load: the model a request waits for
            # is not evictable until that request has been served.
            rec = self.manager.records.get(decision.model)
            if rec is not None:
                rec.inflight += 1
                if rec.inflight == 1:
                    self.manager._sync_evictable(rec)
            else:
                try:
                    rec = await self.manager.acquire(decision.model)
                except ControlPlaneError as exc:
                    raise from_control_plane(exc) from exc
            call.server = await self.server_for(decision.model)
            self.manager.touch(decision.model)
            rec.active += 1  # sent to Triton: an unload drains these
            sent = True
            yield call
        except RouterError as exc:
            call.code = exc.grpc_code.name
            raise
        except BaseException:
            if call.code == "OK":
                call.code = "INTERNAL"
            raise
        finally:
            if sent:
                rec.active -= 1
            if rec is not None:
                self.manager.release(rec)
            self.metrics.inflight.dec()
            # Names that turned out unknown get no series of their own (label cardinality).
            self.record(decision, time.perf_counter() - start, call.code, known=rec is not None)

    @staticmethod
    def public_name(model_name: str, input_names, adapter_param: str | None) -> str:
        """The logical name a public request asks for, after the adapter checks.

        Adapter control (``ADAPTER_CONTROL``) is model control: never from the public port.
        An adapter chosen by request parameter is routed and rate-limited as ``base:adapter``
        so the per-adapter limit cannot be bypassed; the ``ADAPTER`` input is refused here
        because the router could not see which adapter it names."""
        for name in input_names:
            if name == "ADAPTER_CONTROL":
                raise PermissionDenied(
                    "ADAPTER_CONTROL is adapter management, not available on the public port; "
                    "use mmctl adapter load/unload/pin")
            if name == "ADAPTER":
                raise InvalidRequest(
                    f"select the adapter with the model name {model_name}:NAME or the request "
                    "parameter adapter=NAME (the ADAPTER input is not accepted by the router)")
        if adapter_param and ":" not in model_name:
            return f"{model_name}:{adapter_param}"
        return model_name

    @staticmethod
    def _adapter_param(request: service_pb2.ModelInferRequest) -> str | None:
        param = request.parameters.get("adapter")
        return param.string_param if param is not None and param.string_param else None

    async def infer(self, request: service_pb2.ModelInferRequest, user_id: str | None,
                    timeout_s: float | None = None) -> service_pb2.ModelInferResponse:
        """Route one ModelInferRequest.  Raises RouterError or grpc.aio.AioRpcError (Triton's)."""
        logical = self.public_name(request.model_name, (i.name for i in request.inputs),
                                   self._adapter_param(request))
        async with self.serving(logical, user_id) as call:
            decision, server = call.decision, call.server
            if decision.adapter is not None:
                self._check_adapter_parameter(request, decision)
                request.parameters["adapter"].string_param = decision.adapter
            shadow_request = None
            if decision.shadow:
                shadow_request = service_pb2.ModelInferRequest()
                shadow_request.CopyFrom(request)
                shadow_request.model_name = decision.shadow
            request.model_name = decision.model
            try:
                response = await self.stub(server).ModelInfer(
                    request, timeout=timeout_s or self.config.request_timeout_s)
            except grpc.aio.AioRpcError as exc:
                self._reraise(call, server, exc)
            params = response.parameters
            params["model"].string_param = decision.model
            params["variant"].string_param = decision.variant
            if decision.experiment:
                params["experiment"].string_param = decision.experiment
            if decision.adapter is not None:
                params["adapter"].string_param = decision.adapter
            if shadow_request is not None:
                self.shadow.offer(ShadowItem(decision.logical.split(":", 1)[0], decision.shadow,
                                             shadow_request,
                                             outputs_of(response),
                                             (time.perf_counter() - call.start) * 1000))
            return response

    @staticmethod
    def _reraise(call: Call, server: TritonServer, exc: grpc.aio.AioRpcError) -> NoReturn:
        """Triton's own answer (shape, dtype, ...) passes through; a Triton that is down
        says so."""
        call.code = exc.code().name
        if exc.code() == grpc.StatusCode.UNAVAILABLE:
            raise BackendUnavailable(
                f"Triton {server.name} at {server.spec.grpc_url} is unavailable "
                f"({exc.details()}); the control plane restarts it, retry shortly") from exc
        raise exc

    def _response_suffix(self, decision: Decision) -> bytes:
        """Serialized routing parameters, appended to Triton's response bytes.

        Protobuf merges concatenated messages (map entries add up), so appending these
        bytes equals setting the parameters on a parsed response."""
        key = (decision.model, decision.variant, decision.experiment, decision.adapter)
        suffix = self._suffixes.get(key)
        if suffix is None:
            r = service_pb2.ModelInferResponse()
            r.parameters["model"].string_param = decision.model
            r.parameters["variant"].string_param = decision.variant
            if decision.experiment:
                r.parameters["experiment"].string_param = decision.experiment
            if decision.adapter is not None:
                r.parameters["adapter"].string_param = decision.adapter
            if len(self._suffixes) >= BYTES_CACHE_MAX:  # keys include client-chosen adapters
                self._suffixes.clear()
            suffix = self._suffixes[key] = r.SerializeToString()
        return suffix

    def _model_override(self, model: str, adapter: str | None = None) -> bytes:
        """Appended to request bytes: for a singular field the last occurrence wins, and a
        map entry (``parameters["adapter"]``) is added to or replaces the request's own."""
        key = (model, adapter)
        suffix = self._name_overrides.get(key)
        if suffix is None:
            r = service_pb2.ModelInferRequest(model_name=model)
            if adapter is not None:
                r.parameters["adapter"].string_param = adapter
            if len(self._name_overrides) >= BYTES_CACHE_MAX:
                self._name_overrides.clear()
            suffix = self._name_overrides[key] = r.SerializeToString()
        return suffix

    @staticmethod
    def _check_adapter_parameter(request: service_pb2.ModelInferRequest, decision: Decision) -> None:
        """``tinylm:acme`` with parameter ``adapter=other`` is a contradiction, not a choice."""
        param = request.parameters.get("adapter")
        if param is not None and param.string_param and param.string_param != decision.adapter:
            raise InvalidRequest(
                f"model name {decision.logical!r} selects adapter {decision.adapter!r} but the request "
                f"parameter adapter is {param.string_param!r}; send one of them")

    async def infer_raw(self, raw: bytes, metadata_user_id: Callable[[], str | None],
                        timeout_s: float | None = None) -> bytes:
        """ModelInfer on serialized bytes: parse once to route, forward the bytes as they are."""
        try:
            request = service_pb2.ModelInferRequest.FromString(raw)
        except Exception as exc:  # DecodeError
            raise InvalidRequest(f"malformed ModelInferRequest: {exc}") from None
        param = request.parameters.get("user_id")
        user_id = param.string_param if param is not None and param.string_param else metadata_user_id()
        logical = self.public_name(request.model_name, (i.name for i in request.inputs),
                                   self._adapter_param(request))
        async with self.serving(logical, user_id) as call:
            decision, server = call.decision, call.server
            if decision.adapter is not None:
                self._check_adapter_parameter(request, decision)
                body = raw + self._model_override(decision.model, decision.adapter)
            elif decision.model != request.model_name:
                body = raw + self._model_override(decision.model)
            else:
                body = raw
            try:
                response = await self.raw_infer(server)(
                    body, timeout=timeout_s or self.config.request_timeout_s)
            except grpc.aio.AioRpcError as exc:
                self._reraise(call, server, exc)
            if decision.shadow:
                request.model_name = decision.shadow
                if decision.adapter is not None:
                    request.parameters["adapter"].string_param = decision.adapter
                self.shadow.offer(ShadowItem(
                    decision.logical.split(":", 1)[0], decision.shadow, request,
                    outputs_of(service_pb2.ModelInferResponse.FromString(response)),
                    (time.perf_counter() - call.start) * 1000))
            return response + self._response_suffix(decision)

    async def _send_shadow(self, model: str, request, timeout_s: float):
        server = await self.server_for(model)
        return await self.stub(server).ModelInfer(request, timeout=timeout_s)

    async def model_call(self, logical: str, method: str, version: str = ""):
        """Metadata / config / statistics for a logical name (loads the model if needed)."""
        decision = self.decide_without_limits(logical)
        server = await self.server_for(decision.model)
        stub = self.stub(server)
        if method == "metadata":
            resp = await stub.ModelMetadata(service_pb2.ModelMetadataRequest(name=decision.model, version=version))
            resp.name = logical
        elif method == "config":
            resp = await stub.ModelConfig(service_pb2.ModelConfigRequest(name=decision.model, version=version))
            resp.config.name = logical
        else:
            resp = await stub.ModelStatistics(service_pb2.ModelStatisticsRequest(name=decision.model, version=version))
        return resp

    def decide_without_limits(self, logical: str) -> Decision:
        try:
            return self.table.resolve(logical, None)
        except ControlPlaneError as exc:
            raise from_control_plane(exc) from exc

    def model_ready(self, logical: str) -> bool:
        """Ready = the concrete model is loaded now (readiness never triggers a load)."""
        decision = self.decide_without_limits(logical)
        if decision.model not in self.manager.catalog and decision.model not in self.manager.records:
            from .errors import ModelNotFound

            raise ModelNotFound(f"unknown model {logical!r}")
        return self.manager.ready_server_of(decision.model) is not None

    def any_server_up(self) -> bool:
        return any(s.up for s in self.manager.servers.values())
