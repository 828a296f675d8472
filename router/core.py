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
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import NoReturn

import grpc
from google.protobuf.message import DecodeError
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from tritonclient.grpc import service_pb2, service_pb2_grpc

from control_plane import errors as cp
from control_plane.errors import ControlPlaneError
from control_plane.manager import ModelManager, TritonServer

from .canary import CanaryController
from .errors import (
    BackendUnavailable,
    InvalidRequest,
    ModelUnavailable,
    PermissionDenied,
    RateLimited,
    RequestTimeout,
    RouterError,
    UnknownModel,
    UpstreamError,
    from_control_plane,
    parse_version,
)
from .public_names import PublicNames
from .ratelimit import TokenBucket
from .repository_config import FolderConfig, metadata_from_config, read_folder
from .routes import ADAPTER_SEPARATOR, Decision, RouteTable, split_adapter
from .shadow import ShadowItem, ShadowMirror, outputs_of
from .stats import StatsBook

log = logging.getLogger(__name__)

LATENCY_BUCKETS_S = (0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
                     1, 2.5, 5, 10, 30)
GRPC_MESSAGE_LIMIT_BYTES = 64 * 1024 * 1024
INFER_METHOD = "/inference.GRPCInferenceService/ModelInfer"
BYTES_CACHE_MAX = 4096
CONFIG_CACHE_S = 5.0  # how long a model's config.pbtxt, read for a cold model, is reused


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
        self.inflight = Gauge("mmr_inflight_requests", "Requests in flight", registry=r)


