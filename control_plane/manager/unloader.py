"""Unloads: explicit, evictions, headroom kept free, and evicting down to the budget.

A model's memory counts as used until Triton's index shows it UNAVAILABLE; an unload that
fails keeps the model's server and room (``failed``) until one succeeds (package
docstring)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from control_plane.manager.fleet_state import Bookkeeping, ModelBook, TaskBoard
from control_plane.manager.manager_config import ManagerConfig
from control_plane.manager.records import ModelRecord, ModelState, TritonServer
from domain.errors import ControlPlaneError, InvalidInput

log = logging.getLogger(__name__)


def retrieve(fut: asyncio.Future) -> None:
    """Done callback of an unload nobody awaits: its failure is logged where it happens."""
    if not fut.cancelled():
        fut.exception()


class Unloader:
    def __init__(self, book: ModelBook, servers: dict[str, TritonServer], tasks: TaskBoard,
                 keeping: Bookkeeping, config: ManagerConfig):
        self.book = book
        self.servers = servers
        self.tasks = tasks
        self.keeping = keeping
        self.config = config

    async def unload(self, rec: ModelRecord, force: bool = False) -> ModelRecord:
        """Unload ``rec``'s model (explicit request; the catalog found it) with every copy of
        it.  Pinned models are refused unless forced."""
        name = rec.name
        self.book.unloading.add(name)
        try:
            await self._unload_all(rec, name, force)
        finally:
            self.book.unloading.discard(name)
        return rec

    async def _unload_all(self, rec: ModelRecord, name: str, force: bool) -> None:
        if rec.pinned and not force:
            raise InvalidInput(f"{name} is pinned; unpin it first (mmctl unpin {name})")
        load = self.tasks.loads.get(name)
        if load is not None:
            with contextlib.suppress(ControlPlaneError):
                await asyncio.shield(load)
        async with self.tasks.lock:
            # A pin that arrived while this unload waited for the load wins: the pinned
            # model stays loaded instead of being unloaded under a pin.
            if rec.pinned and not force:
                raise InvalidInput(f"{name} was pinned while this unload waited for its load; "
                                   f"unpin it first (mmctl unpin {name})")
            # Its extra copies go with it (the target stays: its next load copies it again).
            extra = [(self.servers[c.server], c) for c in self.book.extra_copies(name)
                     if c.state in (ModelState.READY, ModelState.UNLOAD_FAILED)]
            for _server, copy in extra:
                copy.move(ModelState.UNLOADING)
            if (rec.state not in (ModelState.READY, ModelState.UNLOAD_FAILED, ModelState.UNLOADING)
                    or rec.server is None):
                server = None
            else:
                server = self.servers[rec.server]
                # On its way out it holds its room as busy, not as a pin (a forced unload of
                # a pinned model keeps the pin: the reconcile loads it again).  A failed
                # unload retried here promises no room: it stays held until Triton confirms
                # it gone.
                rec.move(ModelState.UNLOADING)
        unloads = [self.unload_now(s, c.name, reason="requested") for s, c in extra]
        if server is not None:
            unloads.append(self.unload_now(server, name, reason="requested"))
        # A copy still loading (mmctl scale) is unloaded once it is: an unload leaves none.
        deadline = time.monotonic() + self.config.unload_timeout_s
        while (any(c.state == ModelState.LOADING for c in self.book.extra_copies(name))
               and time.monotonic() < deadline):
            await asyncio.sleep(0.05)
        async with self.tasks.lock:
            late = [(self.servers[c.server], c) for c in self.book.extra_copies(name)
                    if c.state == ModelState.READY]
            for _server, copy in late:
                copy.move(ModelState.UNLOADING)
        unloads += [self.unload_now(s, c.name, reason="requested") for s, c in late]
        results = await asyncio.gather(*unloads, return_exceptions=True)
        failed = next((r for r in results if isinstance(r, BaseException)), None)
        if failed is not None:
            raise failed

    def unload_now(self, server: TritonServer, name: str, reason: str) -> asyncio.Future:
        task = self.tasks.unloads.get(name)
        if task is None:
            task = asyncio.get_running_loop().create_task(self._do_unload(server, name, reason))
            self.tasks.unloads[name] = task
            task.add_done_callback(lambda _t, n=name: self.tasks.unloads.pop(n, None))
        return asyncio.shield(task)

    async def _do_unload(self, server: TritonServer, name: str, reason: str) -> None:
        rec = self.book.lookup(name)
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

    def replace(self, server: TritonServer, victims: list[str], name: str) -> asyncio.Future:
        """Evict ``victims`` and load ``name`` on ``server`` as one request
        (``TritonAdmin.replaces_in_one``: a variant into the slots of its family's variants).
        The victims' unloads are this one task, listed for each of them (a load of a victim
        waits for it); it raises the load's failure, after the victims are unloaded one by
        one as if the request had not been."""
        task = asyncio.get_running_loop().create_task(self._do_replace(server, victims, name))
        for victim in victims:
            self.tasks.unloads[victim] = task
            task.add_done_callback(lambda done, n=victim: self.tasks.unloads.pop(n, None)
                                   if self.tasks.unloads.get(n) is done else None)
        return asyncio.shield(task)

    async def _do_replace(self, server: TritonServer, victims: list[str], name: str) -> None:
        recs = [self.book.records[v] for v in victims]
        for rec in recs:
            rec.move(ModelState.UNLOADING)
        await self._drain(recs)
        start = time.monotonic()
        try:
            await server.admin.load_replacing(name, victims)
        except ControlPlaneError:
            # Whether the victims left with it is unknown: unload each on its own (a freed
            # slot's evict is a no-op), so each ends warm, or holds its room until confirmed.
            await asyncio.gather(*(self._do_unload(server, v, "evicted") for v in victims),
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
        await self.keeping.meter(server, triton_name).released(server, triton_name)
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

    async def retry_unload(self, server: TritonServer, name: str) -> None:
        with contextlib.suppress(ControlPlaneError):
            await self.unload_now(server, name, reason="retry_after_failure")

    async def enforce_capacity(self, server: TritonServer) -> None:
        """After adopting what Triton had loaded, evict down to the budget (unpinned, LRU)."""
        cap = server.planner.capacity
        while True:
            # A load in progress is reserved while its victims still count until Triton frees
            # them: that transient overshoot is by design, not drift.
            if self.tasks.loads or self.tasks.unloads:
                return
            over_slots = cap.max_slots is not None and server.planner.used_slots > cap.max_slots
            over_bytes = cap.max_bytes is not None and server.planner.used_bytes > cap.max_bytes
            if not (over_slots or over_bytes):
                return
            # What frees room: a model, a copy or a variant in its slot; the lowest stage
            # priority first (a shadow before production, as a miss's plan picks), then in
            # the policy's order.
            residents = server.planner.residents
            victim = min((k for k in server.planner.policy.victim_order()
                          if server.planner.frees_room(k)),
                         key=lambda k: residents[k].priority, default=None)
            if victim is None:
                log.error("%s is over its budget (%s) with only pinned or busy models left",
                          server.name, cap.describe())
                return
            self.book.lookup(victim).move(ModelState.UNLOADING)
            try:
                await self.unload_now(server, victim, reason="over_budget")
            except ControlPlaneError:
                return

    def unload_empty_families(self, server: TritonServer) -> None:
        """Unload each family model on ``server`` that no variant holds or loads into: its
        slots' room went back one slot at a time as its variants left, and its process goes
        with the last of them.  A variant that arrives meanwhile waits for the unload, then
        loads the family again.  Synchronous, like ``maintain_headroom``."""
        for key in server.planner.empty_pools():
            rec = self.book.find(key)
            if rec is None or rec.state != ModelState.READY or key in self.tasks.unloads:
                continue
            rec.move(ModelState.UNLOADING)
            log.info("%s: no variant left in the slots of family %s; unloading it",
                     server.name, rec.holder)
            self.unload_now(server, key, reason="empty").add_done_callback(retrieve)

    def maintain_headroom(self, server: TritonServer) -> None:
        """Start unloading the policy's next victims when the server's free room is below its
        headroom (eviction.CachePlanner.headroom_victims); returns at once, the unloads run
        in the background.  Synchronous: the choice and the marking see the same state."""
        if not server.up:
            return
        self.unload_empty_families(server)
        victims = server.planner.headroom_victims()
        for v in victims:
            self.book.lookup(v).move(ModelState.UNLOADING)
        if victims:
            log.info("%s: unloading %s to keep room for the next miss", server.name, ", ".join(victims))
        for v in victims:
            self.unload_now(server, v, reason="headroom").add_done_callback(retrieve)
