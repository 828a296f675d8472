"""What the parts of the model manager share, in three small objects: the ``ModelBook``
(records), the ``TaskBoard`` (work in progress and the one lock) and the ``Bookkeeping``
(metrics, history rows, warm-tier marks).

``ModelManager`` (model_manager.py) holds them in one ``ManagerState`` and builds one object
per part (catalog, recency, executor, unloader, loader, copies, pins, reconciler with health,
leases), giving each, in its constructor, only what it uses and the parts it calls, so a
reader sees who reads and writes what: a load asks the executor to evict its victims, the
unloader asks it to unload what leaves, a reconcile pass asks the pins to load pinned models
again, a lease asks the loader.  The locking rules of the
package docstring hold across them: the task board's ``lock`` is one lock for all parts.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from pathlib import Path

from control_plane.manager.manager_config import ManagerConfig
from control_plane.manager.placement import Placer
from control_plane.manager.records import (
    CopyKey,
    ModelRecord,
    ModelState,
    PoolKey,
    Stager,
    TritonServer,
)
from control_plane.manager.residency import Residency
from control_plane.manager.room import RoomLedger
from control_plane.metrics import ControlPlaneMetrics
from control_plane.state.state_store import StateStore
from control_plane.triton.admin import SlotPool
from control_plane.triton.devices import GpuMemoryMeter, NoMemoryMeter

log = logging.getLogger(__name__)

# How long a model's history row waits to be written with the others due: a miss writes two
# (the newcomer's, its victim's), each a thread hand-off and a commit that take the event
# loop's time while misses come back to back.  A crash loses at most this much history
# (the last use, the load time); what is loaded is read from Triton on start, not from here.
HISTORY_WRITE_DELAY_S = 0.05


class ModelBook:
    """The records of the models and the names some Triton lists; whoever reads or moves a
    record gets this.  A record's changes reach ``residency`` (the planners) and the move
    listeners (the data-plane publisher)."""

    def __init__(self, residency: Residency, metrics: ControlPlaneMetrics):
        self.residency = residency
        self.metrics = metrics
        self.records: dict[str, ModelRecord] = {}
        # Slot pools (a family model on one server), by ``PoolKey``: records like a model's
        # (the same states and writers, the planner's view derived the same way), but no
        # model of the catalogue: never listed, ensured, pinned or published to the router.
        self.pools: dict[str, ModelRecord] = {}
        # Models an operator is unloading (``Unloader.unload``): none of their copies becomes
        # their own meanwhile (copies.py).
        self.unloading: set[str] = set()
        self.known_names: set[str] = set()  # names some Triton's repository index listed
        self.load_listeners: list[Callable[[str, ModelRecord], None]] = []
        self.move_listeners: list[Callable[[str], None]] = []  # a model's state changed

    def record(self, name: str) -> ModelRecord:
        """``name``'s record, made on first use."""
        rec = self.records.get(name)
        if rec is None:
            rec = self.records[name] = ModelRecord(name, on_illegal=self._count_illegal,
                                                   on_move=self._moved,
                                                   on_change=self.residency.sync)
        return rec

    def pool(self, server: str, pool: SlotPool) -> ModelRecord:
        """The record of ``pool``'s slots on ``server``, made on first use."""
        key = PoolKey(pool.name, server)
        rec = self.pools.get(key)
        if rec is None:
            rec = self.pools[key] = ModelRecord(key, on_illegal=self._count_illegal,
                                                on_change=self.residency.sync,
                                                slot_bytes=max(pool.slot_bytes, 1))
        return rec

    def extra_copy(self, model: str, server: str) -> ModelRecord:
        """The record of ``model``'s extra copy on ``server`` (in ``model``'s record's
        ``extra``), made on first use.  Moved like a model's; never listed, ensured or pinned
        on its own; a change of it tells the move listeners the model's name (where it is
        READY changed)."""
        owner = self.record(model)
        rec = owner.extra.get(server)
        if rec is None:
            rec = owner.extra[server] = ModelRecord(
                CopyKey(model, server), on_illegal=self._count_illegal,
                on_move=lambda _key, m=model: self._moved(m), on_change=self.residency.sync)
        return rec

    def extra_copies(self, model: str) -> list[ModelRecord]:
        """``model``'s extra copies that hold a server (loading, ready, unloading)."""
        rec = self.records.get(model)
        return [] if rec is None else [c for c in rec.extra.values() if c.server is not None]

    def every_extra_copy(self) -> list[ModelRecord]:
        """The extra copies of every model, whether they hold a server or not."""
        return [c for rec in self.records.values() if rec.extra for c in rec.extra.values()]

    def lookup(self, key: str) -> ModelRecord:
        """The record behind a planner's key: a model's, a slot pool's or an extra copy's."""
        found = self.find(key)
        if found is None:
            raise KeyError(key)
        return found

    def find(self, key: str) -> ModelRecord | None:
        """``lookup``, or None for a key no record has; the key's type says where it is."""
        if isinstance(key, PoolKey):
            return self.pools.get(key)
        if isinstance(key, CopyKey):
            owner = self.records.get(key.model)
            return None if owner is None else owner.extra.get(key.server)
        return self.records.get(key)

    def _moved(self, name: str) -> None:
        for listener in self.move_listeners:
            listener(name)

    def _count_illegal(self, was: ModelState, to: ModelState) -> None:
        self.metrics.illegal_transitions.labels(was.value, to.value).inc()


