"""The state every part of the model manager shares, and the helpers they all use.

``ModelManager`` (core.py) is one object put together from parts, one module each:
catalog (what exists), leases (requests holding models, recency), loader, unloader,
pins, reconciler.  Each part is a class over this state; they call one another through
``self`` (a load unloads its victims, a reconcile pass loads pinned models), so the
locking rules of the package docstring hold across them.  ``ModelManager.__init__``
sets every attribute declared here.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from pathlib import Path

from control_plane.manager.placement import Placer
from control_plane.manager.records import (
    ManagerConfig,
    ModelRecord,
    ModelState,
    Stager,
    TritonServer,
)
from control_plane.manager.room import RoomLedger
from control_plane.metrics import ControlPlaneMetrics
from control_plane.state.store import StateStore
from control_plane.triton.devices import GpuMemoryMeter, NoMemoryMeter

log = logging.getLogger(__name__)


class ManagerState:
    servers: dict[str, TritonServer]
    store: StateStore
    repository: Path | None
    config: ManagerConfig
    metrics: ControlPlaneMetrics
    clock: Callable[[], float]
    stager: Stager | None
    priority_of: Callable[[str], int]
    placer: Placer
    warmup_enabled: Callable[[str], bool]
    memory: GpuMemoryMeter | NoMemoryMeter
    room: RoomLedger
    records: dict[str, ModelRecord]
    catalog: set[str]
    # Held with no ``await`` between placement and reservation (package docstring).
    _lock: asyncio.Lock
    _loads: dict[str, asyncio.Task]  # one load task per model; late callers await it
    _unloads: dict[str, asyncio.Task]  # one unload task per model
    _background: set[asyncio.Task]
    _load_listeners: list[Callable[[str, ModelRecord], None]]
    _unknown: dict[str, float]  # name -> when it was last found unknown
    _pin_repairs: set[str]  # pinned models the reconcile is loading
    _pin_retry_at: dict[str, float]  # monotonic; after a failed pin repair
    _probes: dict[str, asyncio.Task]  # server name -> liveness probe a request asked for

    def _record(self, name: str) -> ModelRecord:
        rec = self.records.get(name)
        if rec is None:
            rec = self.records[name] = ModelRecord(name, on_illegal=self._count_illegal)
        return rec

    def _count_illegal(self, was: ModelState, to: ModelState) -> None:
        self.metrics.illegal_transitions.labels(was.value, to.value).inc()

    def _release_warm(self, name: str) -> None:
        """The warm tier may drop ``name`` again (it is neither loaded nor loading)."""
        if self.stager is not None:
            self.stager.set_busy(name, False)

    def _update_gauges(self, server: TritonServer) -> None:
        self.metrics.loaded_bytes.labels(server.name).set(server.planner.used_bytes)
        self.metrics.loaded_models.labels(server.name).set(server.planner.used_slots)

    def _meter(self, server: TritonServer, name: str):
        """The memory meter for ``name`` on ``server``: the configured one, or none for a
        model whose size is fixed in advance (a family's variant: a slot allocated when its
        family loaded, whose bytes never come and go with the variant)."""
        return self.memory if server.admin.measured(name) else NoMemoryMeter()

    def _save_row(self, name: str, **fields) -> None:
        """Write ``name``'s history row (``StateStore.save_model``) in the state store's
        thread: a load or an unload never waits on the database, and rows land in the
        order they were written.  A failed write is logged; the model is served anyway."""
        def logged(done: asyncio.Future) -> None:
            if not done.cancelled() and done.exception() is not None:
                log.error("recording %s in the state store failed: %s", name, done.exception())

        self.store.db.off_loop(self.store.save_model, name, **fields).add_done_callback(logged)

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

