"""The data plane core: resolve, rate-limit, ensure, forward, record.  Transport-free.

The gRPC and HTTP front ends only convert wire messages and call into ``Router``.  Where
models live comes from a state source (``router.serving.serving_state``): the manager of this
process, or a router worker's snapshot of the control plane.  A request for a loaded model
pays no remote call besides the one to Triton; a miss asks the control plane to load it.
Nothing here holds a lease on a model: Triton finishes in-flight requests before it
unloads, and a request that meets a model unloaded under it is sent again once, after an
ensure, without the client seeing it.

``Router`` is put together from one mixin per role:

* ``router.serving.decide``: the routing decision (names, adapters, routes, rate limits);
* ``router.serving.send``: serving one request, sending it to Triton and every retry of a send;
* ``router.serving.forward``: ModelInfer, typed and on raw bytes, re-addressed and answered under
  the name the client asked for;
* ``router.serving.answers``: readiness, metadata, config and statistics;
* ``router.serving.metrics``: the Prometheus series and the recording of outcomes.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
from tritonclient.grpc import service_pb2_grpc

from control_plane.domain.periodic import run_periodically
from router.frontends.shared_memory import SystemSharedMemory
from router.rollouts.canary import CanaryController
from router.rollouts.limits import LocalLimiter
from router.rollouts.public_names import PublicNames
from router.rollouts.routes import RouteTable
from router.rollouts.shadow import ShadowMirror
from router.rollouts.stats import StatsBook
from router.serving.answers import Answers
from router.serving.decide import Deciding
from router.serving.forward import Forwarding
from router.serving.metrics import LATENCY_BUCKETS_S, Recording, RouterMetrics
from router.serving.repository_config import FolderConfig
from router.serving.send import (
    GRPC_MESSAGE_LIMIT_BYTES,
    INFER_METHOD,
    Call,
    Sending,
    unloaded_under,
)
from router.serving.serving_state import LocalState, ServingState

# Names other modules import from here since before the mixins had modules of their own.
__all__ = ["GRPC_MESSAGE_LIMIT_BYTES", "INFER_METHOD", "LATENCY_BUCKETS_S", "Call", "Router",
           "RouterConfig", "RouterMetrics", "unloaded_under"]


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
    # Shared-memory registrations, shared by the router workers of one host (None: this
    # process's own, in a temporary directory).
    shared_memory_dir: Path | None = None


class Router(Forwarding, Sending, Deciding, Answers, Recording):
    def __init__(self, state, table: RouteTable, config: RouterConfig | None = None,
                 metrics: RouterMetrics | None = None, rng: random.Random | None = None,
                 names: PublicNames | None = None, families=None):
        """``state``: a ServingState, or the control plane's ModelManager in this process.
        ``names``: the registry's public names (None: every name is served as it is, with
        Triton's own versions)."""
        if hasattr(state, "ready_server"):
            self.state: ServingState = state
            self.manager = None
        else:
            self.state = LocalState(state, families)
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
        self.shared_memory = SystemSharedMemory(self.config.shared_memory_dir)

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
        self.shared_memory.close()

    async def _canary_loop(self) -> None:
        await run_periodically("canary", lambda: self.canaries.step(), self.config.canary_interval_s,
                               self.metrics.loop_failures)
