"""Requests holding models: a lease while a request runs, and a hold from before a miss's
load until the router says the request has its answer."""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable

from control_plane.manager.fleet_state import ModelBook
from control_plane.manager.known_models import Catalog
from control_plane.manager.loader import Loader
from control_plane.manager.manager_config import ManagerConfig
from control_plane.manager.recency import Recency
from control_plane.manager.records import ModelRecord, TritonServer
from control_plane.manager.request_holds import RequestHolds
from domain.errors import ModelLoadFailed, OperationTimeout
from domain.names import validate_model_name


class Leases:
    def __init__(self, book: ModelBook, config: ManagerConfig, catalog: Catalog,
                 recency: Recency, loader: Loader,
                 check_reachable: Callable[[str], Awaitable[None]],
                 place_off_down: Callable[[ModelRecord], None]):
        """``check_reachable`` and ``place_off_down``: the reconcile's answers to a request
        that could not reach a server, and to one whose model's server is down
        (``Reconciler.check_reachable``, ``Reconciler.place_off_down``)."""
        self.book = book
        self.config = config
        self.catalog = catalog
        self.recency = recency
        self.loader = loader
        self.check_reachable = check_reachable
        self.place_off_down = place_off_down
        # Holds of models loaded for requests (ensure_for_request), each of the router worker
        # whose ensure made it (None: this process's own router); each ends the request's
        # count in its record (``acquire``).
        self.request_holds = RequestHolds(config.on_its_way_s, on_end=self._hold_ended)

    @contextlib.asynccontextmanager
    async def lease(self, name: str) -> AsyncIterator[TritonServer]:
        """Hold ``name`` loaded while a request runs; unload waits for leases to drain."""
        rec = await self.acquire(name)
        try:
            server = self.catalog.ready_server_of(name)
            if server is None:
                await self.loader.ensure(name)
                server = self.catalog.ready_server_of(name)
                if server is None:
                    raise ModelLoadFailed(f"{name} was unloaded before the request could start; retry")
            self.recency.touch(name)
            rec.active += 1
            try:
                yield server
            finally:
                rec.active -= 1
        finally:
            self.release(rec)

    async def ensure_for_request(self, name: str, unreachable: str | None = None,
                                 owner: str | None = None) -> TritonServer:
        """The server where ``name`` is READY for a request about to be sent there (the
        router's miss).  The model is held from before its load until the router says the
        request has its answer (``requests_answered``), or at most
        ``ManagerConfig.on_its_way_s``, so no other load or the headroom evicts it in
        between; one unloaded anyway (an explicit unload) is loaded again, within
        ``capacity_wait_s``.

        A model whose server is down is placed on another server for the request, without
        waiting for that server to be declared lost (``Reconciler.place_off_down``).
        ``unreachable``: the server the router could not reach for this request; it is
        asked at once whether it is alive (``Reconciler.check_reachable``).  ``owner``: the
        router worker asking; its ``requests_answered`` ends its own holds only."""
        rec = await self.acquire(name)
        config = self.config
        try:
            if unreachable is not None:
                await self.check_reachable(unreachable)
            deadline = time.monotonic() + config.capacity_wait_s
            while True:
                self.place_off_down(rec)
                await self.loader.ensure(name)
                server = self.catalog.ready_server_of(name)
                if server is not None:
                    return server
                if time.monotonic() >= deadline:
                    raise OperationTimeout(f"{name} was unloaded again each time it was loaded for "
                                           f"{config.capacity_wait_s:.0f}s; retry")
        finally:
            self.request_holds.hold(rec.name, owner)

    def _hold_ended(self, name: str) -> None:
        rec = self.book.records.get(name)
        if rec is not None:
            self.release(rec)

    def requests_answered(self, name: str, count: int = 1, owner: str | None = None) -> int:
        """Requests that ensured ``name`` have Triton's answer: up to ``count`` of its holds
        made for ``owner`` (oldest first) end now rather than at ``on_its_way_s``, so under
        thrash a slot turns over as soon as the requests it was loaded for are served; one
        worker's answers never end another's holds (whose requests may still be on their
        way).  Returns the holds ended."""
        return self.request_holds.answered(name, count, owner)

    async def acquire(self, name: str) -> ModelRecord:
        """Count one request for ``name`` as in flight *before* it waits for a load, so the
        model it waits for cannot be chosen as a victim before the request is served."""
        rec = self.book.records.get(name)
        if rec is None:
            validate_model_name(name)
            await self.catalog.known(name)
            rec = self.book.record(name)
        rec.hold()
        return rec

    def release(self, rec: ModelRecord) -> None:
        rec.release()
