"""The data plane core: resolve, rate-limit, ensure, forward, record.  Transport-free.

The gRPC and HTTP front ends only convert wire messages and call into ``Router``.  Where
models live comes from a state source (``router.serving_state``): the manager of this
process, or a router worker's snapshot of the control plane.  A request for a loaded model
pays no remote call besides the one to Triton; a miss asks the control plane to load it.
Nothing here holds a lease on a model: Triton finishes in-flight requests before it
unloads, and a request that meets a model unloaded under it is sent again once, after an
ensure, without the client seeing it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

import grpc
from google.protobuf.message import DecodeError
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from tritonclient.grpc import service_pb2, service_pb2_grpc

from control_plane.domain import errors as cp
from control_plane.domain.errors import ControlPlaneError
from router.answers import BYTES_CACHE_MAX, Answers
from router.canary import CanaryController
from router.errors import (
    BackendUnavailable,
    InvalidRequest,
    PermissionDenied,
    RequestTimeout,
    RouterError,
    UnknownModel,
    UpstreamError,
    from_control_plane,
    parse_version,
)
from router.limits import LocalLimiter
from router.public_names import PublicNames
from router.repository_config import FolderConfig
from router.routes import Decision, RouteTable
from router.serving_state import UNLOADED_PREFIX, LocalState, ServerAddress, ServingState
from router.shadow import ShadowItem, ShadowMirror, outputs_of
from router.stats import StatsBook

log = logging.getLogger(__name__)

LATENCY_BUCKETS_S = (0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
                     1, 2.5, 5, 10, 30)
GRPC_MESSAGE_LIMIT_BYTES = 64 * 1024 * 1024
INFER_METHOD = "/inference.GRPCInferenceService/ModelInfer"


@dataclass
class RouterConfig:
    load_timeout_s: float = 120.0
    request_timeout_s: float = 60.0
    max_request_bytes: int = 16 * 1024 * 1024
    shadow_queue_size: int = 64
    shadow_workers: int = 2
    shadow_timeout_s: float = 5.0
    shadow_log_dir: Path | None = None
    canary_interval_s: float = 1.0  # 0: canaries are judged elsewhere (the control plane)


@dataclass
class Call:
    decision: Decision
    start: float
    server: ServerAddress | None = None
    code: str = "OK"
    ready_at: float | None = None  # perf_counter when the model was ready (after any load)


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
        self.inflight = Gauge("mmr_inflight_requests", "Requests in flight", registry=r,
                              multiprocess_mode="livesum")  # summed over live router workers


def unloaded_under(exc: grpc.aio.AioRpcError) -> bool:
    """Triton's answer for a model it no longer holds (unloaded between placement and send)."""
    return exc.code() == grpc.StatusCode.NOT_FOUND and (exc.details() or "").startswith(UNLOADED_PREFIX)


