"""Loads: one task per model, placement and reservation under the lock, room, warm-up,
and undoing exactly what was done when a step fails (package docstring)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

from control_plane.eviction import victim_priority_limit
from control_plane.manager.fleet_state import Bookkeeping, ModelBook, TaskBoard
from control_plane.manager.known_models import Catalog
from control_plane.manager.placement import Placer, plan_measured
from control_plane.manager.recency import Recency
from control_plane.manager.records import (
    ManagerConfig,
    ModelRecord,
    ModelState,
    Stager,
    TritonServer,
    slot_pool,
)
from control_plane.manager.room import RoomLedger
from control_plane.manager.unloader import Unloader, retrieve
from control_plane.manager.warmup import warm_up
from domain import tracing
from domain.errors import (
    CapacityExhausted,
    ControlPlaneError,
    ModelLoadFailed,
    ModelNotFound,
    OperationTimeout,
)
from domain.names import validate_model_name

log = logging.getLogger(__name__)

# How often a load waiting for room re-reads the measured free memory (an unload finishing
# wakes it at once).
ROOM_POLL_S = 0.05


def replacing_possible(server: TritonServer, name: str, victims: list[str]) -> bool:
    """Whether ``name``'s load and its victims' unloads go to ``server`` as one request."""
    return bool(victims) and server.admin.replaces_in_one(name, victims)


class Loader:
    def __init__(self, book: ModelBook, servers: dict[str, TritonServer], tasks: TaskBoard,
                 keeping: Bookkeeping, config: ManagerConfig, clock: Callable[[], float],
                 stager: Stager | None, placer: Placer, priority_of: Callable[[str], int],
                 room: RoomLedger, warmup_enabled: Callable[[str], bool], catalog: Catalog,
                 recency: Recency, unloader: Unloader):
        self.book = book
        self.servers = servers
        self.tasks = tasks
        self.keeping = keeping
        self.config = config
        self.clock = clock
        self.stager = stager  # cold -> warm before a load
        self.placer = placer
        self.priority_of = priority_of  # a shadow newcomer evicts shadows only
        self.room = room
        self.warmup_enabled = warmup_enabled
        self.catalog = catalog
        self.recency = recency
        self.unloader = unloader  # evicts a load's victims and keeps the headroom free

    async def ensure(self, name: str, retry_failed: bool = False) -> ModelRecord:
        """Return once ``name`` is READY on some server, loading it if needed."""
        validate_model_name(name)
        rec = self.book.records.get(name)
        if rec is not None and rec.state == ModelState.READY:
            metrics = self.keeping.metrics
            metrics.hits.labels(metrics.model_label(name)).inc()
            self.recency.touch(name)
            return rec
        if (rec is not None and rec.state in (ModelState.FAILED, ModelState.UNLOAD_FAILED)
                and not retry_failed
                and rec.failed_at is not None
                and time.monotonic() - rec.failed_at < self.config.failure_backoff_s):
            wait_s = self.config.failure_backoff_s - (time.monotonic() - rec.failed_at)
            what = (f"{name} may still be loaded on {rec.server}" if rec.server is not None
                    else f"{name} failed to load")
            raise ModelLoadFailed(f"{what}: {rec.failure}; not retrying for "
                                  f"{wait_s:.0f}s (mmctl load {name} retries now)")
        task = self.tasks.loads.get(name)
        if task is None:
            await self.catalog.known(name)
            task = self.tasks.loads.get(name)  # re-read: another caller may have started it meanwhile
        if task is None:
            metrics = self.keeping.metrics
            metrics.misses.labels(metrics.model_label(name)).inc()
            task = asyncio.get_running_loop().create_task(self._traced_load(name))
            self.tasks.loads[name] = task
            task.add_done_callback(lambda _t, n=name: self.tasks.loads.pop(n, None))
        return await asyncio.shield(task)

    def place(self, name: str, size_bytes: int) -> tuple[TritonServer, list[str]]:
        """Pick a server and the victims to evict there.  Pure; raises if none fits."""
        rec = self.book.records.get(name)
        # Not where an extra copy of it still is (copies.py): one Triton model, one record.
        holding = {c.server for c in self.book.extra_copies(name)} if self.book.extra else set()
        servers = [s for s in self.servers.values() if s.name not in holding] or list(self.servers.values())
        try:
            return self.placer.place(name, size_bytes, servers,
                                     pinned=bool(rec is not None and rec.pinned))
        except CapacityExhausted:
            self.keeping.metrics.capacity_errors.inc()
            raise

    async def _traced_load(self, name: str) -> ModelRecord:
        with tracing.span("load", model=name):
            return await self._load(name)

    async def _load(self, name: str) -> ModelRecord:
        pending_unload = self.tasks.unloads.get(name)
        if pending_unload is not None:
            with contextlib.suppress(ControlPlaneError):
                await asyncio.shield(pending_unload)
        rec = self.book.record(name)
        if rec.state == ModelState.READY:
            return rec
        if rec.state == ModelState.UNLOAD_FAILED and rec.server is not None:
            # Its unload failed: the server may still hold it.  Loading it elsewhere would
            # serve it twice and leak that server's room, so unload it there first.
            held_by = self.servers[rec.server]
            try:
                await self.unloader.unload_now(held_by, name, reason="retry_after_failure")
            except ControlPlaneError as exc:
                raise ModelLoadFailed(
                    f"{name} may still be loaded on {held_by.name} ({exc.message}); it is not "
                    f"loaded anywhere else until {held_by.name} confirms it gone; retrying "
                    f"in {self.config.failure_backoff_s:.0f}s") from exc
        if self.stager is not None:
            # Cold -> warm before anything is reserved: a failed download holds no capacity.
            self.stager.set_busy(name, True)
            try:
                with tracing.span("stage", model=name):
                    size_bytes = await self.stager.stage(name)
            except BaseException as exc:
                self.stager.set_busy(name, False)
                if isinstance(exc, ControlPlaneError) and not isinstance(exc, ModelNotFound):
                    # A bad artifact or an unreachable store: back off like a failed load.
                    rec.move(ModelState.FAILED)
                    rec.failure, rec.failed_at = exc.message, time.monotonic()
                raise
        else:
            size_bytes = await asyncio.to_thread(self.catalog.artifact_bytes, name)  # a file walk
        # Recency is what requests reported (this one included) and what the last reconcile
        # pass read from Triton's statistics: a miss asks Triton nothing before it places.
        deadline = time.monotonic() + self.config.capacity_wait_s
        place = self.room.turns.place()  # among the loads waiting for room (room.py)
        try:
            while True:
                async with self.tasks.lock:
                    # Re-check after the lock: someone may have loaded it meanwhile.
                    if rec.state == ModelState.READY:
                        return rec
                    try:
                        server, victims = self.place(name, size_bytes)
                    except CapacityExhausted:
                        place.pass_on()  # woken for room it cannot use: the next waiter may
                        # Room held only by loads/unloads in progress frees up in seconds: wait
                        # for one of them instead of failing; room held by pins is final.
                        busy = self._room_is_busy(name)
                        if not busy or time.monotonic() >= deadline:
                            self.keeping.release_warm(name)
                            raise
                        turn = place.turn()
                    else:
                        with self.room.placing():
                            for v in victims:
                                self.book.lookup(v).move(ModelState.UNLOADING)
                            previous_state = rec.state
                            rec.failure = None
                            # A family's variant takes one slot's room; its family's
                            # record is reserved when this load loads the family.
                            pool, undo_pool, room_bytes, room_slots = self.reserve_pool(
                                server, name, size_bytes)
                            rec.move(ModelState.LOADING, server=server.name, memory_bytes=size_bytes)
                        self.room.queue(server, name, room_bytes, room_slots)
                        self.unloader.maintain_headroom(server)  # the next miss finds room again
                        break
                # Room comes back when the planner's view gives it back (a hold ends, a
                # model starts leaving, a load fails): ``RoomLedger.changed`` wakes the load
                # that waited longest.  The poll is a floor for what nothing tells.
                timeout_s = min(ROOM_POLL_S, max(0.0, deadline - time.monotonic()))
                await asyncio.wait({turn}, timeout=timeout_s)
        finally:
            place.leave()
        # A variant's swap takes milliseconds: its one INFO line is "loaded" (below); a
        # model's load, seconds: this line says what it waits for.
        in_one = replacing_possible(server, name, victims)
        (log.debug if in_one else log.info)(
            "loading %s on %s (%d bytes), evicting %s", name, server.name, size_bytes,
            victims or "nothing")

        # 1. Room.  Victims a single request can replace (variants of the newcomer's family,
        # in their slots) go with the load: Triton never holds both, nothing to wait for.
        replacing = None
        if in_one:
            self.room.send(server, name, size_bytes)
            # Listed as the victims' unload now, before any await: a load of a victim waits.
            replacing = self.unloader.replace(server, victims, name)
            replacing.add_done_callback(retrieve)  # raised in step 2
        else:
            # The victims' unloads run; the load is sent once Triton confirms room for it, or
            # at once where measured free memory holds it (overlap, package docstring).  A
            # victim that does not free in time keeps its memory counted.
            evictions = [self.unloader.unload_now(server, v, reason="evicted") for v in victims]
            for fut in evictions:
                fut.add_done_callback(retrieve)  # failures are raised below or logged
            try:
                overlapped = await self.wait_for_room(
                    server, name, size_bytes, evictions,
                    # The longest an unload in progress takes before it fails on its own.
                    time.monotonic() + self.config.drain_timeout_s + self.config.unload_timeout_s,
                    room_bytes, room_slots, pool)
            except BaseException as exc:
                self.room.unqueue(server, name)
                self.keeping.release_warm(name)
                rec.move(previous_state if previous_state not in (ModelState.LOADING, ModelState.UNLOAD_FAILED)
                         else ModelState.WARM, server=None)
                undo_pool()
                self.keeping.metrics.loads.labels(server.name, "evict_failed").inc()
                if isinstance(exc, ControlPlaneError):
                    raise OperationTimeout(
                        f"could not free room for {name} on {server.name}: {exc}") from exc
                raise
            # No await between the room check and this: the next waiter sees this load as held.
            self.room.send(server, name, size_bytes)
            if overlapped:
                log.info("loading %s on %s while %s still shut down: measured free memory holds it",
                         name, server.name, ", ".join(v for v, f in zip(victims, evictions) if not f.done())
                         or "models of other loads")
        for _ in victims:
            self.keeping.metrics.evictions.labels(server.name).inc()

        # 2. Load and warm up.
        start = time.monotonic()
        rec.loads += 1
        try:
            async with self.keeping.meter(server, name).measuring(server, name) as measured:
                if replacing is not None:
                    await replacing
                else:
                    await server.admin.load(name)
                with tracing.span("warm_up", model=name):
                    warmup = await self.warm_up(server, name)
            if measured.bytes is not None:
                await self._fit_measured(server, rec, measured.bytes)
        except BaseException as exc:
            self.room.finish(name)
            await self._undo_failed_load(server, rec, exc)
            self.settle_pool(server, pool)
            raise
        self.room.finish(name)
        self.settle_pool(server, pool)
        rec.load_time_s = time.monotonic() - start
        rec.warmup = warmup
        if not warmup.get("ok", True):
            self.keeping.metrics.warmup_failures.labels(server.name).inc()
            log.warning("%s is served, but its synthetic warm-up failed: %s", name, warmup.get("error"))
        if rec.server != server.name or rec.state != ModelState.LOADING:
            # Its server was declared down while it loaded (its models forgotten, this one
            # perhaps placed elsewhere since): what that server holds is the reconcile's.
            raise ModelLoadFailed(f"{server.name} was declared down while {name} loaded on it; "
                                  "retry (it is placed on a server that is up)")
        rec.move(ModelState.READY)
        # Used now (it was loaded to be used): the newest in the policy's order before the
        # headroom picks its victim, which must never be the model just loaded.
        self.recency.touch(name)
        self.unloader.maintain_headroom(server)
        self.keeping.metrics.loads.labels(server.name, "ok").inc()
        self.keeping.metrics.load_seconds.labels(server.name).observe(rec.load_time_s)
        self.keeping.save_row(name, last_used=rec.last_used, load_time_s=rec.load_time_s,
                       memory_bytes=rec.memory_bytes, server=server.name, failure=None)
        log.info("loaded %s on %s in %.2fs%s", name, server.name, rec.load_time_s,
                 f" in place of {', '.join(victims)}" if replacing is not None else "")
        for listener in self.book.load_listeners:
            listener(name, rec)
        return rec

    async def _fit_measured(self, server: TritonServer, rec: ModelRecord, measured_bytes: int) -> None:
        """Account the size NVML measured; evict more when the model no longer fits, or
        raise CapacityExhausted (the caller unloads it) when nothing can make room."""
        async with self.tasks.lock:
            victims = plan_measured(server.planner, rec.name, measured_bytes)
            for v in victims:
                # Its room already went to this model's growth: no load may plan on it.
                self.book.lookup(v).move(ModelState.UNLOADING, room_promised=False)
            rec.resize(measured_bytes)
        if victims:
            log.info("%s measured %d bytes on %s: evicting %s", rec.name, measured_bytes,
                     server.name, victims)
            await asyncio.gather(*(self.unloader.unload_now(server, v, reason="evicted") for v in victims),
                                 return_exceptions=True)  # a failed one stays counted

    async def wait_for_room(self, server: TritonServer, name: str, size_bytes: int,
                             evictions: list[asyncio.Future], deadline: float,
                             room_bytes: int | None = None, room_slots: int = 1,
                             pool: ModelRecord | None = None) -> bool:
        """Wait until the load of ``name`` may be sent to Triton.  False: Triton's held room
        fits it; True: it starts before its victims are confirmed gone (overlap).
        ``room_bytes`` / ``room_slots``: the server room its load takes; ``pool``: the
        family whose slot it takes, free once no more variants hold its slots than it has
        (a leaving one's evict is done).

        Raises the first failed eviction of its own, or OperationTimeout when the room is
        held by models no unload is freeing (an unload failed: its room stays counted) or
        is not freed by ``deadline``."""
        room_bytes = size_bytes if room_bytes is None else room_bytes
        while True:
            for fut in evictions:
                if fut.done() and not fut.cancelled() and fut.exception() is not None:
                    raise fut.exception()
            slot_free = pool is None or server.planner.members(pool.name) <= pool.slots
            if slot_free and (room_slots == 0 or self.room.fits_held(server, room_bytes, room_slots)):
                return False
            # A fixed-size slot (a family's variant) is free only once its evict is done.
            if server.admin.measured(name) and self.room.fits_measured(server, size_bytes):
                return True
            freeing = [t for n, t in self.tasks.unloads.items()
                       if not t.done() and (r := self.book.find(n)) is not None
                       and r.server == server.name]
            if not freeing:
                raise OperationTimeout(
                    f"its room on {server.name} is held by models whose unload did not complete; "
                    "they stay counted until Triton confirms them gone (mmctl status)")
            remaining_s = deadline - time.monotonic()
            if remaining_s <= 0:
                raise OperationTimeout(f"Triton did not confirm room for {name} in time")
            await asyncio.wait(freeing, return_when=asyncio.FIRST_COMPLETED,
                               timeout=min(remaining_s, ROOM_POLL_S) if self.room.free_memory else remaining_s)

    def reserve_pool(self, server: TritonServer, name: str, size_bytes: int, key: str | None = None):
        """A family's variant takes one slot's room, as a model takes its own; when its load
        also loads the family there (or grows it to more slots), the family's record is
        reserved here.  Call under the lock, right after placement.  Returns (the family's
        pool record or None, its undo, server bytes and places reserved).  ``key``: the
        planner's key of the load (an extra copy's; default ``name``)."""
        pool = slot_pool(server.admin, name)
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

    def settle_pool(self, server: TritonServer, pool: ModelRecord | None) -> None:
        """After a variant's load (done or failed): its family's slots as the server's model
        control knows them now (loaded with so many slots, or not at all)."""
        if pool is None or pool.server not in (None, server.name):
            return
        slots = server.admin.loaded_slots(pool.holder)
        if slots is None:
            if pool.state == ModelState.LOADING and server.planner.members(pool.name) == 0:
                pool.move(ModelState.WARM, server=None)  # never loaded: its room is free
            return
        if pool.state in (ModelState.LOADING, ModelState.READY, ModelState.WARM):
            pool.move(ModelState.READY, server=server.name, memory_bytes=slots * pool.slot_bytes)

    def _room_is_busy(self, name: str) -> bool:
        """Room held by loads/unloads in progress or by requests (not by pins or failures)
        that ``name`` could get once they end.  A shadow can only get room that an unload
        frees or that a shadow holds: room of a serving model that is loading or in use
        never becomes its."""
        limit = victim_priority_limit(self.priority_of(name))
        for server in self.servers.values():
            for r in server.planner.residents.values():
                rec = self.book.find(r.key)
                if r.evictable or r.pinned or rec is None or rec.state == ModelState.UNLOAD_FAILED:
                    continue
                if limit is None or rec.state == ModelState.UNLOADING or r.priority <= limit:
                    return True
        return False

    async def warm_up(self, server: TritonServer, name: str) -> dict:
        """Warm ``name`` up as the model says (warmup.warm_up); the result is what
        ``health`` shows."""
        return await warm_up(server, name, self.config, self.warmup_enabled, self.clock)

    async def _undo_failed_load(self, server: TritonServer, rec: ModelRecord, exc: BaseException) -> None:
        """Unload whatever Triton kept and mark the model failed; memory freed once confirmed."""
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
            return
        try:
            await server.admin.unload(rec.name)
            await server.admin.wait_unavailable(rec.name, self.config.unload_timeout_s)
            await self.keeping.meter(server, rec.name).released(server, rec.name)
        except ControlPlaneError as cleanup_exc:
            # Triton may still hold it: keep the bytes counted, the reconcile loop retries.
            log.error("%s failed (%s) and could not be unloaded: %s", rec.name, reason, cleanup_exc)
            rec.move(ModelState.UNLOAD_FAILED)
            return
        self.keeping.release_warm(rec.name)
        rec.move(ModelState.FAILED, server=None)
        self.keeping.save_row(rec.name, failure=reason)
        log.warning("load of %s on %s failed: %s", rec.name, server.name, reason)
