"""``ModelManager``: the only writer of what is loaded on which Triton server.

One object put together from the parts of this package (state.py says how they share
state); this module builds it and holds what belongs to no single part.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path

from control_plane.domain.errors import ControlPlaneError, InvalidInput
from control_plane.eviction import (
    DEFAULT_POLICY,
    DEFAULT_PRIORITY,
    CachePlanner,
    Capacity,
    HeadroomSpec,
    make_policy,
)
from control_plane.manager.catalog import Catalog
from control_plane.manager.leases import Leases
from control_plane.manager.loader import Loader
from control_plane.manager.pins import Pins
from control_plane.manager.placement import Placer
from control_plane.manager.reconciler import Reconciler
from control_plane.manager.records import (
    ManagerConfig,
    ModelRecord,
    ModelState,
    ServerSpec,
    Stager,
    TritonServer,
)
from control_plane.manager.room import RoomLedger
from control_plane.manager.unloader import Unloader
from control_plane.metrics import ControlPlaneMetrics
from control_plane.state.store import StateStore
from control_plane.triton.admin import TritonAdmin, TritonModelState
from control_plane.triton.devices import NoMemoryMeter
from control_plane.triton.process import TritonProcess


class ModelManager(Catalog, Leases, Loader, Unloader, Pins, Reconciler):
    """What is loaded on which Triton server: ``ensure``/``lease`` for requests,
    ``unload``/``pin``/``unpin`` for operators, ``step`` for the reconcile loop (run
    by the service through ``control_plane.domain.periodic``).  The rules it keeps are in the package docstring."""

    def __init__(
        self,
        servers: list[TritonServer],
        store: StateStore,
        repository: Path | None = None,
        config: ManagerConfig | None = None,
        metrics: ControlPlaneMetrics | None = None,
        clock: Callable[[], float] = time.time,
        stager: Stager | None = None,
        priority_of: Callable[[str], int] | None = None,
        placer: Placer | None = None,
        warmup_enabled: Callable[[str], bool] | None = None,
        memory=None,
        free_memory: Callable[[TritonServer], int | None] | None = None,
    ):
        if not servers:
            raise InvalidInput("the fleet needs at least one Triton server")
        self.servers = {s.name: s for s in servers}
        # Holds of models loaded for requests, per model, oldest first (Leases.ensure_for_request).
        self.request_holds: dict[str, list[asyncio.TimerHandle]] = {}
        self.store = store
        self.repository = repository
        self.config = config or ManagerConfig()
        self.metrics = metrics or ControlPlaneMetrics()
        self.clock = clock
        self.stager = stager
        # Rollout-stage eviction priority of a model (registry.stage_priority); SLA/tenant
        # aware placement (placement.Placer).  Defaults: one priority, filters without labels.
        self.priority_of = priority_of or (lambda _name: DEFAULT_PRIORITY)
        headroom = HeadroomSpec(self.config.headroom_models, self.config.headroom_bytes)
        for s in servers:
            s.planner.priority_of = self.priority_of  # a shadow never evicts serving models
            s.planner.headroom = headroom
        # Held room and the overlap rule; free_memory: measured free bytes of a server's
        # device (host_available_bytes on CPU), None: nothing overlaps.
        self.room = RoomLedger(self.config, free_memory)
        self.placer = placer or Placer()
        # Whether the synthetic warm-up may run for a model (the registry's per-model setting);
        # the model's own config can turn it off too (triton_admin.WARMUP_PARAMETER).
        self.warmup_enabled = warmup_enabled or (lambda _name: True)
        # Measures each load on a GPU and says when an unload's memory is back
        # (devices.GpuMemoryMeter); CPU servers: artifact sizes, nothing measured.
        self.memory = memory or NoMemoryMeter()
        self.records: dict[str, ModelRecord] = {}
        self.catalog: set[str] = set()
        self._lock = asyncio.Lock()
        self._loads: dict[str, asyncio.Task] = {}
        self._unloads: dict[str, asyncio.Task] = {}
        self._background: set[asyncio.Task] = set()
        self._load_listeners: list[Callable[[str, ModelRecord], None]] = []
        self._unknown: dict[str, float] = {}  # name -> when it was last found unknown
        self._pin_repairs: set[str] = set()  # pinned models the reconcile is loading
        self._pin_retry_at: dict[str, float] = {}  # monotonic; after a failed pin repair
        self._probes: dict[str, asyncio.Task] = {}  # server name -> liveness probe in flight
        pins = store.pins()
        for name, row in store.model_rows().items():
            rec = self._record(name)
            rec.last_used = row["last_used"]
            rec.load_time_s = row["load_time_s"]
            rec.memory_bytes = row["memory_bytes"] or 0
        for name in pins:
            self._record(name).pinned = True
        for s in servers:
            self.metrics.capacity_bytes.labels(s.name).set(s.spec.memory_budget_bytes or 0)

    @staticmethod
    def make_server(spec: ServerSpec, policy: str = DEFAULT_POLICY,
                    process: TritonProcess | None = None, admin: TritonAdmin | None = None):
        planner = CachePlanner(make_policy(policy), Capacity(spec.memory_budget_bytes, spec.max_loaded))
        return TritonServer(spec, admin or TritonAdmin(spec.grpc_url), planner, process)

    async def health(self, name: str, probe: bool = False) -> dict:
        rec = self.get(name)
        if probe and rec.state == ModelState.READY and rec.server:
            server = self.servers[rec.server]
            try:
                # A probe sends the synthetic request only to a model warmed up that way;
                # for the others it asks Triton whether the model is READY.
                result = await self._warm_up(server, name)
                if result["mode"] != "synthetic":
                    entry = (await server.admin.index()).get(name)
                    if entry is None or entry.state != TritonModelState.READY:
                        state = entry.state.value if entry is not None else "absent"
                        result = {**result, "ok": False,
                                  "error": f"Triton reports {name} {state or 'not loaded'}"}
                rec.warmup = result
            except ControlPlaneError as exc:
                rec.warmup = {"ok": False, "latency_ms": None, "checked_at": self.clock(),
                              "error": exc.message, "mode": "synthetic"}
        return {
            "model": name,
            "state": rec.state.value,
            "server": rec.server,
            "healthy": rec.healthy,
            "warmup": rec.warmup,
            "failure": rec.failure,
        }

    async def close(self) -> None:
        for task in list(self._background) + list(self._loads.values()) + list(self._unloads.values()):
            task.cancel()
        for server in self.servers.values():
            await server.admin.close()
