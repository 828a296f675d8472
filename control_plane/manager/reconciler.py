"""The reconcile loop: each pass re-reads every Triton's index and corrects what drifted
(adopts what Triton loaded, forgets what it dropped, restarts a managed Triton that died,
evicts down to the budget, loads pinned models again), and what follows a server's health
(``health.Health``): a local Triton that is down is killed (a frozen one never exits) and
started again, a down server's models are placed on the others, and the copies a server
kept while it was down are unloaded when it answers again."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

from control_plane.manager.copies import Copies
from control_plane.manager.fleet_state import Bookkeeping, ModelBook, TaskBoard
from control_plane.manager.health import Health
from control_plane.manager.known_models import Catalog
from control_plane.manager.manager_config import ManagerConfig
from control_plane.manager.pins import Pins
from control_plane.manager.recency import Recency
from control_plane.manager.records import (
    ModelRecord,
    ModelState,
    ServerHealth,
    TritonServer,
)
from control_plane.manager.unloader import Unloader
from control_plane.triton.admin import TritonModelState
from domain.errors import ControlPlaneError, TritonUnavailable

log = logging.getLogger(__name__)

# How often a reconcile pass reads a server's whole repository index (new folders join the
# catalogue; a name asked for that is not known yet is looked up at once, Catalog.known).
CATALOG_READ_S = 30.0


class Reconciler:
    def __init__(self, book: ModelBook, servers: dict[str, TritonServer], tasks: TaskBoard,
                 keeping: Bookkeeping, config: ManagerConfig, clock: Callable[[], float],
                 catalog: Catalog, recency: Recency, unloader: Unloader, pins: Pins,
                 copies: Copies | None = None):
        self.book = book
        self.servers = servers
        self.tasks = tasks
        self.keeping = keeping
        self.config = config
        self.clock = clock
        self.catalog = catalog
        self.recency = recency
        self.unloader = unloader
        self.pins = pins
        self.copies = copies  # models' extra copies: adopted, forgotten and converged here
        self._catalog_read_at: dict[str, float] = {}  # server -> monotonic; its whole index read
        self.health = Health(servers, config, keeping.metrics, on_down=self._server_down,
                             on_up=self._server_up)
        self._strays: set[tuple[str, str]] = set()  # (server, model) unloads in flight

    async def start(self) -> None:
        """Reconcile with every Triton, then load the pinned models; the liveness probes
        run from then on, beside the passes (``Health.run_forever``)."""
        await self.step()
        await self.pins.load_pinned()
        self.tasks.spawn(self.health.run_forever(), forever=True)

    async def step(self) -> None:
        """One reconcile pass: re-read each Triton's index and correct what drifted.  The
        servers are reconciled side by side: one that is slow to answer (frozen until the
        probes declare it down) holds up no other."""
        async def reconcile(server: TritonServer) -> None:
            try:
                await self._reconcile_server(server)
            except Exception:  # one failing server never stops the loop
                log.exception("reconcile of %s failed", server.name)
            self.unloader.maintain_headroom(server)

        await asyncio.gather(*(reconcile(s) for s in list(self.servers.values())))
        self.pins.repair_pins()
        if self.copies is not None:
            self.copies.converge_all()

    async def _reconcile_server(self, server: TritonServer) -> None:
        if server.process is not None and not server.process.alive():
            await self._restart_triton(server)
            return
        if server.health is ServerHealth.SUSPECT:
            return  # its index may not come for health_s: the probes decide first
        if not server.up and not await self.health.probe(server):
            self._maybe_lost(server)  # still down: asked by a short probe, not an index read
            return
        # The whole index (every folder of the repository: new models join the catalogue)
        # every CATALOG_READ_S; in between only what is loaded, so a pass costs the same
        # with ten or ten thousand models in the repository.
        whole = time.monotonic() - self._catalog_read_at.get(server.name, -CATALOG_READ_S) >= CATALOG_READ_S
        read_at = time.monotonic()  # a model that changed state after this: the index may not show it
        try:
            index = await server.admin.index(ready_only=not whole)
        except TritonUnavailable as exc:
            # Confirmed by a probe: down at once, as for a request that could not reach it.
            if await self.health.probe(server) is False:
                self.health.unreachable(server, f"its repository index could not be read ({exc.message})")
                self._maybe_lost(server)
            return
        self.health.answered(server)
        self.book.known_names.update(index)
        if whole:
            self._catalog_read_at[server.name] = time.monotonic()

        def ours(rec: ModelRecord | None) -> bool:
            return (rec is not None and rec.server == server.name
                    and rec.state in (ModelState.READY, ModelState.UNLOAD_FAILED))

        # Models to adopt are sized first, in a thread (a file walk), outside the lock.
        to_adopt = [n for n, e in index.items()
                    if e.state == TritonModelState.READY and not ours(self.book.records.get(n))]
        sizes = (await asyncio.to_thread(lambda: {n: self.catalog.artifact_bytes(n) for n in to_adopt})
                 if to_adopt else {})
        busy = set(self.tasks.loads) | set(self.tasks.unloads)
        async with self.tasks.lock:
            # Copies left behind that are gone, or placed here again: nothing to unload.
            for name in list(server.left_behind):
                entry, rec = index.get(name), self.book.records.get(name)
                if (entry is None or entry.state != TritonModelState.READY
                        or (rec is not None and rec.server == server.name)):
                    server.left_behind.discard(name)
            for name, entry in index.items():
                if name in busy:
                    continue
                rec = self.book.record(name)
                if (entry.state == TritonModelState.READY and rec.state == ModelState.READY
                        and rec.server != server.name and name not in server.left_behind):
                    # Loaded here too: an extra copy (an earlier life's, or Triton's own),
                    # counted here; the copies' converge keeps or unloads it.  Whether the
                    # model's own copy moved since the read does not matter to this one.
                    self._adopt_copy(server, name, sizes.get(name), read_at, busy)
                    continue
                if rec.moved_at >= read_at:
                    # Changed after the index was read (an unload that completed meanwhile
                    # would be adopted back, counted and served from an empty slot): the
                    # next pass sees what came of it.
                    continue
                if entry.state == TritonModelState.READY and not ours(rec):
                    if name in server.left_behind and rec.server is not None:
                        # Placed elsewhere while this server was down: drop the copy it kept
                        # (else loaded twice, counted once).  One placed nowhere is adopted.
                        self._unload_stray(server, name)
                        continue
                    size = sizes.get(name)
                    if size is None:
                        continue  # it changed while the others were sized: the next pass
                    if rec.state != ModelState.WARM and rec.server is not None:
                        continue  # it has a copy elsewhere (loading, unloading): not adopted
                    rec.move(ModelState.READY, server=server.name, memory_bytes=size)
                    rec.warmup = rec.warmup or {"ok": True, "latency_ms": None,
                                                "checked_at": self.clock(), "error": None,
                                                "note": "adopted from Triton's index"}
                    log.warning("adopted %s: Triton %s has it loaded", name, server.name)
                elif (entry.state == TritonModelState.READY
                        and rec.state == ModelState.UNLOAD_FAILED and rec.server == server.name):
                    # Its unload (after a failure) did not complete: try again after the
                    # backoff, so the memory is freed and counted free once Triton confirms.
                    if (rec.failed_at is None
                            or time.monotonic() - rec.failed_at >= self.config.failure_backoff_s):
                        self.tasks.spawn(self.unloader.retry_unload(server, name))
                elif entry.state != TritonModelState.READY and ours(rec):
                    if entry.state in (TritonModelState.LOADING, TritonModelState.UNLOADING):
                        continue
                    self.keeping.release_warm(name)
                    if rec.state == ModelState.READY:
                        log.warning("%s is no longer loaded on %s (%s)", name, server.name,
                                    entry.reason or entry.state.value)
                        rec.move(ModelState.WARM, server=None)
                    else:  # its failed unload completed after all; the failure stays visible
                        rec.move(ModelState.FAILED, server=None)
            # What this server holds room for and Triton no longer lists as loaded (the
            # models placed on a server are its planner's residents).
            for name in list(server.planner.residents):
                rec = self.book.records.get(name)
                if (rec is None or rec.server != server.name or name in index or name in busy
                        or rec.moved_at >= read_at):  # loaded while the index was read
                    continue
                self.keeping.release_warm(name)
                if rec.state == ModelState.READY:
                    log.warning("%s is no longer loaded on %s", name, server.name)
                # A failed model keeps its failure visible; any other is warm again.
                rec.move(ModelState.FAILED if rec.state in (ModelState.FAILED, ModelState.UNLOAD_FAILED)
                         else ModelState.WARM, server=None)
            self._reconcile_pools(server, read_at, busy)
            self._reconcile_copies(server, index, read_at, busy)
        self.keeping.update_gauges(server)
        with contextlib.suppress(ControlPlaneError):
            await self.recency.refresh_usage(server)
        await self.unloader.enforce_capacity(server)

    def _adopt_copy(self, server: TritonServer, name: str, size: int | None, read_at: float,
                    busy: set[str]) -> None:
        copy = self.book.extra_copy(name, server.name)
        if (size is None or copy.name in busy or copy.moved_at >= read_at
                or copy.state not in (ModelState.WARM, ModelState.FAILED)):
            return
        copy.move(ModelState.READY, server=server.name, memory_bytes=size)
        copy.warmup = {"ok": True, "latency_ms": None, "checked_at": self.clock(), "error": None,
                       "note": "adopted from Triton's index"}
        log.warning("adopted a copy of %s: Triton %s has it loaded", name, server.name)

    def _reconcile_copies(self, server: TritonServer, index: dict, read_at: float,
                          busy: set[str]) -> None:
        """Extra copies on ``server`` that Triton no longer lists as loaded leave it; one
        whose unload failed is unloaded again after the backoff.  Call under the lock."""
        for copy in self.book.every_extra_copy():
            if copy.server != server.name or copy.name in busy or copy.moved_at >= read_at:
                continue
            entry = index.get(copy.triton_name)
            loaded = entry is not None and entry.state == TritonModelState.READY
            if copy.state == ModelState.UNLOAD_FAILED and loaded:
                if (copy.failed_at is None
                        or time.monotonic() - copy.failed_at >= self.config.failure_backoff_s):
                    self.tasks.spawn(self.unloader.retry_unload(server, copy.name))
            elif copy.state in (ModelState.READY, ModelState.UNLOAD_FAILED) and not loaded:
                if entry is not None and entry.state in (TritonModelState.LOADING,
                                                         TritonModelState.UNLOADING):
                    continue
                log.warning("the copy of %s is no longer loaded on %s", copy.triton_name,
                            server.name)
                copy.move(ModelState.WARM, server=None)

    def _reconcile_pools(self, server: TritonServer, read_at: float, busy: set[str]) -> None:
        """The families loaded on ``server`` (as its index read just now found them) hold their
        slots' room: one loaded by an earlier life, or left empty, is counted; one Triton no
        longer has frees its room.  Call under the lock."""
        listed = server.admin.slot_pools()
        for pool in listed.values():
            rec = self.book.pool(server.name, pool)
            if rec.name in busy or rec.moved_at >= read_at:
                continue
            if rec.state == ModelState.UNLOAD_FAILED and rec.server == server.name:
                if (rec.failed_at is None
                        or time.monotonic() - rec.failed_at >= self.config.failure_backoff_s):
                    self.tasks.spawn(self.unloader.retry_unload(server, rec.name))
                continue
            if rec.state in (ModelState.WARM, ModelState.FAILED, ModelState.READY) and (
                    rec.server != server.name or rec.slots != pool.slots
                    or rec.state != ModelState.READY):
                if rec.server not in (None, server.name):
                    continue
                rec.move(ModelState.READY, server=server.name,
                         memory_bytes=pool.slots * max(pool.slot_bytes, 1))
        for key, rec in list(self.book.pools.items()):
            if (rec.server != server.name or rec.holder in listed or key in busy
                    or rec.moved_at >= read_at):
                continue
            if rec.state == ModelState.LOADING:
                # Reserved by a first load that failed while its variant stayed a member (an
                # unload that failed too); once no variant holds or loads into it, nothing
                # settles it but this (a load in progress keeps its variant a member).
                if server.planner.members(rec.name):
                    continue
                log.info("family %s was never loaded on %s and no variant holds its slots: "
                         "their room is free", rec.holder, server.name)
            elif rec.state not in (ModelState.READY, ModelState.UNLOAD_FAILED):
                continue
            else:
                log.info("family %s is no longer loaded on %s: its slots' room is free",
                         rec.holder, server.name)
            rec.move(ModelState.WARM, server=None)

    async def _restart_triton(self, server: TritonServer) -> None:
        """Relaunch a managed Triton that died (or was killed, frozen); the event loop keeps
        serving meanwhile.  Restarts that fail back off (2 s doubling to 60 s)."""
        if not self.health.may_restart(server):
            return
        log.error("tritonserver %s exited (code %s); restarting it", server.name,
                  server.process.proc.returncode if server.process.proc else None)
        self.health.unreachable(server, "tritonserver exited")
        self._forget_server_models(server, "tritonserver exited")
        # Popen on the loop thread (PR_SET_PDEATHSIG follows the forking thread); the
        # readiness wait runs in a worker thread so requests for other servers go on.
        server.process.launch()
        try:
            await asyncio.to_thread(server.process.wait_ready, server.process.cfg.ready_timeout_s)
        except TritonUnavailable as exc:
            delay_s = self.health.restart_failed(server)
            log.error("restart of %s failed (%s); next try in %.0fs", server.name, exc.message, delay_s)
            await asyncio.to_thread(server.process.stop)
            return
        self.health.restarted(server)
        # Up once it answers its probe (the channel the probes and loads use), not before:
        # a probe that finds the channel still reconnecting is no reason to kill it again.
        await self.health.probe(server)

    def _server_down(self, server: TritonServer, why: str) -> None:
        """``server`` became down (``Health.on_down``).  A Triton registered by address keeps
        its models until a request needs one (``place_off_down``) or it is lost
        (``_maybe_lost``): its node may answer again in a moment.  A local Triton's models
        are placed elsewhere now; one still running is frozen or broken and never exits on
        its own: it is killed, and the next pass starts it again (``_restart_triton``)."""
        if server.process is None:
            return
        self._forget_server_models(server, f"tritonserver {server.name} is down: {why}")
        self.tasks.spawn(self.pins.load_pinned())
        if server.process.alive():
            self.tasks.spawn(self._kill(server))

    async def _kill(self, server: TritonServer) -> None:
        log.error("tritonserver %s (pid %s) does not answer: killing it (SIGKILL); it is started "
                  "again", server.name, server.process.pid)
        try:
            await asyncio.to_thread(server.process.kill_unanswering)
        except Exception:  # it stays down; the next pass tries again
            log.exception("killing tritonserver %s failed", server.name)

    def _server_up(self, server: TritonServer) -> None:
        """``server`` answers again (``Health.on_up``): pinned models may go back to it; the
        copies it kept of models placed elsewhere meanwhile are unloaded by the next pass."""
        self.tasks.spawn(self.pins.load_pinned())

    def _maybe_lost(self, server: TritonServer) -> None:
        """A Triton that stays down is lost: what it held is placed on the others (a local
        one's models were already, when it went down)."""
        if not self.health.lost_now(server):
            return
        held = sorted(n for n, r in self.book.records.items() if r.server == server.name)
        log.error("placing the %d model(s) of lost Triton %s elsewhere", len(held), server.name)
        self._forget_server_models(server, f"server {server.name} lost")
        self.tasks.spawn(self.pins.load_pinned())

    async def check_reachable(self, name: str) -> None:
        """A router could not reach server ``name``: ask it now instead of at the next pass.
        One that does not answer either is down (and, past ``server_lost_after_s``, lost).
        Probes asked for meanwhile share one."""
        server = self.servers.get(name)
        if server is None or not server.up:
            return
        if await self.health.probe(server) is not False or not server.up:
            return
        self.health.unreachable(server, "a request could not reach it, nor a probe")
        self._maybe_lost(server)

    def place_off_down(self, rec: ModelRecord) -> None:
        """A request needs ``rec``'s model and its server is down: forget it there, so the
        next ensure places it on a server that is up.  The down server keeps its other
        models until it is lost (``_maybe_lost``); the copy it kept is unloaded when it
        answers again (``_reconcile_server``)."""
        server = self.servers.get(rec.server) if rec.server is not None else None
        if server is None or server.up or rec.state != ModelState.READY:
            return
        if not any(other.up for other in self.servers.values() if other is not server):
            return  # nowhere else to go: it stays where it is until its server answers again
        log.warning("%s is needed by a request and its server %s is down: placing it on "
                    "another server", rec.name, server.name)
        server.left_behind.add(rec.name)  # its copy there is unloaded when it answers again
        self.keeping.release_warm(rec.name)
        rec.failure = f"server {server.name} was down when a request needed it"
        rec.move(ModelState.WARM, server=None)

    def _unload_stray(self, server: TritonServer, name: str) -> None:
        """Unload ``server``'s copy of ``name`` in the background (one at a time); the next
        pass tries again while its index still lists it."""
        key = (server.name, name)
        if key in self._strays:
            return
        self._strays.add(key)

        async def unload() -> None:
            try:
                await server.admin.unload(name)
                log.warning("unloaded %s from %s: it was placed elsewhere while %s was down",
                            name, server.name, server.name)
            except ControlPlaneError as exc:
                log.warning("could not unload the stray copy of %s from %s: %s", name,
                            server.name, exc.message)
            finally:
                self._strays.discard(key)

        self.tasks.spawn(unload())

    def _forget_server_models(self, server: TritonServer, reason: str) -> None:
        for name, rec in self.book.records.items():
            if rec.server == server.name:
                server.left_behind.add(name)  # a copy it keeps is unloaded when it answers
                self.keeping.release_warm(name)
                rec.failure = reason
                rec.move(ModelState.WARM, server=None)
        for rec in self.book.pools.values():  # its families' slots go with it
            if rec.server == server.name:
                rec.move(ModelState.WARM, server=None)
        for rec in self.book.every_extra_copy():  # and its extra copies (placed again elsewhere)
            if rec.server == server.name:
                server.left_behind.add(rec.triton_name)
                rec.move(ModelState.WARM, server=None)
        self.keeping.update_gauges(server)

