"""The reconcile loop: each pass re-reads every Triton's index and corrects what drifted
(adopts what Triton loaded, forgets what it dropped, restarts a managed Triton that died,
evicts down to the budget, loads pinned models again)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from control_plane.domain.errors import ControlPlaneError, TritonUnavailable
from control_plane.eviction import Resident
from control_plane.manager.catalog import Catalog
from control_plane.manager.pins import Pins
from control_plane.manager.recency import Recency
from control_plane.manager.records import ModelRecord, ModelState, TritonServer
from control_plane.manager.state import ManagerState
from control_plane.manager.unloader import Unloader
from control_plane.triton.admin import TritonModelState

log = logging.getLogger(__name__)

# How often a reconcile pass reads a server's whole repository index (new folders join the
# catalogue; a name asked for that is not known yet is looked up at once, Catalog.known).
CATALOG_READ_S = 30.0


class Reconciler:
    def __init__(self, state: ManagerState, catalog: Catalog, recency: Recency,
                 unloader: Unloader, pins: Pins):
        self.state = state
        self.catalog = catalog
        self.recency = recency
        self.unloader = unloader
        self.pins = pins
        self._catalog_read_at: dict[str, float] = {}  # server -> monotonic; its whole index read
        self._probes: dict[str, asyncio.Task] = {}  # server name -> liveness probe a request asked for

    async def start(self) -> None:
        """Reconcile with every Triton, then load the pinned models."""
        await self.step()
        await self.pins.load_pinned()

    async def step(self) -> None:
        """One reconcile pass: re-read each Triton's index and correct what drifted."""
        for server in list(self.state.servers.values()):
            try:
                await self._reconcile_server(server)
            except Exception:  # one failing server never stops the loop
                log.exception("reconcile of %s failed", server.name)
            self.unloader.maintain_headroom(server)
        self.pins.repair_pins()

    async def _reconcile_server(self, server: TritonServer) -> None:
        if server.process is not None and not server.process.alive():
            await self._restart_triton(server)
            return
        # The whole index (every folder of the repository: new models join the catalogue)
        # every CATALOG_READ_S; in between only what is loaded, so a pass costs the same
        # with ten or ten thousand models in the repository.
        whole = time.monotonic() - self._catalog_read_at.get(server.name, -CATALOG_READ_S) >= CATALOG_READ_S
        read_at = time.monotonic()  # a model that changed state after this: the index may not show it
        try:
            index = await server.admin.index(ready_only=not whole)
        except TritonUnavailable:
            if server.up:
                log.error("Triton %s at %s is not answering", server.name, server.spec.grpc_url)
            server.up = False
            self.state.metrics.server_up.labels(server.name).set(0)
            self._maybe_lost(server)
            return
        was_down = not server.up
        if server.lost:
            log.warning("Triton %s at %s answers again; it takes models again", server.name,
                        server.spec.grpc_url)
        server.up, server.down_since, server.lost = True, None, False
        self.state.metrics.server_up.labels(server.name).set(1)
        self.state.known_names.update(index)
        if whole:
            self._catalog_read_at[server.name] = time.monotonic()

        def ours(rec: ModelRecord | None) -> bool:
            return (rec is not None and rec.server == server.name
                    and rec.state in (ModelState.READY, ModelState.FAILED))

        # Models to adopt are sized first, in a thread (a file walk), outside the lock.
        to_adopt = [n for n, e in index.items()
                    if e.state == TritonModelState.READY and not ours(self.state.records.get(n))]
        sizes = (await asyncio.to_thread(lambda: {n: self.catalog.artifact_bytes(n) for n in to_adopt})
                 if to_adopt else {})
        busy = set(self.state.loads) | set(self.state.unloads)
        async with self.state.lock:
            for name, entry in index.items():
                if name in busy:
                    continue
                rec = self.state.record(name)
                if entry.state == TritonModelState.READY and not ours(rec):
                    if rec.state == ModelState.READY and rec.server != server.name:
                        if was_down:  # re-placed while this server was down or lost: drop its copy
                            self.state.spawn(self._unload_stray(server, name))
                        continue  # loaded on another server too; keep our placement
                    size = sizes.get(name)
                    if size is None:
                        continue  # it changed while the others were sized: the next pass
                    server.planner.admit(Resident(name, size, pinned=rec.pinned,
                                                  priority=self.state.priority_of(name)), self.state.clock())
                    rec.move(ModelState.READY)
                    rec.server, rec.memory_bytes = server.name, size
                    rec.warmup = rec.warmup or {"ok": True, "latency_ms": None,
                                                "checked_at": self.state.clock(), "error": None,
                                                "note": "adopted from Triton's index"}
                    log.warning("adopted %s: Triton %s has it loaded", name, server.name)
                elif (entry.state == TritonModelState.READY and rec.state == ModelState.FAILED
                        and rec.server == server.name):
                    # Its unload (after a failure) did not complete: try again after the
                    # backoff, so the memory is freed and counted free once Triton confirms.
                    if (rec.failed_at is None
                            or time.monotonic() - rec.failed_at >= self.state.config.failure_backoff_s):
                        self.state.spawn(self.unloader.retry_unload(server, name))
                elif entry.state != TritonModelState.READY and ours(rec) and rec.moved_at < read_at:
                    if entry.state in (TritonModelState.LOADING, TritonModelState.UNLOADING):
                        continue
                    server.planner.remove(name)
                    self.state.release_warm(name)
                    if rec.state == ModelState.READY:
                        log.warning("%s is no longer loaded on %s (%s)", name, server.name,
                                    entry.reason or entry.state.value)
                        rec.move(ModelState.WARM)
                    else:
                        rec.move(ModelState.FAILED)  # keep the failure reason visible
                    rec.server = None
            # What this server holds room for and Triton no longer lists as loaded (the
            # models placed on a server are its planner's residents).
            for name in list(server.planner.residents):
                rec = self.state.records.get(name)
                if (rec is None or rec.server != server.name or name in index or name in busy
                        or rec.moved_at >= read_at):  # loaded while the index was read
                    continue
                server.planner.remove(name)
                self.state.release_warm(name)
                if rec.state == ModelState.READY:
                    log.warning("%s is no longer loaded on %s", name, server.name)
                # A failed model keeps its failure visible; any other is warm again.
                rec.move(ModelState.FAILED if rec.state == ModelState.FAILED else ModelState.WARM)
                rec.server = None
        self.state.update_gauges(server)
        with contextlib.suppress(ControlPlaneError):
            await self.recency.refresh_usage(server)
        await self.unloader.enforce_capacity(server)
        if was_down:
            self.state.spawn(self.pins.load_pinned())

    async def _restart_triton(self, server: TritonServer) -> None:
        """Relaunch a managed Triton that died; the event loop keeps serving meanwhile."""
        now = time.monotonic()
        if now < server.next_restart_at:
            return
        log.error("tritonserver %s exited (code %s); restarting it", server.name,
                  server.process.proc.returncode if server.process.proc else None)
        server.up = False
        self.state.metrics.server_up.labels(server.name).set(0)
        self._forget_server_models(server, "tritonserver exited")
        # Popen on the loop thread (PR_SET_PDEATHSIG follows the forking thread); the
        # readiness wait runs in a worker thread so requests for other servers go on.
        server.process.launch()
        try:
            await asyncio.to_thread(server.process.wait_ready, server.process.cfg.ready_timeout_s)
        except TritonUnavailable as exc:
            server.restart_failures += 1
            delay_s = min(60.0, 2.0 ** server.restart_failures)
            server.next_restart_at = time.monotonic() + delay_s
            log.error("restart of %s failed (%s); next try in %.0fs", server.name, exc.message, delay_s)
            await asyncio.to_thread(server.process.stop)
            return
        server.restart_failures = 0
        server.up = True
        self.state.metrics.server_up.labels(server.name).set(1)
        self.state.spawn(self.pins.load_pinned())

    def _maybe_lost(self, server: TritonServer) -> None:
        """A Triton registered by address (its node) that stays away is lost: what it held
        is placed on the others.  A managed Triton is restarted instead (_restart_triton)."""
        now = time.monotonic()
        if server.down_since is None:
            server.down_since = now
        if (server.process is not None or server.lost
                or now - server.down_since < self.state.config.server_lost_after_s):
            return
        server.lost = True
        held = sorted(n for n, r in self.state.records.items() if r.server == server.name)
        log.error("Triton %s at %s has not answered for %.0fs: lost; placing its %d model(s) "
                  "elsewhere", server.name, server.spec.grpc_url, now - server.down_since, len(held))
        self._forget_server_models(server, f"server {server.name} lost")
        self.state.spawn(self.pins.load_pinned())

    async def check_reachable(self, name: str) -> None:
        """A router could not reach server ``name``: ask it now instead of at the next pass.
        One that does not answer is down (and, past ``server_lost_after_s``, lost).  Probes
        asked for meanwhile share one."""
        server = self.state.servers.get(name)
        if server is None or not server.up:
            return
        probe = self._probes.get(name)
        if probe is None:
            probe = self._probes[name] = asyncio.get_running_loop().create_task(server.admin.is_live())
            probe.add_done_callback(lambda _t: self._probes.pop(name, None))
        if await asyncio.shield(probe) or not server.up:
            return
        log.error("Triton %s at %s is not answering (a request could not reach it)", server.name,
                  server.spec.grpc_url)
        server.up = False
        self.state.metrics.server_up.labels(server.name).set(0)
        self._maybe_lost(server)

    def place_off_down(self, rec: ModelRecord) -> None:
        """A request needs ``rec``'s model and its server is down: forget it there, so the
        next ensure places it on a server that is up.  The down server keeps its other
        models until it is lost (``_maybe_lost``); the copy it kept is unloaded when it
        answers again (``_reconcile_server``)."""
        server = self.state.servers.get(rec.server) if rec.server is not None else None
        if server is None or server.up or rec.state != ModelState.READY:
            return
        if not any(other.up for other in self.state.servers.values() if other is not server):
            return  # nowhere else to go: it stays where it is until its server answers again
        log.warning("%s is needed by a request and its server %s is down: placing it on "
                    "another server", rec.name, server.name)
        server.planner.remove(rec.name)
        self.state.release_warm(rec.name)
        rec.move(ModelState.WARM)
        rec.server = None
        rec.failure = f"server {server.name} was down when a request needed it"
        self.state.update_gauges(server)

    async def _unload_stray(self, server: TritonServer, name: str) -> None:
        try:
            await server.admin.unload(name)
            log.warning("unloaded %s from %s: it is served from %s now", name, server.name,
                        self.state.records[name].server)
        except ControlPlaneError as exc:
            log.warning("could not unload the stray copy of %s from %s: %s", name, server.name,
                        exc.message)

    def _forget_server_models(self, server: TritonServer, reason: str) -> None:
        for name, rec in self.state.records.items():
            if rec.server == server.name:
                server.planner.remove(name)
                self.state.release_warm(name)
                rec.move(ModelState.WARM)
                rec.server = None
                rec.failure = reason
        self.state.update_gauges(server)

