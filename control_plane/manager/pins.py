"""Pins: a pinned model stays loaded; the reconcile loads it again when it is not."""

from __future__ import annotations

import collections
import logging
import time

from control_plane.manager.fleet_state import ModelBook, TaskBoard
from control_plane.manager.known_models import Catalog
from control_plane.manager.loader import Loader
from control_plane.manager.manager_config import ManagerConfig
from control_plane.manager.records import ModelRecord, ModelState
from control_plane.state.state_store import StateStore
from domain.errors import ControlPlaneError
from domain.names import validate_model_name

log = logging.getLogger(__name__)


class Pins:
    def __init__(self, book: ModelBook, tasks: TaskBoard, store: StateStore,
                 config: ManagerConfig, catalog: Catalog, loader: Loader):
        self.book = book
        self.tasks = tasks
        self.store = store  # pins survive restarts
        self.config = config
        self.catalog = catalog
        self.loader = loader
        self._repairs: set[str] = set()  # pinned models the reconcile is loading
        self._retry_at: dict[str, float] = {}  # monotonic; after a failed pin repair
        # pin() calls under way per model: a pin they set is undone by the last of them to
        # fail or be cancelled only (one caller going away keeps another's pin).
        self._pinning: collections.Counter[str] = collections.Counter()

    async def pin(self, name: str) -> ModelRecord:
        """Pin and make resident.  If it cannot be loaded, the pin is not kept.

        The pin counts from the start of the call: an unload still waiting for this model's
        load gives way to it, and one already under way is awaited before loading again."""
        validate_model_name(name)
        await self.catalog.known(name)  # cold models (registry only) can be pinned too
        rec = self.book.record(name)
        was_pinned = rec.pinned and not self._pinning[name]  # pinned, not by a call under way
        self._set_pinned(rec, True)
        self._pinning[name] += 1
        try:
            await self.loader.ensure(name)
        except BaseException:
            # The last call under way undoes it (an unpin meanwhile already did).
            if self._pinning[name] == 1 and not was_pinned and rec.pinned:
                self._set_pinned(rec, False)
            raise
        finally:
            self._pinning[name] -= 1
            if not self._pinning[name]:
                del self._pinning[name]
        if rec.pinned:  # not unpinned while the load ran
            self._set_pinned(rec, True)
            # In the state store's thread: a slow database holds up this call, not the
            # event loop; an unpin asked for meanwhile is written after it.
            await self.store.db.off_loop(self.store.set_pin, name, True)
        return rec

    async def unpin(self, name: str) -> ModelRecord:
        rec = self.catalog.get(name)
        self._set_pinned(rec, False)
        await self.store.db.off_loop(self.store.set_pin, name, False)
        return rec

    def _set_pinned(self, rec: ModelRecord, pinned: bool) -> None:
        """Set the pin on the record; its resident follows (residency.resident_view)."""
        rec.set_pinned(pinned)

    def repair_pins(self) -> None:
        """Start a load of every pinned model that is not loaded: Triton dropped it, a
        forced unload took it, or it lost a race with an unload.  Failures back off."""
        now = time.monotonic()
        for name, rec in self.book.records.items():
            if (not rec.pinned or rec.state in (ModelState.READY, ModelState.LOADING, ModelState.UNLOADING)
                    or name in self.tasks.loads or name in self.tasks.unloads or name in self._repairs
                    or now < self._retry_at.get(name, 0.0)):
                continue
            if (rec.state in (ModelState.FAILED, ModelState.UNLOAD_FAILED) and rec.failed_at is not None
                    and now - rec.failed_at < self.config.failure_backoff_s):
                continue
            self._repairs.add(name)
            self.tasks.spawn(self._repair_pin(rec))

    async def _repair_pin(self, rec: ModelRecord) -> None:
        try:
            await self.loader.ensure(rec.name)
        except ControlPlaneError as exc:
            self._retry_at[rec.name] = time.monotonic() + self.config.failure_backoff_s
            failure = f"pinned but not loaded: {exc.message}"
            if rec.failure != failure:  # once per distinct reason, not once per pass
                log.error("pinned model %s could not be loaded: %s", rec.name, exc.message)
            rec.failure = failure
        else:
            self._retry_at.pop(rec.name, None)
            log.info("loaded pinned model %s again", rec.name)
        finally:
            self._repairs.discard(rec.name)

    async def load_pinned(self) -> None:
        for name in sorted(n for n, r in self.book.records.items() if r.pinned):
            rec = self.book.records[name]
            if rec.state == ModelState.READY:
                continue
            try:
                await self.loader.ensure(name)
            except ControlPlaneError as exc:
                rec.failure = f"pinned but not loaded: {exc.message}"
                log.error("pinned model %s could not be loaded: %s", name, exc.message)