class Router(Answers):
    def __init__(self, state, table: RouteTable, config: RouterConfig | None = None,
                 metrics: RouterMetrics | None = None, rng: random.Random | None = None,
                 names: PublicNames | None = None):
        """``state``: a ServingState, or the control plane's ModelManager in this process.
        ``names``: the registry's public names (None: every name is served as it is, with
        Triton's own versions)."""
        if hasattr(state, "ready_server"):
            self.state: ServingState = state
            self.manager = None
        else:
            self.state = LocalState(state)
            self.manager = state
        self.table = table
        self.names = names
        self.config = config or RouterConfig()
        self.metrics = metrics or RouterMetrics()
        self.stats = StatsBook(clock=time.time)
        self.canaries = CanaryController(table, self.stats)
        self.rng = rng or random.Random()
        self.limiter = LocalLimiter(lambda: self.table.limits,
                                    on_limited=lambda name: self.metrics.rate_limited.labels(name).inc())
        self._channels: dict[str, tuple[grpc.aio.Channel, service_pb2_grpc.GRPCInferenceServiceStub, object]] = {}
        self._suffixes: dict[tuple, bytes] = {}
        self._suffixes_of = (-1, -1)  # (table.version, names.generation) the suffixes reflect
        self._configs: dict[str, tuple[float, FolderConfig | None]] = {}  # concrete -> (read at, config)
        self._name_overrides: dict[str, bytes] = {}
        self._metric_children: dict[tuple, tuple] = {}
        self.inflight = 0  # requests in serving(): shadows are shed first when it is high
        self.shadow = ShadowMirror(self._send_shadow, self.config.shadow_log_dir,
                                   self.config.shadow_queue_size, self.config.shadow_workers,
                                   self.config.shadow_timeout_s, self.metrics,
                                   primary_inflight=lambda: self.inflight)
        self._canary_task: asyncio.Task | None = None

    async def start(self) -> None:
        self.shadow.start()
        if self.config.canary_interval_s > 0:
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
    def stub(self, server: ServerAddress) -> service_pb2_grpc.GRPCInferenceServiceStub:
        entry = self._channels.get(server.grpc_url)
        if entry is None:
            channel = grpc.aio.insecure_channel(server.grpc_url, options=[
                ("grpc.max_send_message_length", GRPC_MESSAGE_LIMIT_BYTES),
                ("grpc.max_receive_message_length", GRPC_MESSAGE_LIMIT_BYTES),
            ])
            # The raw ModelInfer callable sends and receives bytes: the router never
            # re-serializes a request or parses a response it only passes through.
            entry = self._channels[server.grpc_url] = (
                channel, service_pb2_grpc.GRPCInferenceServiceStub(channel),
                channel.unary_unary(INFER_METHOD, request_serializer=None, response_deserializer=None))
        return entry[1]

    def raw_infer(self, server: ServerAddress):
        self.stub(server)
        return self._channels[server.grpc_url][2]

    def check_limits(self, *names: str) -> None:
        self.limiter.check(names)

    @staticmethod
    def limited_names(decision: Decision) -> tuple[str, ...]:
        """The names whose limits a request spends: the name asked for and the model it reaches."""
        if decision.model == decision.logical:
            return (decision.logical,)
        return (decision.logical, decision.model)

    def decide(self, logical: str, user_id: str | None, version: str = "") -> Decision:
        """Route one request (``version``: parsed with ``parse_version``) and apply the rate
        limits of the name and of the model it reaches (this process's buckets)."""
        decision = self.route(logical, user_id, version)
        self.limiter.check(self.limited_names(decision))
        return decision

    def route(self, logical: str, user_id: str | None, version: str = "") -> Decision:
        """Route one request; no limits applied."""
        if version:
            decision = self._resolve(logical, user_id, version)
        else:  # the common case, inline: no version, route by name
            try:
                decision = self.table.resolve(logical, user_id)
            except cp.InvalidModelName as exc:
                raise self._invalid_name(logical, exc) from None
            except ControlPlaneError as exc:
                raise from_control_plane(exc) from exc
        return decision

    async def server_for(self, model: str, asked: str | None = None, fresh: bool = False) -> ServerAddress:
        """The server with ``model`` READY; waits (bounded) for a load on a miss.

        ``fresh``: ask the control plane even if this process believes the model loaded
        (Triton just said it is not).  Errors name ``asked``, the model as the client knows it."""
        server = None if fresh else self.state.ready_server(model)
        if server is not None:
            return server
        asked = asked or model
        start = time.perf_counter()
        counted = False
        try:
            server = await asyncio.wait_for(self.state.ensure(model), self.config.load_timeout_s)
            counted = True
        except RouterError:
            counted = True
            raise
        except TimeoutError:
            counted = True
            raise RequestTimeout(f"'{asked}' did not finish loading within {self.config.load_timeout_s:.0f}s; "
                                 "the load goes on, retry shortly") from None
        except ControlPlaneError as exc:
            counted = not isinstance(exc, cp.ModelNotFound)
            raise self._serving_error(exc, asked) from exc
        finally:
            if counted:  # unknown names get no series of their own (label cardinality)
                self.metrics.cold_waits.labels(model).inc()
                self.metrics.cold_wait_seconds.labels(model).observe(time.perf_counter() - start)
        return server

    @staticmethod
    def _serving_error(exc: ControlPlaneError, asked: str) -> RouterError:
        """A control-plane failure met while serving ``asked``, as the client should see it.

        Triton answers a model that is not in its repository "unknown model" and one whose
        load failed "has no available versions"; the router does the same.  The reason of a
        failed load is the operator's (``mmctl health``), and a full fleet is not explained
        to clients with the names of other models."""
        if isinstance(exc, cp.ModelNotFound):
            return UnknownModel(asked)
        if isinstance(exc, cp.ModelLoadFailed):
            return UnknownModel(asked, no_versions=True)
        if isinstance(exc, cp.CapacityExhausted):
            return BackendUnavailable(f"'{asked}' cannot be loaded now: the servers have no room "
                                      "for it; retry later")
        return from_control_plane(exc)

    def record(self, decision: Decision, latency_s: float, code: str, known: bool = True,
               served_s: float | None = None) -> None:
        """``served_s``: latency from when the model was ready (None: it never was)."""
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
        # Judge the model, not its load or the client: latency from ready, client errors apart.
        self.stats.record_outcome(decision.scope, decision.variant, code,
                                  None if served_s is None else served_s * 1000,
                                  decision.randomly_assigned)

    # ------------------------------------------------------------------ inference
    @contextlib.asynccontextmanager
    async def serving(self, logical: str, user_id: str | None, version: str = "") -> AsyncIterator[Call]:
        """Decide, rate-limit and find (or have loaded) the server for one request; record it
        when done.

        ``version``: the client's model version, already checked with ``parse_version``.
        The body sets ``call.code`` to the outcome ("OK" or a status name)."""
        start = time.perf_counter()
        decision = self.route(logical, user_id, version)
        await self.limiter.acquire(self.limited_names(decision))
        call = Call(decision, start)
        known = True
        self.metrics.inflight.inc()
        self.inflight += 1
        try:
            try:
                call.server = await self.server_for(decision.model, decision.logical)
            except UnknownModel:
                known = False  # names that turned out unknown get no series (label cardinality)
                raise
            call.ready_at = time.perf_counter()
            self.state.touch(decision.model)
            yield call
        except RouterError as exc:
            call.code = exc.grpc_code.name
            raise
        except asyncio.CancelledError:  # the client went away or its deadline passed
            call.code = "CANCELLED"
            raise
        except BaseException:
            if call.code == "OK":
                call.code = "INTERNAL"
            raise
        finally:
            self.metrics.inflight.dec()
            self.inflight -= 1
            end = time.perf_counter()
            self.record(decision, end - start, call.code, known=known,
                        served_s=None if call.ready_at is None else end - call.ready_at)

    async def resend_after_unload(self, call: Call) -> ServerAddress:
        """Triton no longer holds the model the request was sent to (evicted in between):
        have it loaded again and return where; the caller sends once more."""
        call.server = await self.server_for(call.decision.model, call.decision.logical, fresh=True)
        call.ready_at = time.perf_counter()
        return call.server

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
        """Route one ModelInferRequest.  Raises RouterError (Triton's own answers included)."""
        version = parse_version(request.model_version) if request.model_version else ""
        asked = request.model_name
        logical = self.public_name(asked, (i.name for i in request.inputs),
                                   self._adapter_param(request))
        async with self.serving(logical, user_id, version) as call:
            decision, server = call.decision, call.server
            if decision.adapter is not None:
                self._check_adapter_parameter(request, decision)
                request.parameters["adapter"].string_param = decision.adapter
            shadow_request = None
            if decision.shadow:
                shadow_request = service_pb2.ModelInferRequest()
                shadow_request.CopyFrom(request)
                shadow_request.model_name, shadow_request.model_version = decision.shadow, ""
            request.model_name = decision.model
            request.model_version = decision.version
            try:
                try:
                    response = await self.stub(server).ModelInfer(
                        request, timeout=timeout_s or self.config.request_timeout_s)
                except grpc.aio.AioRpcError as exc:
                    if not unloaded_under(exc):
                        raise
                    server = await self.resend_after_unload(call)
                    response = await self.stub(server).ModelInfer(
                        request, timeout=timeout_s or self.config.request_timeout_s)
            except grpc.aio.AioRpcError as exc:
                self._reraise(call, server, exc, asked)
            public_model, public_version = self.public_identity(decision)
            response.model_name = asked
            if public_version is not None:
                response.model_version = public_version
            params = response.parameters
            params["model"].string_param = public_model
            params["variant"].string_param = decision.variant
            if decision.experiment:
                params["experiment"].string_param = decision.experiment
            if decision.adapter is not None:
                params["adapter"].string_param = decision.adapter
            if shadow_request is not None:
                self.shadow.offer(ShadowItem(decision.logical.split(":", 1)[0], decision.shadow,
                                             shadow_request.SerializeToString(),
                                             outputs_of(response),
                                             (time.perf_counter() - call.start) * 1000))
            return response

    @classmethod
    def _reraise(cls, call: Call, server: ServerAddress, exc: grpc.aio.AioRpcError, asked: str) -> NoReturn:
        """Triton's own answer (shape, dtype, ...) passes on with its code, about the model
        the client asked for; a Triton that is down says so."""
        call.code = exc.code().name
        if exc.code() == grpc.StatusCode.UNAVAILABLE:
            raise BackendUnavailable(
                f"Triton {server.name} at {server.grpc_url} is unavailable "
                f"({exc.details()}); the control plane restarts it, retry shortly") from exc
        raise UpstreamError(exc.code(), cls.public_text(exc.details() or "", call.decision.model, asked)) from exc

    def _response_suffix(self, asked: str, decision: Decision) -> bytes:
        """Serialized name, version and routing parameters, appended to Triton's response
        bytes.

        Protobuf merges concatenated messages (the last value of a singular field wins, map
        entries add up), so appending these bytes equals setting the fields on a parsed
        response."""
        names = self.names
        generation = names.generation if names is not None else 0
        if self.table.version != self._suffixes_of[0] or generation != self._suffixes_of[1]:
            self._suffixes.clear()  # a route or the registry changed: public names may have too
            self._suffixes_of = (self.table.version, generation)
        key = (asked, decision.model, decision.variant, decision.experiment, decision.adapter,
               decision.version)
        suffix = self._suffixes.get(key)
        if suffix is None:
            public_model, public_version = self.public_identity(decision)
            r = service_pb2.ModelInferResponse(model_name=asked)
            if public_version is not None:
                r.model_version = public_version
            r.parameters["model"].string_param = public_model
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
        except DecodeError as exc:
            raise InvalidRequest(f"malformed ModelInferRequest: {exc}") from None
        param = request.parameters.get("user_id")
        user_id = param.string_param if param is not None and param.string_param else metadata_user_id()
        version = parse_version(request.model_version) if request.model_version else ""
        asked = request.model_name
        logical = self.public_name(asked, (i.name for i in request.inputs),
                                   self._adapter_param(request))
        async with self.serving(logical, user_id, version) as call:
            decision, server = call.decision, call.server
            if decision.adapter is not None:
                self._check_adapter_parameter(request, decision)
            if request.model_version != decision.version:
                # A registry version chose the concrete model; Triton gets no version.  An
                # empty field cannot be appended (proto3 does not write it): re-serialize.
                request.model_name = decision.model
                request.model_version = decision.version
                if decision.adapter is not None:
                    request.parameters["adapter"].string_param = decision.adapter
                body = request.SerializeToString()
            elif decision.adapter is not None:
                body = raw + self._model_override(decision.model, decision.adapter)
            elif decision.model != asked:
                body = raw + self._model_override(decision.model)
            else:
                body = raw
            try:
                try:
                    response = await self.raw_infer(server)(
                        body, timeout=timeout_s or self.config.request_timeout_s)
                except grpc.aio.AioRpcError as exc:
                    if not unloaded_under(exc):
                        raise
                    server = await self.resend_after_unload(call)
                    response = await self.raw_infer(server)(
                        body, timeout=timeout_s or self.config.request_timeout_s)
            except grpc.aio.AioRpcError as exc:
                self._reraise(call, server, exc, asked)
            if decision.shadow:
                # Bytes as they are (re-addressed by an appended override): the shadow's
                # analysis thread parses the responses, the loop only sends.
                if version:  # the version asked of the primary means nothing to the shadow
                    request.model_name, request.model_version = decision.shadow, ""
                    if decision.adapter is not None:
                        request.parameters["adapter"].string_param = decision.adapter
                    shadow_body = request.SerializeToString()
                else:
                    shadow_body = raw + self._model_override(decision.shadow, decision.adapter)
                self.shadow.offer(ShadowItem(decision.logical.split(":", 1)[0], decision.shadow,
                                             shadow_body, response,
                                             (time.perf_counter() - call.start) * 1000))
            return response + self._response_suffix(asked, decision)

    async def _send_shadow(self, model: str, request: bytes, timeout_s: float) -> bytes:
        server = await self.server_for(model)
        return await self.raw_infer(server)(request, timeout=timeout_s)

