"""``ModelManager``: the only writer of what is loaded on which Triton server.

It builds the parts of this package, wires each to the parts it calls (fleet_state.py), and
holds what belongs to no single part: health and close.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path

from control_plane.eviction import (
    DEFAULT_POLICY,
    DEFAULT_PRIORITY,
    EXTRA_COPY_PRIORITY,
    CachePlanner,
    Capacity,
    HeadroomSpec,
    make_policy,
)
from control_plane.manager.copies import Copies
from control_plane.manager.executor import Executor
from control_plane.manager.fleet_state import ManagerState
from control_plane.manager.known_models import Catalog
from control_plane.manager.leases import Leases
from control_plane.manager.loader import Loader
from control_plane.manager.manager_config import ManagerConfig
from control_plane.manager.pins import Pins
from control_plane.manager.placement import Placer
from control_plane.manager.recency import Recency
from control_plane.manager.reconciler import Reconciler
from control_plane.manager.records import (
    CopyKey,
    ModelRecord,
    ModelState,
    ServerSpec,
    Stager,
    TritonServer,
)
from control_plane.manager.room import RoomLedger
from control_plane.manager.unloader import Unloader
from control_plane.metrics import ControlPlaneMetrics
from control_plane.state.state_store import StateStore
from control_plane.triton.admin import TritonAdmin, TritonModelState
from control_plane.triton.devices import NoMemoryMeter
from control_plane.triton.process import TritonProcess
from domain.errors import ControlPlaneError, InvalidInput
from domain.names import validate_model_name
from domain.routes import AdapterKey


class ModelManager:
    """What is loaded on which Triton server: ``ensure``/``lease`` for requests,
    ``unload``/``pin``/``unpin`` for operators, ``step`` for the reconcile loop (run
    by the service through ``domain.periodic``).  The rules it keeps are in
    the package docstring.

    It owns one ``ManagerState`` and one object per part, each given the parts it calls:

    * ``catalog``: which models exist, their records, the fleet;
    * ``recency``: when each model was last used;
    * ``unloader``: unloads (explicit, evictions, headroom, down to the budget);
    * ``loader``: loads (placement and reservation, room, warm-up), evicting through the
      unloader;
    * ``pins``: pinned models stay loaded, through the loader;
    * ``reconciler``: each pass corrects what drifted from Triton's indexes; it owns
      ``health`` (``reconciler.health``), the one writer of each server's health, whose
      probes run beside the passes;
    * ``leases``: requests holding models, through the loader and the reconciler;
    * ``copies``: a model's copies on several servers (``mmctl scale``), through the loader
      and the unloader; the reconciler runs it after each pass; ``load_of()`` says the
      requests outstanding per model over every router (what ``--replicas auto`` follows).

    Its own methods are the product's API of the manager and say which part answers."""

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
        load_of: Callable[[], dict[str, int]] = dict,
        adapters: Callable[[ModelManager], object] | None = None,
    ):
        if not servers:
            raise InvalidInput("the fleet needs at least one Triton server")
        config = config or ManagerConfig()
        metrics = metrics or ControlPlaneMetrics()
        # Rollout-stage eviction priority of a model (registry.stage_priority); SLA/tenant
        # aware placement (placement.Placer).  Defaults: one priority, filters without labels.
        stage_priority = priority_of or (lambda _name: DEFAULT_PRIORITY)

        def priority_of(key: str) -> int:
            """A planner key's priority: an extra copy's is the lowest (copies.py)."""
            return EXTRA_COPY_PRIORITY if isinstance(key, CopyKey) else stage_priority(key)

        headroom = HeadroomSpec(config.headroom_models, config.headroom_bytes)
        for s in servers:
            s.planner.priority_of = priority_of  # a shadow never evicts serving models
            s.planner.headroom = headroom
        self.state = ManagerState(
            servers={s.name: s for s in servers}, store=store, repository=repository,
            config=config, metrics=metrics, clock=clock, stager=stager, priority_of=priority_of,
            placer=placer or Placer(),
            # Whether the synthetic warm-up may run for a model (the registry's per-model
            # setting); the model's own config can turn it off too (WARMUP_PARAMETER).
            warmup_enabled=warmup_enabled or (lambda _name: True),
            # Measures each load on a GPU and says when an unload's memory is back
            # (GpuMemoryMeter); CPU servers: artifact sizes, nothing measured.
            memory=memory or NoMemoryMeter(),
            # Held room and the overlap rule; free_memory: measured free bytes of a server's
            # device (host_available_bytes on CPU), None: nothing overlaps.
            room=RoomLedger(config, free_memory),
        )
        st = self.state
        # Each part gets what it uses, and the parts it calls.
        self.catalog = Catalog(st.book, st.servers, stager, repository, st.memory)
        self.recency = Recency(st.book, st.servers, clock)
        self.executor = Executor(st.book, st.tasks, st.keeping, config, clock, st.room,
                                 st.warmup_enabled, st.memory)
        self.unloader = Unloader(st.book, st.servers, st.tasks, st.keeping, config, self.executor)
        self.loader = Loader(st.book, st.servers, st.tasks, st.keeping, config, clock, stager,
                             st.placer, priority_of, st.room, self.catalog, self.recency,
                             self.unloader, self.executor)
        self.pins = Pins(st.book, st.tasks, store, config, self.catalog, self.loader)
        self.copies = Copies(st.book, st.servers, st.tasks, st.keeping, config, store,
                             self.catalog, st.placer, self.loader, self.executor, load_of)
        self.reconciler = Reconciler(st.book, st.servers, st.tasks, st.keeping, config, clock,
                                     self.catalog, self.recency, self.unloader, self.pins,
                                     self.copies)
        self.leases = Leases(st.book, config, self.catalog, self.recency, self.loader,
                             check_reachable=self.reconciler.check_reachable,
                             place_off_down=self.reconciler.place_off_down)
        for name, row in store.model_rows().items():
            rec = self.state.book.record(name)
            rec.last_used = row["last_used"]
            rec.load_time_s = row["load_time_s"]
            rec.memory_bytes = row["memory_bytes"] or 0
        for name in store.pins():
            self.state.book.record(name).set_pinned(True)
        for s in servers:
            metrics.capacity_bytes.labels(s.name).set(s.spec.memory_budget_bytes or 0)
        # LoRA adapters: entries named BASE:ADAPTER in the adapter slots of their base, placed
        # by the part ``adapters`` builds with this manager, last (it reads the manager's
        # config and book; control_plane.adapters.slots.AdapterSlots, a layer above this
        # package, which knows LoRA bases); the manager's API answers for them too.
        self.adapters = adapters(self) if adapters is not None else None

    # What the parts share, read by the service, the admin API and the in-process router.
    @property
    def servers(self) -> dict[str, TritonServer]:
        return self.state.servers

    @property
    def records(self) -> dict[str, ModelRecord]:
        return self.state.book.records

    @property
    def store(self) -> StateStore:
        return self.state.store

    @property
    def repository(self) -> Path | None:
        return self.state.repository

    @property
    def config(self) -> ManagerConfig:
        return self.state.config

    @property
    def metrics(self) -> ControlPlaneMetrics:
        return self.state.metrics

    @property
    def room(self) -> RoomLedger:
        return self.state.room

    # Catalog.
    def get(self, name: str) -> ModelRecord:
        return self.catalog.get(name)

    def status(self) -> list[dict]:
        return [self.copies.row(rec) for rec in self.catalog.find()[0]]

    def fleet(self) -> list[dict]:
        return self.catalog.fleet()

    def ready_server_of(self, name: str) -> TritonServer | None:
        if (key := self._adapter_key(name)) is not None:
            return self.adapters.ready_server_of(key)
        return self.catalog.ready_server_of(name)

    def copy_servers_of(self, name: str) -> list[str]:
        """The servers ``name`` is READY on: its own copy's first (empty when it is not)."""
        if (key := self._adapter_key(name)) is not None:
            return self.adapters.copy_servers_of(key)
        return self.copies.servers_of(name)

    def _adapter_key(self, name: str) -> AdapterKey | None:
        """``name``'s key when it names an adapter of a LoRA base (``BASE:ADAPTER``) and this
        manager serves adapters (``adapters``); None for a model's name.  A request's name is
        parsed here once; the adapters' part reads the key's parts."""
        return AdapterKey.parse(name) if self.adapters is not None else None

    def announce_moved(self, name: str) -> None:
        """Tell the state-change listeners that where ``name`` is READY may have changed
        (an adapter entry: its base's slots changed)."""
        for listener in self.state.book.move_listeners:
            listener(name)

    def status_row(self, rec: ModelRecord) -> dict:
        """``rec`` as ``mmctl status`` shows it, its copies included."""
        return self.copies.row(rec)

    def on_loaded(self, listener: Callable[[str, ModelRecord], None]) -> None:
        self.catalog.on_loaded(listener)

    def on_state_change(self, listener: Callable[[str], None]) -> None:
        """``listener(name)`` after each change of a model's state (where it is READY may
        have changed with it)."""
        self.state.book.move_listeners.append(listener)

    async def known(self, name: str) -> None:
        await self.catalog.known(name)

    # Requests.
    async def ensure(self, name: str, retry_failed: bool = False) -> ModelRecord:
        validate_model_name(name)
        return await self.loader.ensure(name, retry_failed)

    def touch(self, name: str) -> None:
        if (key := self._adapter_key(name)) is not None:
            self.adapters.touch(key)
            return
        self.recency.touch(name)

    def lease(self, name: str):
        return self.leases.lease(name)

    async def ensure_for_request(self, name: str, unreachable: str | None = None,
                                 owner: str | None = None) -> TritonServer:
        """``owner``: the router worker asking (``Leases.ensure_for_request``)."""
        if (key := self._adapter_key(name)) is not None:
            return await self.adapters.ensure_for_request(key, unreachable, owner=owner)
        return await self.leases.ensure_for_request(name, unreachable, owner=owner)

    def requests_answered(self, name: str, count: int = 1, owner: str | None = None) -> int:
        if (key := self._adapter_key(name)) is not None:
            return self.adapters.requests_answered(key, count, owner=owner)
        return self.leases.requests_answered(name, count, owner=owner)

    async def acquire(self, name: str) -> ModelRecord:
        return await self.leases.acquire(name)

    def release(self, rec: ModelRecord) -> None:
        self.leases.release(rec)

    # What others tell the manager (it stays the only writer of its records and planners).
    def set_priority(self, name: str, priority: int) -> None:
        """``name``'s rollout stage changed: its eviction priority on the server that holds
        it (a loaded shadow promoted to production stops being the first to go)."""
        self.state.residency.set_priority(name, priority)

    def correct_size(self, name: str, size_bytes: int) -> None:
        """The memory ``name`` holds on its server, as measured (the GPU memory pass)."""
        rec = self.state.book.records.get(name)
        if rec is not None and rec.state == ModelState.READY:
            rec.resize(size_bytes)

    def not_use(self, name: str, until_ms: int) -> None:
        """Inferences Triton counted for ``name`` up to ``until_ms`` (epoch ms) were control
        requests, not use: recency read from Triton's statistics skips them."""
        rec = self.state.book.records.get(name)
        if rec is not None:
            rec.last_inference_ms = max(rec.last_inference_ms, until_ms)

    # Operators.
    async def unload(self, name: str, force: bool = False) -> ModelRecord:
        return await self.unloader.unload(self.catalog.get(name), force)

    async def pin(self, name: str) -> ModelRecord:
        return await self.pins.pin(name)

    async def unpin(self, name: str) -> ModelRecord:
        return await self.pins.unpin(name)

    async def scale(self, name: str, replicas: object, minimum: object = None,
                    maximum: object = None) -> ModelRecord:
        return await self.copies.scale(name, replicas, minimum, maximum)

    # The reconcile loop.
    async def start(self) -> None:
        await self.reconciler.start()

    async def step(self) -> None:
        await self.reconciler.step()

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
                result = await self.loader.warm_up(server, name)
                if result["mode"] != "synthetic":
                    entry = (await server.admin.index()).get(name)
                    if entry is None or entry.state != TritonModelState.READY:
                        state = entry.state.value if entry is not None else "absent"
                        result = {**result, "ok": False,
                                  "error": f"Triton reports {name} {state or 'not loaded'}"}
                rec.warmup = result
            except ControlPlaneError as exc:
                rec.warmup = {"ok": False, "latency_ms": None, "checked_at": self.state.clock(),
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
        tasks = self.state.tasks
        for task in [*tasks.loops, *tasks.background, *tasks.loads.values(), *tasks.unloads.values()]:
            task.cancel()
        self.reconciler.health.close()
        rows = self.state.keeping.write_rows()  # the history rows due: none is lost
        if rows is not None:
            await asyncio.wait({rows})  # a failure is logged by write_rows
        for server in self.servers.values():
            await server.admin.close()
