"""Carrying out what changes a server's room: a load's plan, the one path of a model's load
(loader.py) and of an extra copy's (copies.py), and every unload, whoever decided it
(``unload_now``: an eviction, the headroom, an explicit unload of unloader.py).

A plan is what placement chose under the manager's lock from the state it read
(``Placer.place``, a pure function of the planners: the server and the victims of any kind
there).  ``Executor`` carries it out in two calls, the first under that lock, the second
(``carry_out``) after it, each undoing what it did when it fails:

1. ``commit`` (under the same lock, no ``await`` since the plan was made): the victims are
   marked leaving, the family's record is reserved when the load also loads the family, the
   loading record takes its room on the server, and the load queues for Triton's room.
2. ``make_room``: the victims leave.  A variant that replaces variants of its family does it
   in the same request as its fill (``TritonAdmin.replaces_in_one``); otherwise the victims'
   unloads run and the load goes to Triton once Triton confirms room for it, or at once where
   measured free memory holds it (the overlap rule, ``RoomLedger.wait``).  A failure gives
   back what ``commit`` reserved (``undo``); ``carry_out`` raises it as ``EvictionFailed``.
3. ``load``: Triton's load (or the replacing request), the warm-up, and the size the device
   measured (more victims leave when it is larger than planned).  A failure unloads what
   Triton kept (the record FAILED with its reason, or UNLOAD_FAILED holding its room until
   Triton confirms it gone) and ``settle``s the family's record.

The loader (a model's load) and copies (an extra copy's) call ``commit`` and ``carry_out``
and then do what is theirs: a model's history row and its listeners, a copy's retry.

An unload (``unload_now``, one task per model however many ask) drains the requests sent
to Triton, unloads, and frees the room once Triton confirms the model gone; one that fails
keeps the model's server and room (``UNLOAD_FAILED``) until one succeeds.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from control_plane.manager.fleet_state import Bookkeeping, ModelBook, TaskBoard
from control_plane.manager.manager_config import ManagerConfig
from control_plane.manager.placement import plan_measured
from control_plane.manager.records import (
    ModelRecord,
    ModelState,
    TritonServer,
)
from control_plane.manager.room import RoomLedger
from control_plane.manager.warmup import warm_up
from control_plane.triton.devices import GpuMemoryMeter, NoMemoryMeter
from domain import tracing
from domain.errors import ControlPlaneError, EvictionFailed

log = logging.getLogger(__name__)

def replacing_possible(server: TritonServer, name: str, victims: list[str]) -> bool:
    """Whether ``name``'s load and its victims' unloads go to ``server`` as one request."""
    return bool(victims) and server.admin.replaces_in_one(name, victims)


@dataclass
class Reservation:
    """A plan committed: ``rec`` (the model's record, or its extra copy's) loads ``model`` on
    ``server`` in the place of ``victims`` (their records); the room it holds there
    (``room_bytes``, ``room_slots``), the family record it reserved (``pool``, given back by
    ``undo_pool``) and the state ``rec`` was in before."""

    server: TritonServer
    rec: ModelRecord
    model: str
    size_bytes: int
    victims: list[ModelRecord]
    previous_state: ModelState
    pool: ModelRecord | None
    undo_pool: Callable[[], None]
    room_bytes: int
    room_slots: int
    replacing: asyncio.Future | None = None  # the victims' eviction and the load, one request
    overlapped: bool = False  # sent while its victims still shut down (measured free memory)
    # Failed, and nothing of it holds room: given back before its load, or its failed load
    # confirmed gone by Triton.
    undone: bool = False


def retrieve(fut: asyncio.Future) -> None:
    """Done callback of an unload nobody awaits: its failure is logged where it happens."""
    if not fut.cancelled():
        fut.exception()


class Executor:
    def __init__(self, book: ModelBook, tasks: TaskBoard, keeping: Bookkeeping,
                 config: ManagerConfig, clock: Callable[[], float], room: RoomLedger,
                 warmup_enabled: Callable[[str], bool],
                 memory: GpuMemoryMeter | NoMemoryMeter | None = None):
        """``memory``: the device memory meter that measures loads and unloads (NVML on a
        GPU; none on CPU)."""
        self.memory = memory if memory is not None else NoMemoryMeter()
        self.book = book
        self.tasks = tasks
        self.keeping = keeping
        self.config = config
        self.clock = clock
        self.room = room
        self.warmup_enabled = warmup_enabled

    def meter(self, server: TritonServer, name: str) -> GpuMemoryMeter | NoMemoryMeter:
        """The memory meter for ``name`` on ``server``: the configured one, or none for a
        model whose size is fixed in advance (a family's variant: a slot allocated when its
        family loaded, whose bytes never come and go with the variant)."""
        return self.memory if server.admin.measured(name) else NoMemoryMeter()

    # -- 1. commit ------------------------------------------------------------------------
    def commit(self, server: TritonServer, rec: ModelRecord, model: str, size_bytes: int,
               victims: list[str]) -> Reservation:
        """Reserve a plan (see the module docstring).  Call under the lock, with no await
        since placement."""
        with self.room.placing():
            victim_recs = [self.book.lookup(v) for v in victims]
            for victim in victim_recs:
                victim.move(ModelState.UNLOADING)
            previous = rec.state
            pool, undo_pool, room_bytes, room_slots = self.reserve_pool(
                server, model, size_bytes, key=rec.name)
            rec.move(ModelState.LOADING, server=server.name, memory_bytes=size_bytes)
        self.room.queue(server, rec.name, room_bytes, room_slots)
        return Reservation(server, rec, model, size_bytes, victim_recs, previous, pool,
                           undo_pool, room_bytes, room_slots)

    def reserve_pool(self, server: TritonServer, name: str, size_bytes: int, key: str | None = None):
        """A family's variant takes one slot's room, as a model takes its own; when its load
        also loads the family there (or grows it to more slots), the family's record is
        reserved here.  Returns (the family's pool record or None, its undo, server bytes and
        places reserved).  ``key``: the planner's key of the load (an extra copy's; default
        ``name``)."""
        pool = server.admin.slot_pool(name)
        if pool is None:
            return None, lambda: None, size_bytes, 1
        pool_rec = self.book.pool(server.name, pool)
        size_bytes = pool.slot_bytes  # its slot's, whatever the variant's file holds beside
        slots = server.planner.pool_growth(pool_rec.name, pool.slots)
        if slots <= 0:  # a slot of the family there is this variant's (or a member's leaving)
            return pool_rec, lambda: None, size_bytes, 1
        slot_bytes = pool_rec.slot_bytes
        if pool_rec.server == server.name and pool_rec.state in (ModelState.READY, ModelState.LOADING):
            held = pool_rec.slots  # it grows: loaded again with more slots
            pool_rec.resize(slots * slot_bytes)
            return pool_rec, lambda: pool_rec.resize(held * slot_bytes), size_bytes, 1
        before = pool_rec.state
        pool_rec.move(ModelState.LOADING, server=server.name, memory_bytes=slots * slot_bytes)

        def undo() -> None:
            if pool_rec.state == ModelState.LOADING and server.planner.members(pool_rec.name) == 0:
                pool_rec.move(before if before not in (ModelState.LOADING, ModelState.READY)
                              else ModelState.WARM, server=None)

        return pool_rec, undo, size_bytes, 1

    # -- 2. room --------------------------------------------------------------------------
    async def make_room(self, res: Reservation, undo_to: ModelState | None = None) -> None:
        """The victims leave and the load may go to Triton (module docstring); on failure
        what ``commit`` reserved is given back (``undo``, the record back to ``undo_to``) and
        the failure raised."""
        server, rec = res.server, res.rec
        if replacing_possible(server, res.model, [v.name for v in res.victims]):
            self.room.send(server, rec.name, res.size_bytes)
            # Listed as the victims' unload now, before any await: a load of a victim waits.
            res.replacing = self.replace(server, res.victims, res.model)
            res.replacing.add_done_callback(retrieve)  # raised by ``load``
            return
        evictions = [self.unload_now(server, v, reason="evicted") for v in res.victims]
        for fut in evictions:
            fut.add_done_callback(retrieve)  # failures are raised below or logged
        try:
            res.overlapped = await self.room.wait(
                server, res.model, res.size_bytes, evictions, lambda: self._freeing(server),
                # The longest an unload in progress takes before it fails on its own.
                time.monotonic() + self.config.drain_timeout_s + self.config.unload_timeout_s,
                res.room_bytes, res.room_slots, res.pool)
        except BaseException:
            self.undo(res, undo_to)
            raise
        # No await between the room check and this: the next waiter sees this load as held.
        self.room.send(server, rec.name, res.size_bytes)

    def unload_now(self, server: TritonServer, rec: ModelRecord, reason: str) -> asyncio.Future:
        """Unload ``rec``'s model, copy or family slots from ``server``: one task per record
        however many ask (listed in ``TaskBoard.unloads`` by its key)."""
        key = rec.name
        task = self.tasks.unloads.get(key)
        if task is None:
            task = asyncio.get_running_loop().create_task(self._do_unload(server, rec, reason))
            self.tasks.unloads[key] = task
            task.add_done_callback(lambda _t, k=key: self.tasks.unloads.pop(k, None))
        return asyncio.shield(task)

    async def _do_unload(self, server: TritonServer, rec: ModelRecord, reason: str) -> None:
        rec.move(ModelState.UNLOADING)
        await self._drain([rec])
        start = time.monotonic()
        try:
            if rec.holder is not None:  # a family model whose variants all left: its slots
                await server.admin.unload_slots(rec.holder)
                await server.admin.wait_unavailable(rec.holder, self.config.unload_timeout_s)
            else:  # a model's copy (its own, or an extra one: the same Triton model)
                await server.admin.unload(rec.triton_name)
                await server.admin.wait_unavailable(rec.triton_name, self.config.unload_timeout_s)
        except ControlPlaneError as exc:
            self._unload_failed(server, rec, exc)
            raise
        await self._unloaded(server, rec, reason, start)

    def replace(self, server: TritonServer, victims: list[ModelRecord], name: str) -> asyncio.Future:
        """Evict ``victims`` and load ``name`` on ``server`` as one request
        (``TritonAdmin.replaces_in_one``: a variant into the slots of its family's variants).
        The victims' unloads are this one task, listed for each of them (a load of a victim
        waits for it); it raises the load's failure, after the victims are unloaded one by
        one as if the request had not been."""
        task = asyncio.get_running_loop().create_task(self._do_replace(server, victims, name))
        for victim in victims:
            self.tasks.unloads[victim.name] = task
            task.add_done_callback(lambda done, n=victim.name: self.tasks.unloads.pop(n, None)
                                   if self.tasks.unloads.get(n) is done else None)
        return asyncio.shield(task)

    async def _do_replace(self, server: TritonServer, recs: list[ModelRecord], name: str) -> None:
        for rec in recs:
            rec.move(ModelState.UNLOADING)
        await self._drain(recs)
        start = time.monotonic()
        try:
            await server.admin.load_replacing(name, [rec.name for rec in recs])
        except ControlPlaneError:
            # Whether the victims left with it is unknown: unload each on its own (a freed
            # slot's evict is a no-op), so each ends warm, or holds its room until confirmed.
            await asyncio.gather(*(self._do_unload(server, rec, "evicted") for rec in recs),
                                 return_exceptions=True)
            raise
        for rec in recs:
            # The load's own line ("loaded X in place of Y") says it: one line per swap.
            await self._unloaded(server, rec, "evicted", start, logged=False)

    async def _drain(self, recs: list[ModelRecord]) -> None:
        """Requests holding a lease on these models finish first (bounded by
        ``drain_timeout_s``).  Only requests already sent to Triton are drained: requests
        still waiting for a model wait for its unload to finish, so waiting on them would
        deadlock."""
        deadline = time.monotonic() + self.config.drain_timeout_s
        while any(rec.active > 0 for rec in recs) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        for rec in recs:
            if rec.active > 0:
                log.warning("%s still has %d requests in flight after %.0fs; unloading anyway "
                            "(Triton lets running requests finish)", rec.name, rec.active,
                            self.config.drain_timeout_s)

    def _unload_failed(self, server: TritonServer, rec: ModelRecord, exc: ControlPlaneError) -> None:
        # Triton may still hold it: the server, and its room, stay counted until Triton
        # confirms it gone (the reconcile retries after the backoff, as does a load).
        # It holds its room again, promised to no load.
        rec.failure = f"unload did not complete: {exc.message}"
        rec.failed_at = time.monotonic()
        rec.move(ModelState.UNLOAD_FAILED)
        log.error("unload of %s on %s failed: %s", rec.name, server.name, exc.message)

    async def _unloaded(self, server: TritonServer, rec: ModelRecord, reason: str, start: float,
                        logged: bool = True) -> None:
        """Triton confirmed ``rec`` gone from ``server``: its room is free once the memory is
        back (NVML on a GPU; what is not back stays counted), and it is warm."""
        name = rec.name
        triton_name = rec.triton_name
        await self.meter(server, triton_name).released(server, triton_name)
        freed_s = time.monotonic() - start
        self.keeping.metrics.unload_free_seconds.labels(server.name).observe(freed_s)
        self.keeping.metrics.unloads.labels(server.name, reason).inc()
        rec.warmup = None
        rec.move(ModelState.WARM, server=None)
        if triton_name == name:  # a family's slots, an extra copy: no tier mark or history row
            self.keeping.release_warm(name)
            self.keeping.save_row(name, server=None)
        (log.info if logged else log.debug)("unloaded %s from %s (%s); memory free after %.2fs",
                                            name, server.name, reason, freed_s)

    async def undo_failed_load(self, server: TritonServer, rec: ModelRecord) -> bool:
        """Unload what Triton kept of ``rec``'s failed load (a model's or an extra copy's):
        True once Triton confirms it gone (``rec`` is failed, its room free); False when that
        unload fails too (``rec`` holds its room as UNLOAD_FAILED until one succeeds)."""
        try:
            await server.admin.unload(rec.triton_name)
            await server.admin.wait_unavailable(rec.triton_name, self.config.unload_timeout_s)
            await self.meter(server, rec.triton_name).released(server, rec.triton_name)
        except ControlPlaneError as exc:
            log.error("the failed load of %s on %s could not be unloaded: %s; it holds its room "
                      "until an unload succeeds", rec.name, server.name, exc.message)
            rec.failed_at = time.monotonic()
            rec.move(ModelState.UNLOAD_FAILED)
            return False
        rec.move(ModelState.FAILED, server=None)
        return True

    def undo(self, res: Reservation, to: ModelState | None = None) -> None:
        """Give back what ``commit`` reserved: the queued room, the record's place (back to
        ``to``, default the state it was in, or warm), the family's record."""
        self.room.unqueue(res.server, res.rec.name)
        before = res.previous_state
        res.rec.move(to or (before if before not in (ModelState.LOADING, ModelState.UNLOAD_FAILED)
                            else ModelState.WARM), server=None)
        res.undo_pool()
        self.settle(res)

    def _freeing(self, server: TritonServer) -> list[asyncio.Future]:
        """The unloads in progress on ``server``: what may still free its room."""
        return [t for n, t in self.tasks.unloads.items()
                if not t.done() and (r := self.book.find(n)) is not None and r.server == server.name]

    # -- the three steps after commit, as one ------------------------------------------------
    async def carry_out(self, res: Reservation, measure: bool = True,
                        undo_to: ModelState | None = None) -> dict:
        """Room, load, warm-up and the measured size of a committed plan: returns the
        warm-up's result, the record still LOADING (its caller makes it READY).

        On failure what was done is undone and the failure raised: ``EvictionFailed`` when
        the victims did not leave (the reservation given back, the record back to
        ``undo_to``: ``res.undone``); else the load's own error, the record FAILED with its
        reason once Triton confirms what it kept gone (``res.undone``), or UNLOAD_FAILED
        holding its room until then.
        ``measure``: the load is measured on a GPU (a model's own copy)."""
        server, rec = res.server, res.rec
        try:
            await self.make_room(res, undo_to)
        except BaseException as exc:
            res.undone = True
            self.keeping.metrics.loads.labels(server.name, "evict_failed").inc()
            if isinstance(exc, ControlPlaneError):
                raise EvictionFailed(f"could not free room for {res.model} on {server.name}: "
                                     f"{exc.message}") from exc
            raise
        if res.overlapped:
            log.info("loading %s on %s while its victims still shut down: measured free memory "
                     "holds it", res.model, server.name)
        for _ in res.victims:
            self.keeping.metrics.evictions.labels(server.name).inc()
        start = time.monotonic()
        rec.loads += 1
        try:
            warmup, measured_bytes = await self.load(res, measure)
            if measured_bytes is not None:
                await self._fit_measured(server, rec, measured_bytes)
        except BaseException as exc:
            res.undone = await self._undo_load(server, rec, exc)
            self.settle(res)
            raise
        self.settle(res)
        rec.load_time_s = time.monotonic() - start
        rec.warmup = warmup
        return warmup

    async def _fit_measured(self, server: TritonServer, rec: ModelRecord, measured_bytes: int) -> None:
        """Account the size NVML measured; evict more when the model no longer fits, or
        raise CapacityExhausted (the load is undone) when nothing can make room."""
        async with self.tasks.lock:
            victims = [self.book.lookup(v)
                       for v in plan_measured(server.planner, rec.name, measured_bytes)]
            for victim in victims:
                # Its room already went to this model's growth: no load may plan on it.
                victim.move(ModelState.UNLOADING, room_promised=False)
            rec.resize(measured_bytes)
        if victims:
            log.info("%s measured %d bytes on %s: evicting %s", rec.name, measured_bytes,
                     server.name, [v.name for v in victims])
            await asyncio.gather(*(self.unload_now(server, v, reason="evicted") for v in victims),
                                 return_exceptions=True)  # a failed one stays counted

    async def _undo_load(self, server: TritonServer, rec: ModelRecord, exc: BaseException) -> bool:
        """A load failed: the reason on its record (and a model's history row), and what
        Triton kept unloaded (True once Triton confirms it gone)."""
        reason = exc.message if isinstance(exc, ControlPlaneError) else repr(exc)
        rec.failure = reason
        rec.failed_at = time.monotonic()
        rec.warmup = {"ok": False, "latency_ms": None, "checked_at": self.clock(), "error": reason}
        self.keeping.metrics.loads.labels(server.name, "failed").inc()
        if rec.server != server.name:
            # Its server was declared down meanwhile: the record was forgotten there (and may
            # be loading elsewhere now); what the server kept is unloaded when it answers.
            log.warning("load of %s on %s failed after the server was declared down: %s",
                        rec.name, server.name, reason)
            return False
        if not await self.undo_failed_load(server, rec):
            return False  # Triton may still hold it: its bytes stay counted, the reconcile retries
        if rec.triton_name == rec.name:  # a model's own copy: its history says why
            self.keeping.save_row(rec.name, failure=reason)
        log.warning("load of %s on %s failed: %s", rec.name, server.name, reason)
        return True

    # -- 3. load --------------------------------------------------------------------------
    async def load(self, res: Reservation, measure: bool = True) -> tuple[dict, int | None]:
        """Triton's load of ``res.model`` (or the request that replaces its victims), then its
        warm-up: (the warm-up's result, the bytes the device measured or None).  ``measure``:
        the load is measured on a GPU (a model's own copy).  Raises the failure: the caller
        undoes it, then ``settle``s."""
        server, model = res.server, res.model
        try:
            if measure:
                async with self.meter(server, model).measuring(server, model) as measured:
                    warmup = await self._load_and_warm_up(res)
                return warmup, measured.bytes
            return await self._load_and_warm_up(res), None
        finally:
            self.room.finish(res.rec.name)

    async def _load_and_warm_up(self, res: Reservation) -> dict:
        if res.replacing is not None:
            await res.replacing
        else:
            await res.server.admin.load(res.model)
        with tracing.span("warm_up", model=res.model):
            return await self.warm_up(res.server, res.model)

    async def warm_up(self, server: TritonServer, name: str) -> dict:
        """Warm ``name`` up as the model says (warmup.warm_up); the result is what
        ``health`` shows."""
        return await warm_up(server, name, self.config, self.warmup_enabled, self.clock)

    def settle(self, res: Reservation) -> None:
        """After a load (done or failed): its family's record as the server's model control
        knows it now (loaded with so many slots, or not at all)."""
        server, pool = res.server, res.pool
        if pool is None or pool.server not in (None, server.name):
            return
        slots = server.admin.loaded_slots(pool.holder)
        if slots is None:
            if pool.state == ModelState.LOADING and server.planner.members(pool.name) == 0:
                pool.move(ModelState.WARM, server=None)  # never loaded: its room is free
            return
        if pool.state in (ModelState.LOADING, ModelState.READY, ModelState.WARM):
            pool.move(ModelState.READY, server=server.name, memory_bytes=slots * pool.slot_bytes)
