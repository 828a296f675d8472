"""The router assembled: ``Router`` builds its parts from the three rooms of ``router/``
(``frontends``: the public ports and their codecs; ``serving``: the inference pipeline,
sending to Triton, the state it serves from; ``rollouts``: routing decisions, rate limits,
shadows) and wires each with what it needs.  The router worker (``router.worker``)
and mmctl's in-process router build one.

The gRPC and HTTP front ends only convert wire messages and call into ``Router``.  Where
models live comes from a state source (``router.serving.serving_state``): the manager of this
process, or a router worker's snapshot of the control plane.  A request for a loaded model
pays no remote call besides the one to Triton; a miss asks the control plane to load it.
Nothing here holds a lease on a model: Triton finishes in-flight requests before it
unloads, and a request that meets a model unloaded under it is sent again once, after an
ensure, without the client seeing it.

``Router`` is a composition of collaborators, each constructed with what it needs and
testable alone; a reader follows ``router.x.y`` to the owner:

* ``decider`` (``router.rollouts.routing_decisions.Decider``): the routing decision; owns the route
  table, the registry's public names and the rate limiter;
* ``recording`` (``router.serving.metrics.Recording``): the Prometheus series and the
  outcomes of experiment and canary requests, handed to the statistics it is given;
* ``channels`` (``router.serving.triton_channels.Channels``): one gRPC channel per Triton server;
* ``sender`` (``router.serving.ensure_and_resend.Sender``): serving one request, sending it to Triton and
  every retry of a send; given the decider, the channels and the recording;
* ``shadow`` (``router.rollouts.shadow.ShadowMirror``): mirrors, sent through the sender;
* ``pipeline`` (``router.serving.inference_pipeline.InferencePipeline``): one inference,
  whatever the transport: addressing, routing, ensure, send with resends, renaming, shadow;
  given the state, the decider, the sender and the shadow;
* ``forwarder`` (``router.frontends.grpc_inference.Forwarder``): ModelInfer, typed and on
  raw bytes, as codecs around the pipeline; HTTP's codec is
  ``router.frontends.http_inference``;
* ``answers`` (``router.serving.readiness_and_metadata.Answers``): readiness, metadata, config and
  statistics; given the state, the decider and the channels.

The front ends call the collaborator that owns a call (``router.forwarder.infer``,
``router.answers.model_call``, ``router.pipeline``).  Canary statistics and their
judgement are the control plane's: its service gives an in-process router a statistics
book (``stats``) and a canary controller (``canaries``, stepped here every
``canary_interval_s``); a router worker gets neither and reports its outcomes to the
control plane (``router.serving.outcomes``).
"""

from __future__ import annotations

import asyncio

from domain.periodic import run_periodically
from domain.public_names import PublicNames
from domain.routes import RouteTable
from router.frontends.grpc_inference import Forwarder
from router.frontends.shared_memory import SystemSharedMemory
from router.rollouts.limits import LocalLimiter
from router.rollouts.routing_decisions import Decider, Limiter
from router.rollouts.shadow import ShadowMirror
from router.serving.ensure_and_resend import Sender
from router.serving.inference_pipeline import InferencePipeline
from router.serving.metrics import Recording, RouterMetrics
from router.serving.outcomes import CanaryJudge, OutcomeSink
from router.serving.readiness_and_metadata import Answers
from router.serving.router_config import RouterConfig
from router.serving.serving_state import LocalState, ServingState
from router.serving.triton_channels import Channels

# RouterConfig is the Router's own settings: imported from here with it.
__all__ = ["Router", "RouterConfig"]


class Router:
    def __init__(self, state, table: RouteTable, config: RouterConfig | None = None,
                 metrics: RouterMetrics | None = None, names: PublicNames | None = None,
                 families=None, stats: OutcomeSink | None = None,
                 canaries: CanaryJudge | None = None, limiter: Limiter | None = None,
                 share_weights=None):
        """``state``: a ServingState, or the control plane's ModelManager in this process.
        ``names``: the registry's public names (None: every name is served as it is, with
        Triton's own versions).  ``stats``: where the outcomes of experiment and canary
        requests go (None: nowhere).  ``canaries``: judged every ``canary_interval_s``
        (None: elsewhere, or nowhere).  ``limiter``: the rate limits (None: this process's
        token buckets, ``LocalLimiter``).  ``share_weights()``: model -> fair-share weight, for
        a router beside the control plane's manager (a worker reads them from its snapshot)."""
        if hasattr(state, "ready_server"):
            self.state: ServingState = state
            self.manager = None
        else:
            self.state = LocalState(state, families, share_weights)
            self.manager = state
        self.config = config or RouterConfig()
        self.metrics = metrics or RouterMetrics()
        # What the creator gave: the control plane's admin routes read and reset them here.
        self.stats = stats
        self.canaries = canaries
        if limiter is None:
            limiter = LocalLimiter(lambda: self.decider.table.limits,
                                   on_limited=lambda name: self.metrics.rate_limited.labels(name).inc())
        self.decider = Decider(table, names, limiter)
        self.recording = Recording(self.metrics, stats)
        self.channels = Channels()
        self.sender = Sender(self.state, self.decider, self.channels, self.recording, self.metrics,
                             self.config)
        self.shadow = ShadowMirror(self.sender.send_shadow, self.config.shadow_log_dir,
                                   self.config.shadow_queue_size, self.config.shadow_workers,
                                   self.config.shadow_timeout_s, self.metrics,
                                   primary_inflight=lambda: self.sender.inflight)
        self.shared_memory = SystemSharedMemory(self.config.shared_memory_dir)
        self.pipeline = InferencePipeline(self.state, self.decider, self.sender, self.shadow)
        self.forwarder = Forwarder(self.state, self.decider, self.sender, self.shadow,
                                   self.shared_memory, self.pipeline)
        self.answers = Answers(self.state, self.decider, self.channels)
        self._canary_task: asyncio.Task | None = None

    # A router worker serves each new snapshot's table and names (router.worker).
    @property
    def table(self) -> RouteTable:
        return self.decider.table

    @table.setter
    def table(self, table: RouteTable) -> None:
        self.decider.table = table

    @property
    def names(self) -> PublicNames | None:
        return self.decider.names

    @names.setter
    def names(self, names: PublicNames | None) -> None:
        self.decider.names = names

    async def start(self) -> None:
        self.shadow.start()
        if self.canaries is not None and self.config.canary_interval_s > 0:
            self._canary_task = asyncio.get_running_loop().create_task(self._canary_loop())

    async def gather_reports(self) -> bool:
        """In one process every outcome is counted as it is answered: nothing to gather
        (``control_plane.admin.dataplane.DataPlaneHub.gather_reports`` for workers)."""
        return True

    async def stop(self) -> None:
        if self._canary_task:
            self._canary_task.cancel()
        await self.shadow.stop()
        await self.channels.close()
        self.shared_memory.close()

    async def _canary_loop(self) -> None:
        canaries = self.canaries
        await run_periodically("canary", lambda: canaries.step(), self.config.canary_interval_s,
                               self.metrics.loop_failures)