class TaskBoard:
    """The loads, unloads and background work in progress, and the one lock every part
    takes between placement and reservation (package docstring)."""

    def __init__(self):
        self.lock = asyncio.Lock()
        self.loads: dict[str, asyncio.Task] = {}  # one load task per model; late callers await it
        self.unloads: dict[str, asyncio.Task] = {}  # one unload task per model
        self.background: set[asyncio.Task] = set()  # work that ends (a repair, an unload)
        self.loops: set[asyncio.Task] = set()  # work that runs until close (the probes)

    def spawn(self, coro, forever: bool = False) -> None:
        """Run ``coro`` in the background; ``ModelManager.close`` cancels what is left.
        ``forever``: a loop that never ends, kept apart from the work that does (whoever
        waits for the manager to be idle waits for ``background``)."""
        task = asyncio.get_running_loop().create_task(coro)
        tasks = self.loops if forever else self.background
        tasks.add(task)
        task.add_done_callback(tasks.discard)


class Bookkeeping:
    """What a load or an unload records outside the manager: metrics, the state store's
    history rows, the warm tier's busy marks."""

    def __init__(self, metrics: ControlPlaneMetrics, store: StateStore, stager: Stager | None):
        self.metrics = metrics
        self.store = store
        self.stager = stager
        self._rows_due: dict[str, dict] = {}  # history rows not written yet (save_row)
        self._rows_timer: asyncio.TimerHandle | None = None

    def release_warm(self, name: str) -> None:
        """The warm tier may drop ``name`` again (it is neither loaded nor loading)."""
        if self.stager is not None:
            self.stager.set_busy(name, False)

    def update_gauges(self, server: TritonServer) -> None:
        self.metrics.loaded_bytes.labels(server.name).set(server.planner.used_bytes)
        self.metrics.loaded_models.labels(server.name).set(server.planner.models)

    def save_row(self, name: str, **fields) -> None:
        """Record ``name``'s history fields (``StateStore.save_model``): kept, newer fields
        over older ones, and written with every other row due in one transaction in the
        state store's thread ``HISTORY_WRITE_DELAY_S`` later (``write_rows``).  A load or an
        unload never waits on the database, and a burst of misses costs one write, not two
        per miss.  A failed write is logged; the model is served anyway."""
        self._rows_due.setdefault(name, {}).update(fields)
        if self._rows_timer is None:
            self._rows_timer = asyncio.get_running_loop().call_later(
                HISTORY_WRITE_DELAY_S, self.write_rows)

    def write_rows(self) -> asyncio.Future | None:
        """Write the history rows due now (None when there are none): on the timer, and on
        close so that none is lost."""
        if self._rows_timer is not None:
            self._rows_timer.cancel()
            self._rows_timer = None
        rows, self._rows_due = self._rows_due, {}
        if not rows:
            return None

        def logged(done: asyncio.Future) -> None:
            if not done.cancelled() and done.exception() is not None:
                names = sorted(rows)
                log.error("recording the history of %d model(s) (%s%s) in the state store "
                          "failed: %s", len(names), ", ".join(names[:5]),
                          ", ..." if len(names) > 5 else "", done.exception())

        written = self.store.db.off_loop(self.store.save_models, rows)
        written.add_done_callback(logged)
        return written


class ManagerState:
    """Everything the parts are built from, held by ``ModelManager``: the fleet, the
    configuration and the clock, the ``ModelBook``, the ``TaskBoard``, the
    ``Bookkeeping``, and what only loads use (stager, placer, priorities, warm-up switch,
    room ledger).  No part is given this whole: each gets the few of these it uses."""

    def __init__(self, servers: dict[str, TritonServer], store: StateStore,
                 repository: Path | None, config: ManagerConfig, metrics: ControlPlaneMetrics,
                 clock: Callable[[], float], stager: Stager | None,
                 priority_of: Callable[[str], int], placer: Placer,
                 warmup_enabled: Callable[[str], bool], memory: GpuMemoryMeter | NoMemoryMeter,
                 room: RoomLedger):
        self.servers = servers
        self.store = store
        self.repository = repository
        self.config = config
        self.metrics = metrics
        self.clock = clock
        self.stager = stager
        self.priority_of = priority_of
        self.placer = placer
        self.warmup_enabled = warmup_enabled
        self.memory = memory
        self.room = room
        self.keeping = Bookkeeping(metrics, store, stager)
        # Each server's planner, derived from the records (residency.py): never set by hand.
        self.residency = Residency(servers, clock, priority_of, self._room_changed)
        self.book = ModelBook(self.residency, metrics)
        self.tasks = TaskBoard()

    def _room_changed(self, server: TritonServer, freed: bool) -> None:
        self.keeping.update_gauges(server)
        if freed:
            self.room.changed()
