"""Requests holding models, and recency (what the eviction policy orders by)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

from control_plane.domain.errors import ModelLoadFailed, OperationTimeout
from control_plane.domain.names import validate_model_name
from control_plane.manager.records import ModelRecord, ModelState, TritonServer
from control_plane.manager.state import ManagerState


class Leases(ManagerState):
    def touch(self, name: str) -> None:
        rec = self.records.get(name)
        if rec is None:
            return
        rec.last_used = self.clock()
        if rec.server is not None and rec.server in self.servers:
            self.servers[rec.server].planner.touch(name, rec.last_used)

    @contextlib.asynccontextmanager
    async def lease(self, name: str) -> AsyncIterator[TritonServer]:
        """Hold ``name`` loaded while a request runs; unload waits for leases to drain."""
        rec = await self.acquire(name)
        try:
            server = self.ready_server_of(name)
            if server is None:
                await self.ensure(name)
                server = self.ready_server_of(name)
                if server is None:
                    raise ModelLoadFailed(f"{name} was unloaded before the request could start; retry")
            self.touch(name)
            rec.active += 1
            try:
                yield server
            finally:
                rec.active -= 1
        finally:
            self.release(rec)

    async def ensure_for_request(self, name: str, unreachable: str | None = None) -> TritonServer:
        """The server where ``name`` is READY for a request about to be sent there (the
        router's miss).  The model is held from before its load until the router says the
        request has its answer (``requests_answered``), or at most
        ``ManagerConfig.on_its_way_s``, so no other load or the headroom evicts it in
        between; one unloaded anyway (an explicit unload) is loaded again, within
        ``capacity_wait_s``.

        A model whose server is down is placed on another server for the request, without
        waiting for that server to be declared lost (``Reconciler.place_off_down``).
        ``unreachable``: the server the router could not reach for this request; it is
        asked at once whether it is alive (``Reconciler.check_reachable``)."""
        rec = await self.acquire(name)
        try:
            if unreachable is not None:
                await self.check_reachable(unreachable)
            deadline = time.monotonic() + self.config.capacity_wait_s
            while True:
                self.place_off_down(rec)
                await self.ensure(name)
                server = self.ready_server_of(name)
                if server is not None:
                    return server
                if time.monotonic() >= deadline:
                    raise OperationTimeout(f"{name} was unloaded again each time it was loaded for "
                                           f"{self.config.capacity_wait_s:.0f}s; retry")
        finally:
            self._hold_for_request(rec)

    def _hold_for_request(self, rec: ModelRecord) -> None:
        holds = self.request_holds.setdefault(rec.name, [])

        def expire() -> None:  # the router never said: the hold ends anyway
            holds.remove(handle)
            if not holds and self.request_holds.get(rec.name) is holds:
                del self.request_holds[rec.name]
            self.release(rec)

        handle = asyncio.get_running_loop().call_later(self.config.on_its_way_s, expire)
        holds.append(handle)

    def requests_answered(self, name: str, count: int = 1) -> int:
        """Requests that ensured ``name`` have Triton's answer: up to ``count`` of its holds
        end now rather than at ``on_its_way_s``, so under thrash a slot turns over as soon as
        the requests it was loaded for are served.  Returns the holds ended."""
        holds = self.request_holds.get(name)
        if not holds:
            return 0
        ended = holds[:max(0, count)]
        del holds[:len(ended)]
        if not holds:
            del self.request_holds[name]
        for handle in ended:
            handle.cancel()
            self.release(self.records[name])
        return len(ended)

    async def acquire(self, name: str) -> ModelRecord:
        """Count one request for ``name`` as in flight *before* it waits for a load, so the
        model it waits for cannot be chosen as a victim before the request is served."""
        rec = self.records.get(name)
        if rec is None:
            validate_model_name(name)
            await self.known(name)
            rec = self._record(name)
        rec.inflight += 1
        if rec.inflight == 1:
            self._sync_evictable(rec)
        return rec

    def release(self, rec: ModelRecord) -> None:
        rec.inflight -= 1
        if rec.inflight == 0:
            self._sync_evictable(rec)

    def _sync_evictable(self, rec: ModelRecord) -> None:
        """A resident is evictable when it is READY and no request holds it."""
        server = self.servers.get(rec.server) if rec.server else None
        resident = server.planner.residents.get(rec.name) if server else None
        if resident is not None:
            resident.evictable = rec.state == ModelState.READY and rec.inflight == 0

    async def refresh_usage(self, server: TritonServer) -> None:
        """Refresh recency from Triton's statistics: inferences sent straight to Triton count."""
        stats = await server.admin.statistics()
        seen = []
        for name, s in stats.items():
            rec = self.records.get(name)
            last_ms = int(s.get("last_inference", 0) or 0)
            if rec is None or rec.server != server.name or last_ms <= rec.last_inference_ms:
                continue
            rec.last_inference_ms = last_ms
            seen.append((last_ms, name))
        for last_ms, name in sorted(seen):
            rec = self.records[name]
            when = last_ms / 1000.0
            if rec.last_used is None or when > rec.last_used:
                rec.last_used = when
            server.planner.touch(name, when)
