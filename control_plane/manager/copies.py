"""Copies of a model on several servers (``mmctl scale NAME --replicas N``).

A model's own copy is its record (``ModelBook.records``), loaded on demand by the loader
as ever; each copy beyond it is an *extra copy*: a record of its own, kept in the model's
record (``ModelRecord.extra``, by server; named ``CopyKey(model, server)``), moved through
the same states by the same writers, and an entry of that server's planner.  The rules:

* A model has at most one copy per server, so at most as many copies as the fleet has
  servers; its extra copies exist only while its own copy is READY (a model that is not
  loaded has no copies to spread requests over).  When its own copy leaves (evicted, its
  server down or lost) and an extra copy is READY on a server that is up, that copy becomes
  its own at once: requests keep a server, and nothing is loaded again.
* An extra copy has the lowest eviction priority (``EXTRA_COPY_PRIORITY``): it is the first
  victim when any model needs room, and its own load takes only free room (the server's
  headroom left alone) or other extra copies' room: a model's last copy is never evicted
  for another model's extra one.  A pinned model's copies are pinned with it.
* ``converge`` brings a model to its target: it adds copies one at a time where placement
  finds room (the filters of ``placement``: server up, SLA isolation, tenants) and unloads
  the copies above it; the reconcile pass runs it for every model that has a target or a
  copy, so a copy lost with its server is placed again, and a copy that could not be
  added is tried again on a later pass (after ``failure_backoff_s`` when its load failed).
* ``--replicas auto --min A --max B``: ``autoscale`` (each reconcile pass) moves the count
  between A and B by the requests the router workers report outstanding on Triton for the
  model (``load_of``), with the thresholds, hysteresis and cool-down of ``ManagerConfig``.
* A family's variant is copied into a slot of its family's model on the other server (the
  family loaded there with its slots, reserved like the loader's, when the copy is its
  first variant there); the copy is a member of that server's family pool, and Triton's
  name of it is the variant's (``ModelRecord.triton_name``).
* ``mmctl unload`` unloads every copy, one still loading too (``ModelBook.unloading`` keeps
  any from becoming the model's own meanwhile); the target stays for its next load.
* Targets survive restarts (the state store's key-value table); copies that Triton already
  holds at start are adopted by the reconcile pass as extra copies and counted.

The router sends each request to the copy with the fewest requests it has outstanding
(``router.serving.ensure_and_resend``), from the ``copies`` section the control plane
publishes beside ``placement``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from control_plane.manager.executor import Executor, retrieve
from control_plane.manager.fleet_state import Bookkeeping, ModelBook, TaskBoard
from control_plane.manager.known_models import Catalog
from control_plane.manager.loader import Loader
from control_plane.manager.manager_config import ManagerConfig
from control_plane.manager.placement import Placer
from control_plane.manager.records import (
    ModelRecord,
    ModelState,
    TritonServer,
)
from control_plane.state.state_store import StateStore
from domain.errors import (
    CapacityExhausted,
    ControlPlaneError,
    EvictionFailed,
    InvalidInput,
    TritonUnavailable,
)
from domain.names import validate_model_name

log = logging.getLogger(__name__)

TARGETS_KEY = "replicas"  # state store key-value: JSON {model: copies wanted}, 1 left out


@dataclass(frozen=True)
class AutoRange:
    """``mmctl scale NAME --replicas auto --min A --max B``."""

    minimum: int
    maximum: int


def _whole(value: object, least: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


class Copies:
    def __init__(self, book: ModelBook, servers: dict[str, TritonServer], tasks: TaskBoard,
                 keeping: Bookkeeping, config: ManagerConfig, store: StateStore,
                 catalog: Catalog, placer: Placer, loader: Loader,
                 executor: Executor, load_of: Callable[[], dict[str, int]] = dict):
        self.book = book
        self.servers = servers
        self.tasks = tasks
        self.keeping = keeping
        self.config = config
        self.store = store
        self.catalog = catalog
        self.placer = placer
        self.loader = loader
        self.executor = executor  # carries a copy's placement and unloads out (executor.py)
        # model -> copies wanted (fixed), or AutoRange (auto: ``current`` says how many now)
        self.targets: dict[str, int | AutoRange] = {}
        for name, spec in json.loads(store.get(TARGETS_KEY) or "{}").items():
            self.targets[str(name)] = (AutoRange(int(spec["min"]), int(spec["max"]))
                                       if isinstance(spec, dict) else int(spec))
        self.current: dict[str, int] = {}  # an auto model -> copies wanted now
        # Requests outstanding per model now, over every router (the workers' reports, or
        # the in-process router's queues): what ``autoscale`` reads.  Empty: no auto scaling.
        self.load_of = load_of
        self._above_since: dict[str, float] = {}  # auto model -> monotonic, busy past the bar
        self._below_since: dict[str, float] = {}  # auto model -> monotonic, idle enough to shrink
        self._changed_at: dict[str, float] = {}  # auto model -> monotonic, its last change
        self._converging: dict[str, asyncio.Task] = {}  # model -> its converge in the background
        self._promoting = False  # a copy is becoming its model's own (``_promote``)
        # Copies are added only after a whole reconcile pass: until every server's index was
        # read, a copy a Triton already holds (a restart's) is not known yet, and one loaded
        # meanwhile would load it again there or beside it.
        self._reconciled = False
        self._counted: set[str] = set()  # models with a mms_model_copies series
        self._retry_at: dict[str, float] = {}  # model -> monotonic; after a failed copy load
        self.notes: dict[str, str] = {}  # model -> why it has fewer copies than its target
        book.move_listeners.append(self._moved)

    def target(self, name: str) -> int:
        """Copies wanted now (an auto model's current count)."""
        spec = self.targets.get(name, 1)
        return self.current.get(name, spec.minimum) if isinstance(spec, AutoRange) else spec

    def servers_of(self, name: str) -> list[str]:
        """The servers where ``name`` is READY: its own copy's first, then its extra ones."""
        rec = self.book.records.get(name)
        if rec is None or rec.state != ModelState.READY or rec.server is None:
            return []
        return [rec.server, *sorted(c.server for c in self.book.extra_copies(name)
                                    if c.state == ModelState.READY)]

    def row(self, rec: ModelRecord) -> dict:
        """``rec`` as ``mmctl status`` shows it: with its copy target and every copy."""
        row = rec.to_dict()
        row["replicas"] = self.target(rec.name)
        spec = self.targets.get(rec.name)
        if isinstance(spec, AutoRange):
            row["autoscale"] = {"min": spec.minimum, "max": spec.maximum}
        if rec.extra:
            row["copies"] = [*row["copies"], *(
                {"server": c.server, "state": c.state.value}
                for c in sorted(self.book.extra_copies(rec.name), key=lambda c: c.server or ""))]
        if rec.name in self.notes and len(row["copies"]) < row["replicas"]:
            row["copies_note"] = self.notes[rec.name]
        return row

    # -- the operator's command ------------------------------------------------------
    async def scale(self, name: str, replicas: object, minimum: object = None,
                    maximum: object = None) -> ModelRecord:
        """Keep ``replicas`` copies of ``name`` (on as many servers; 1: its own only), or
        ``"auto"``: between ``minimum`` (default 1) and ``maximum`` (default: every server)
        copies, as many as its outstanding requests need (``autoscale``)."""
        validate_model_name(name)
        auto = replicas == "auto"
        if not auto and not _whole(replicas, 1):
            raise InvalidInput(f"replicas must be a whole number >= 1 or \"auto\", not {replicas!r} "
                               "(1: the model's own copy only)")
        if not auto and (minimum is not None or maximum is not None):
            raise InvalidInput("min and max go with replicas \"auto\" only")
        fleet = len(self.servers)
        low = 1 if minimum is None else minimum
        high = fleet if maximum is None else maximum
        for what, value in (("min", low), ("max", high)):
            if auto and not _whole(value, 1):
                raise InvalidInput(f"{what} must be a whole number >= 1, not {value!r}")
        if auto and low > high:
            raise InvalidInput(f"min ({low}) is more than max ({high})")
        rec = self.catalog.get(name)  # ModelNotFound for an unknown name
        self._refuse_family_models(name)
        most = high if auto else replicas
        if most > fleet:
            raise InvalidInput(
                f"{name} cannot have {most} copies: a server holds one copy of a model and "
                f"the fleet has {fleet} server(s) ({', '.join(sorted(self.servers))}); "
                "add servers (mmctl up --triton-servers N) or ask for fewer")
        self.current.pop(name, None)
        if auto:
            self.targets[name] = AutoRange(low, high)
            self.current[name] = min(high, max(low, len(self.servers_of(name)) or low))
        elif replicas == 1:
            self.targets.pop(name, None)
        else:
            self.targets[name] = replicas
        self.notes.pop(name, None)
        self._retry_at.pop(name, None)
        for waits in (self._above_since, self._below_since, self._changed_at):
            waits.pop(name, None)
        await self.store.db.off_loop(self.store.put, TARGETS_KEY, json.dumps(
            {n: {"min": t.minimum, "max": t.maximum} if isinstance(t, AutoRange) else t
             for n, t in self.targets.items()}, sort_keys=True))
        log.info("%s: %s", name, f"auto, {low} to {high} copies" if auto
                 else f"{replicas} cop{'y' if replicas == 1 else 'ies'} wanted")
        if self.target(name) > 1 and rec.state != ModelState.READY:
            await self.loader.ensure(name, retry_failed=True)  # its own copy first
        running = self._converging.get(name)  # its load started one: it ends first
        if running is not None:
            await asyncio.wait([running])
        await self.converge(name)
        return rec

    def _refuse_family_models(self, name: str) -> None:
        """A family's Triton model is the control plane's to load for its variants; its
        variants are scaled (each copy takes a slot of the family on its server)."""
        for server in self.servers.values():
            if name in server.admin.slot_pools():
                raise InvalidInput(f"{name} is a model family's Triton model: the control plane "
                                   "loads it for its variants; it cannot be scaled")

    # -- bringing models to their targets --------------------------------------------
    def autoscale(self, now: float | None = None) -> None:
        """Move each auto model's count toward what its outstanding requests need: one more
        copy once they stay above ``config.scale_up_outstanding`` per copy for
        ``scale_up_after_s``; one fewer once the copies left would each stay under half of
        it for ``scale_down_after_s`` (the gap between the two bars keeps a model at the edge
        from flapping); ``scale_up_after_s`` apart at least (the cool-down), and never
        before the copies of the last step are ready."""
        now = time.monotonic() if now is None else now
        load = self.load_of()
        cfg = self.config
        for name, spec in self.targets.items():
            if not isinstance(spec, AutoRange):
                continue
            current = self.current.setdefault(name, spec.minimum)
            ready = len(self.servers_of(name))
            outstanding = load.get(name, 0)
            cooled = now - self._changed_at.get(name, -1e18) >= cfg.scale_up_after_s
            busy = (ready >= current and current < spec.maximum
                    and outstanding > cfg.scale_up_outstanding * max(ready, 1))
            idle = (current > spec.minimum
                    and outstanding < cfg.scale_up_outstanding / 2 * (current - 1))
            change = 0
            if busy:
                since = self._above_since.setdefault(name, now)
                change = 1 if cooled and now - since >= cfg.scale_up_after_s else 0
            else:
                self._above_since.pop(name, None)
            if idle:
                since = self._below_since.setdefault(name, now)
                change = -1 if cooled and now - since >= cfg.scale_down_after_s else change
            else:
                self._below_since.pop(name, None)
            if change:
                self.current[name] = current + change
                self._changed_at[name] = now
                self._above_since.pop(name, None)
                self._below_since.pop(name, None)
                log.info("%s: %d outstanding requests on %d cop%s: %d copies wanted now", name,
                         outstanding, ready, "y" if ready == 1 else "ies", current + change)

    def converge_all(self) -> None:
        """Start a converge for every model with a target or an extra copy (a reconcile pass)."""
        self._reconciled = True
        self.autoscale()
        names = set(self.targets) | {c.copy_of for c in self.book.every_extra_copy()
                                     if c.server is not None}
        for name in sorted(names):
            self._spawn_converge(name)
        self._count_copies(names)

    def _count_copies(self, names: set[str]) -> None:
        """``mms_model_copies`` of the models with a target or a copy, as of this pass; a
        model with neither any longer loses its series."""
        metrics = self.keeping.metrics
        for name in sorted(self._counted - names):
            with contextlib.suppress(KeyError):
                metrics.model_copies.remove(metrics.model_label(name))
        for name in names:
            metrics.model_copies.labels(metrics.model_label(name)).set(len(self.servers_of(name)))
        self._counted = set(names)

    def _spawn_converge(self, name: str) -> None:
        if name in self._converging or not self._reconciled:
            return

        async def run() -> None:
            try:
                await self.converge(name)
            except ControlPlaneError as exc:
                log.warning("copies of %s: %s", name, exc.message)
            finally:
                self._converging.pop(name, None)

        self._converging[name] = asyncio.get_running_loop().create_task(run())
        self.tasks.background.add(self._converging[name])
        self._converging[name].add_done_callback(self.tasks.background.discard)

    def _moved(self, name: str) -> None:
        """A model's state changed (a move listener): when its own copy left and an extra one
        is READY, that one becomes its own now; a model loaded gets its copies soon."""
        rec = self.book.records.get(name)
        if rec is None or self._promoting or name in self.book.unloading:
            return  # the moves of a promotion are its own; an operator's unload takes all
        if rec.state in (ModelState.WARM, ModelState.FAILED) and name not in self.tasks.loads:
            self._promote(rec)
        if name in self.targets and rec.state == ModelState.READY:
            self._spawn_converge(name)

    def _promote(self, rec: ModelRecord) -> None:
        ready = [c for c in self.book.extra_copies(rec.name) if c.state == ModelState.READY
                 and c.server in self.servers and self.servers[c.server].up]
        if not ready:
            return
        copy = min(ready, key=lambda c: c.server)
        where, size = copy.server, copy.memory_bytes
        # No await between the two moves: the server's room changes hands, never counted twice.
        self._promoting = True
        try:
            copy.move(ModelState.WARM, server=None)
            rec.move(ModelState.READY, server=where, memory_bytes=size)
        finally:
            self._promoting = False
        rec.warmup = copy.warmup
        rec.failure = None
        log.info("%s: its copy on %s is its own now (its own copy left)", rec.name, where)

    async def converge(self, name: str) -> None:
        """Add or unload extra copies until ``name`` has its target (as far as room allows)."""
        rec = self.book.records.get(name)
        if rec is not None and rec.state in (ModelState.LOADING, ModelState.UNLOADING):
            return  # its own copy is coming or going: a ready copy may be about to take over
        wanted = self.target(name) - 1 if rec is not None and rec.state == ModelState.READY else 0
        async with self.tasks.lock:
            live = [c for c in self.book.extra_copies(name)
                    if c.state in (ModelState.LOADING, ModelState.READY)]
            pinned = rec is not None and rec.pinned
            for c in live:
                if c.pinned != pinned:
                    c.set_pinned(pinned)
            excess = sorted((c for c in live if c.state == ModelState.READY),
                            key=lambda c: c.server, reverse=True)[:max(0, len(live) - wanted)]
            for c in excess:
                c.move(ModelState.UNLOADING)
        for c in excess:
            self.executor.unload_now(self.servers[c.server], c,
                                     reason="scaled_down").add_done_callback(retrieve)
        for _ in range(wanted - len(live)):
            if time.monotonic() < self._retry_at.get(name, 0.0) or not await self._add(name):
                break

    async def _add(self, name: str) -> bool:
        """Load one more copy of ``name`` where placement finds room; False when none did."""
        rec = self.book.records[name]
        async with self.tasks.lock:
            if rec.state != ModelState.READY:
                return False
            holding = {rec.server, *(c.server for c in self.book.extra_copies(name))}
            candidates = [s for s in self.servers.values() if s.name not in holding]
            if not candidates:
                self.notes[name] = "every server that is up holds a copy"
                return False
            size = rec.memory_bytes
            try:
                server, victims = self.placer.place(name, size, candidates, pinned=rec.pinned,
                                                    extra_copy=True)
            except (CapacityExhausted, TritonUnavailable) as exc:
                self.notes[name] = exc.message
                return False
            copy = self.book.extra_copy(name, server.name)
            copy.failure = None
            copy.set_pinned(rec.pinned)
            res = self.executor.commit(server, copy, name, size, victims)
        log.info("copying %s to %s (%d bytes), evicting %s", name, server.name, size,
                 victims or "nothing")
        try:
            await self.executor.carry_out(res, measure=False, undo_to=ModelState.WARM)
        except EvictionFailed as exc:
            self.notes[name] = exc.message
            return False
        except ControlPlaneError as exc:
            self._failed(server, copy, exc)
            return False
        copy.move(ModelState.READY)
        self.notes.pop(name, None)
        self.keeping.metrics.loads.labels(server.name, "ok").inc()
        # (Its own copy left meanwhile: this one became its own as it moved, ``_moved``.)
        log.info("copied %s to %s in %.2fs", name, server.name, copy.load_time_s)
        return True

    def _failed(self, server: TritonServer, copy: ModelRecord, exc: ControlPlaneError) -> None:
        """A copy's load failed (the executor undid it): tried again after the backoff."""
        self.notes[copy.copy_of] = f"its copy on {server.name} failed: {exc.message}"
        self._retry_at[copy.copy_of] = time.monotonic() + self.config.failure_backoff_s
