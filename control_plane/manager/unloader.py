"""What leaves a server, and when: explicit unloads (with every copy), the headroom kept
free, empty families, and evicting down to the budget.  Each unload is carried out by the
executor (``Executor.unload_now``), as loads are: a model's memory counts as used until
Triton confirms it gone (package docstring)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from control_plane.manager.executor import Executor, retrieve
from control_plane.manager.fleet_state import Bookkeeping, ModelBook, TaskBoard
from control_plane.manager.manager_config import ManagerConfig
from control_plane.manager.records import ModelRecord, ModelState, TritonServer
from domain.errors import ControlPlaneError, InvalidInput

log = logging.getLogger(__name__)


class Unloader:
    def __init__(self, book: ModelBook, servers: dict[str, TritonServer], tasks: TaskBoard,
                 keeping: Bookkeeping, config: ManagerConfig, executor: Executor):
        self.book = book
        self.servers = servers
        self.tasks = tasks
        self.keeping = keeping
        self.config = config
        self.executor = executor  # carries each unload out (executor.py)

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
        unloads = [self.executor.unload_now(s, c, reason="requested") for s, c in extra]
        if server is not None:
            unloads.append(self.executor.unload_now(server, rec, reason="requested"))
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
        unloads += [self.executor.unload_now(s, c, reason="requested") for s, c in late]
        results = await asyncio.gather(*unloads, return_exceptions=True)
        failed = next((r for r in results if isinstance(r, BaseException)), None)
        if failed is not None:
            raise failed

    async def retry_unload(self, server: TritonServer, name: str) -> None:
        rec = self.book.find(name)
        if rec is None:
            return
        with contextlib.suppress(ControlPlaneError):
            await self.executor.unload_now(server, rec, reason="retry_after_failure")

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
            rec = self.book.lookup(victim)
            rec.move(ModelState.UNLOADING)
            try:
                await self.executor.unload_now(server, rec, reason="over_budget")
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
            self.executor.unload_now(server, rec, reason="empty").add_done_callback(retrieve)

    def maintain_headroom(self, server: TritonServer) -> None:
        """Start unloading the policy's next victims when the server's free room is below its
        headroom (eviction.CachePlanner.headroom_victims); returns at once, the unloads run
        in the background.  Synchronous: the choice and the marking see the same state."""
        if not server.up:
            return
        self.unload_empty_families(server)
        victims = server.planner.headroom_victims()
        recs = [self.book.lookup(v) for v in victims]
        for rec in recs:
            rec.move(ModelState.UNLOADING)
        if victims:
            log.info("%s: unloading %s to keep room for the next miss", server.name, ", ".join(victims))
        for rec in recs:
            self.executor.unload_now(server, rec, reason="headroom").add_done_callback(retrieve)