class Router:
    def __init__(self, manager: ModelManager, table: RouteTable, config: RouterConfig | None = None,
                 metrics: RouterMetrics | None = None, rng: random.Random | None = None,
                 names: PublicNames | None = None):
        """``names``: the registry's public names (None: every name is served as it is, with
        Triton's own versions)."""
        self.manager = manager
        self.table = table
        self.names = names
        self.config = config or RouterConfig()
        self.metrics = metrics or RouterMetrics()
        self.stats = StatsBook(clock=time.time)
        self.canaries = CanaryController(table, self.stats)
        self.rng = rng or random.Random()
        self._buckets: dict[str, tuple[dict, TokenBucket]] = {}
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

    def decide(self, logical: str, user_id: str | None, version: str = "") -> Decision:
        """Route one request (``version``: parsed with ``parse_version``) and apply the rate
        limits of the name and of the model it reaches."""
        if version:
            decision = self._resolve(logical, user_id, version)
        else:  # the common case, inline: no version, route by name
            try:
                decision = self.table.resolve(logical, user_id)
            except cp.InvalidModelName as exc:
                raise self._invalid_name(logical, exc) from None
            except ControlPlaneError as exc:
                raise from_control_plane(exc) from exc
        if decision.model == logical:
            self.check_limits(logical)
        else:
            self.check_limits(logical, decision.model)
        return decision

    async def server_for(self, model: str, asked: str | None = None) -> TritonServer:
        """The server with ``model`` READY; waits (bounded) for a load on a miss.

        Only for a model known to exist (its lease was acquired): the wait is counted per
        model.  Errors name ``asked``, the model as the client knows it."""
        server = self.manager.ready_server_of(model)
        if server is not None:
            return server
        asked = asked or model
        self.metrics.cold_waits.labels(model).inc()
        start = time.perf_counter()
        try:
            await asyncio.wait_for(asyncio.shield(self.manager.ensure(model)), self.config.load_timeout_s)
        except TimeoutError:
            raise RequestTimeout(f"'{asked}' did not finish loading within {self.config.load_timeout_s:.0f}s; "
                                 "the load goes on, retry shortly") from None
        except ControlPlaneError as exc:
            raise self._serving_error(exc, asked) from exc
        finally:
            self.metrics.cold_wait_seconds.labels(model).observe(time.perf_counter() - start)
        server = self.manager.ready_server_of(model)
        if server is None:
            raise BackendUnavailable(f"'{asked}' was unloaded before the request could be sent; retry")
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
        """Decide, rate-limit, ensure and lease for one request; record it when done.

        ``version``: the client's model version, already checked with ``parse_version``.
        The body sets ``call.code`` to the outcome ("OK" or a status name)."""
        start = time.perf_counter()
        decision = self.decide(logical, user_id, version)
        call = Call(decision, start)
        rec = None
        sent = False
        self.metrics.inflight.inc()
        self.inflight += 1
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
                    raise self._serving_error(exc, decision.logical) from exc
            call.server = await self.server_for(decision.model, decision.logical)
            call.ready_at = time.perf_counter()
            self.manager.touch(decision.model)
            rec.active += 1  # sent to Triton: an unload drains these
            sent = True
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
            if sent:
                rec.active -= 1
            if rec is not None:
                self.manager.release(rec)
            self.metrics.inflight.dec()
            self.inflight -= 1
            end = time.perf_counter()
            # Names that turned out unknown get no series of their own (label cardinality).
            self.record(decision, end - start, call.code, known=rec is not None,
                        served_s=None if call.ready_at is None else end - call.ready_at)

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
    def _reraise(cls, call: Call, server: TritonServer, exc: grpc.aio.AioRpcError, asked: str) -> NoReturn:
        """Triton's own answer (shape, dtype, ...) passes on with its code, about the model
        the client asked for; a Triton that is down says so."""
        call.code = exc.code().name
        if exc.code() == grpc.StatusCode.UNAVAILABLE:
            raise BackendUnavailable(
                f"Triton {server.name} at {server.spec.grpc_url} is unavailable "
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

    # ------------------------------------------------------------------ describe (never loads)
    def describe(self, asked: str, version: str = "", statistics: bool = False) -> Decision:
        """What readiness, metadata, config and statistics of ``asked`` (at ``version``,
        parsed) answer about.  Unknown names raise Triton's answer for the call."""
        try:
            if version:
                return self._resolve(asked, None, version)
            return self.decide_without_limits(asked)
        except UnknownModel as exc:
            raise (exc.for_statistics() if statistics else exc) from None

    async def model_call(self, asked: str, method: str, version: str = ""):
        """Metadata / config / statistics of ``asked`` as Triton answers them, under the name
        and version the client asked for.  A model that is not loaded is not loaded for this:
        its metadata and config come from its config.pbtxt, its statistics are Triton's
        answer for a model it has not loaded."""
        version = parse_version(version)
        target = self.describe(asked, version, statistics=method == "statistics")
        server = self.manager.ready_server_of(target.model)
        if server is None:
            if method == "statistics":
                raise ModelUnavailable(asked)
            return await self.cold_answer(asked, method, target)
        stub = self.stub(server)
        _model, public_version = self.public_identity(target)
        try:
            if method == "metadata":
                resp = await stub.ModelMetadata(service_pb2.ModelMetadataRequest(
                    name=target.model, version=target.version))
                resp.name = asked
                if public_version is not None:
                    resp.versions[:] = [public_version]
            elif method == "config":
                resp = await stub.ModelConfig(service_pb2.ModelConfigRequest(
                    name=target.model, version=target.version))
                resp.config.name = asked
            else:
                resp = await stub.ModelStatistics(service_pb2.ModelStatisticsRequest(
                    name=target.model, version=target.version))
                for stats in resp.model_stats:
                    stats.name = asked
                    if public_version is not None:
                        stats.version = public_version
        except grpc.aio.AioRpcError as exc:
            raise UpstreamError(exc.code(), self.public_text(exc.details() or "", target.model, asked)) from exc
        return resp

    async def all_statistics(self) -> service_pb2.ModelStatisticsResponse:
        """Statistics of every loaded model a client may name (Triton's answer when no model
        is named), under its public name and version."""
        out = service_pb2.ModelStatisticsResponse()
        for server in list(self.manager.servers.values()):
            try:
                resp = await self.stub(server).ModelStatistics(service_pb2.ModelStatisticsRequest())
            except grpc.aio.AioRpcError as exc:
                log.debug("statistics of %s: %s", server.name, exc.details())
                continue
            for stats in resp.model_stats:
                public = self.names.public.get(stats.name) if self.names is not None else None
                if public is not None:
                    stats.name, stats.version = public
                elif self.names is not None and not self.names.expose_concrete:
                    continue  # an internal model
                out.model_stats.append(stats)
        return out

    async def cold_answer(self, asked: str, method: str, target: Decision):
        """Metadata or config of a model that is not loaded, from its repository folder."""
        found = await self._folder_config(target.model)
        if found is None:  # no config Triton could load: Triton's answer for an unloaded model
            raise UnknownModel(asked)
        _model, public_version = self.public_identity(target)
        if method == "metadata":
            versions = [public_version] if public_version is not None else list(found.versions[-1:])
            return metadata_from_config(found.config, asked, versions)
        response = service_pb2.ModelConfigResponse()
        response.config.CopyFrom(found.config)
        response.config.name = asked
        return response

    async def _folder_config(self, concrete: str) -> FolderConfig | None:
        """The model's config.pbtxt, read in a thread and kept for a few seconds (a burst
        of metadata calls reads the file once)."""
        cached = self._configs.get(concrete)
        now = time.monotonic()
        if cached is not None and now - cached[0] < CONFIG_CACHE_S:
            return cached[1]
        repository = self.manager.repository
        if repository is None:
            return None
        found = await asyncio.to_thread(read_folder, repository / concrete)
        if len(self._configs) >= BYTES_CACHE_MAX:
            self._configs.clear()
        self._configs[concrete] = (now, found)
        return found

    def _resolve(self, name: str, user_id: str | None, version: str = "",
                 primary: bool = False) -> Decision:
        """The decision for ``name`` (``primary``: the deterministic one that readiness and
        metadata describe).  A name clients may not use, or an invalid one, is an unknown
        model, in Triton's words."""
        try:
            if version:
                return self._versioned(name, version)
            if primary:
                return Decision(name, self.table.primary(name), "default", scope=f"model:{name}")
            return self.table.resolve(name, user_id)
        except cp.InvalidModelName as exc:
            raise self._invalid_name(name, exc) from None
        except ControlPlaneError as exc:
            raise from_control_plane(exc) from exc

    @staticmethod
    def _invalid_name(name: str, exc: cp.InvalidModelName) -> RouterError:
        """A name that cannot be a model: Triton's unknown model.  A malformed ``base:adapter``
        (the router's own syntax, no Triton answer to copy) says how to write it."""
        if ADAPTER_SEPARATOR in name:
            return from_control_plane(exc)
        return UnknownModel(name)

    def _versioned(self, name: str, version: str) -> Decision:
        """``name`` at registry version ``version``: that version's concrete model, outside
        experiments and canaries (the client chose it).  A route that is not a registry
        model has the version of what it serves."""
        base, adapter = split_adapter(name) if ADAPTER_SEPARATOR in name else (name, None)
        names = self.names
        if names is None:  # no registry: Triton's own versions
            return replace(self.table.resolve(name, None), version=version)
        concrete = names.by_version.get((base, version))
        if concrete is None:
            if base in self.table.routes:
                concrete = self.table.primary(base)
                if names.public.get(concrete, ("", ""))[1] != version:
                    raise UnknownModel(base, version)
            elif base in names.models:
                raise UnknownModel(base, version)
            elif names.expose_concrete:
                return replace(self.table.resolve(name, None), version=version)
            else:
                raise UnknownModel(base)
        return Decision(name, concrete, "default", scope=f"model:{name}", adapter=adapter)

    def decide_without_limits(self, logical: str) -> Decision:
        """What ``logical`` is answered by for readiness, metadata and health checks."""
        return self._resolve(logical, None, primary=True)

    def public_identity(self, decision: Decision) -> tuple[str, str | None]:
        """(model, version) by which a client knows the concrete model that served it: the
        registry's model and version when the client asked for a logical name; the concrete
        name and None (Triton's own version stands) for an exposed concrete name."""
        names = self.names
        if names is not None and not decision.version:
            base = decision.logical.partition(ADAPTER_SEPARATOR)[0]
            if base in names.models or base in self.table.routes:
                found = names.public.get(decision.model)
                if found is not None:
                    return found
        return decision.model, None

    @staticmethod
    def public_text(text: str, concrete: str, asked: str) -> str:
        """Triton's message about ``concrete`` as one about the model the client asked for
        (Triton quotes model names: 'simple.v2')."""
        if concrete == asked:
            return text
        return text.replace(f"'{concrete}'", f"'{asked}'")

    def model_ready(self, asked: str, version: str = "") -> bool:
        """Ready = what ``asked`` is served by is loaded now; readiness never loads a model.
        Unknown names and versions are not ready (Triton's answer); a version that is not
        a number is refused (InvalidVersion)."""
        version = parse_version(version)
        try:
            target = self.describe(asked, version)
        except RouterError:
            return False
        return self.manager.ready_server_of(target.model) is not None

    def any_server_up(self) -> bool:
        return any(s.up for s in self.manager.servers.values())
