"""Loads: one task per model, placement and reservation under the lock, room, warm-up,
and undoing exactly what was done when a step fails (package docstring)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

from control_plane.eviction import victim_priority_limit
from control_plane.manager.executor import Executor, replacing_possible
from control_plane.manager.fleet_state import Bookkeeping, ModelBook, TaskBoard
from control_plane.manager.known_models import Catalog
from control_plane.manager.manager_config import ManagerConfig
from control_plane.manager.placement import Placer
from control_plane.manager.recency import Recency
from control_plane.manager.records import (
    ModelRecord,
    ModelState,
    Stager,
    TritonServer,
)
from control_plane.manager.room import ROOM_POLL_S, RoomLedger
from control_plane.manager.unloader import Unloader
from domain import tracing
from domain.errors import (
    CapacityExhausted,
    ControlPlaneError,
    ModelLoadFailed,
    ModelNotFound,
)

log = logging.getLogger(__name__)

class Loader:
    def __init__(self, book: ModelBook, servers: dict[str, TritonServer], tasks: TaskBoard,
                 keeping: Bookkeeping, config: ManagerConfig, clock: Callable[[], float],
                 stager: Stager | None, placer: Placer, priority_of: Callable[[str], int],
                 room: RoomLedger, catalog: Catalog, recency: Recency, unloader: Unloader,
                 executor: Executor):
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
        self.catalog = catalog
        self.recency = recency
        self.unloader = unloader  # keeps the headroom free
        self.executor = executor  # carries a placement's plan out (executor.py)

    async def ensure(self, name: str, retry_failed: bool = False) -> ModelRecord:
        """Return once ``name`` is READY on some server, loading it if needed.  ``name`` is
        valid (``ModelManager.ensure`` checks a caller's; the others come from records)."""
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
        try:
            return self.placer.place(name, size_bytes, self.servers.values(),
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
                await self.executor.unload_now(held_by, rec, reason="retry_after_failure")
            except ControlPlaneError as exc:
                raise ModelLoadFailed(
                    f"{name} may still be loaded on {held_by.name} ({exc.message}); it is not "
                    f"loaded anywhere else until {held_by.name} confirms it gone; retrying "
                    f"in {self.config.failure_backoff_s:.0f}s") from exc
        if self.stager is not None:
            # Cold -> warm before anything is reserved: a failed download holds no capacity.
            self.stager.set_busy(name, True)
            try:
                size_bytes = await self.stager.stage(name)  # traced by the tier
            except BaseException as exc:
                self._unmark_busy(name)
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
            await place.behind_promised(ROOM_POLL_S)
            while True:
                async with self.tasks.lock:
                    place.trying()
                    # Re-check after the lock: someone may have loaded it meanwhile.
                    if rec.state == ModelState.READY:
                        place.pass_on()  # the room it was woken for is the next waiter's
                        return rec
                    try:
                        server, victims = self.place(name, size_bytes)
                    except CapacityExhausted:
                        place.pass_on()  # woken for room it cannot use: the next waiter may
                        # Room held only by loads/unloads in progress frees up in seconds: wait
                        # for one of them instead of failing; room held by pins is final.
                        busy = self._room_is_busy(name)
                        if not busy or time.monotonic() >= deadline:
                            self._unmark_busy(name)
                            raise
                        turn = place.turn()
                    else:
                        rec.failure = None
                        res = self.executor.commit(server, rec, name, size_bytes, victims)
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

        try:
            warmup = await self.executor.carry_out(res)
        except BaseException:
            if res.undone:  # nothing of it holds room: its files may leave the warm tier
                self._unmark_busy(name)
            raise
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
                 f" in place of {', '.join(victims)}" if res.replacing is not None else "")
        for listener in self.book.load_listeners:
            listener(name, rec)
        return rec

    def _unmark_busy(self, name: str) -> None:
        """The warm tier may drop ``name``'s files again: this load marked them busy (before
        it staged them) and holds no room now.  (Once loaded, its unload unmarks them.)"""
        if self.stager is not None:
            self.stager.set_busy(name, False)

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
        return await self.executor.warm_up(server, name)
