"""The model manager: the only writer of what is loaded on which Triton server.

Concurrency model (plain asyncio, one event loop):

* ``ensure(model)`` on a loaded model is a dictionary lookup plus a recency touch: no
  remote call.  On a miss, one load task per model exists at a time; late callers await it
  (``asyncio.shield`` so a cancelled caller does not cancel the load for the others).
* Placement and reservation happen under ``_lock`` with no ``await`` in between, so two
  loads can never both claim the same free bytes or the same victim.  The Triton calls
  themselves (unload victims, load, warm-up) run outside the lock, so loads of different
  models overlap.
* Memory of an evicted model is counted as used until Triton's repository index shows it
  UNAVAILABLE (unload returns before the stub exits and frees its memory).
* Every failure undoes exactly what was reserved before it; a model whose load or warm-up
  failed is unloaded again and left ``failed`` with the reason.
* A model whose unload failed keeps its server and its room (``failed``, ``server`` set):
  it is never loaded on another server until the first one confirms it gone, and the
  retries back off.
* A pin wins over an unload that has not started; one under way is awaited, then the
  model is loaded again.  Each reconcile pass (``step``) loads pinned models that are
  not loaded.
* Warm-up follows the model: Triton runs a config's ``model_warmup`` during the load;
  otherwise one synthetic request, unless the model or the registry turned it off.

Eviction off the critical path (a miss should cost one load, not an unload and a load):

* Headroom.  Each server keeps room for the next miss free (``ManagerConfig.headroom_models``
  / ``headroom_bytes``; by default one model's room where at least 8 fit, see
  ``eviction.HeadroomSpec``).  When a load takes it, the policy's next victim is unloaded
  in the background at once (``reason="headroom"``), with the usual rules: never a pinned
  model, never one a request holds or that is loading, lowest rollout stage first.  A
  serving model's miss may use the headroom; a shadow may not.
* Two counts per server.  *Committed* room leaves out the models being unloaded (their room
  is promised): placement plans victims on it, so two misses close together never evict
  two models for the room of one.  *Held* room is what Triton holds: loaded, loading, and
  unloading until its index shows the model UNAVAILABLE.  A load is sent to Triton only
  when held room plus the newcomer fits the budget: the budget is enforced on what
  Triton confirms.
* One exception, overlap: when the measured free memory of the server's device
  (``free_memory(server)``: MemAvailable on CPU, a GPU's free memory where a hook gives
  it) holds the newcomer plus ``overlap_margin_bytes``, on top of every load already sent
  and not finished on that device (each counted at its size plus the margin), the load
  starts while its victims are still shutting down.  What is measured is never
  over-committed, and the counts stay honest: the victims stay counted until Triton
  confirms them gone (``mmctl fleet`` may show the server over its budget meanwhile), and
  no other load can count on that room.  A victim whose unload then fails keeps its room
  (``failed``); the newcomer stays loaded and the reconcile evicts down to the budget.
  Without a probe (unit tests, attached Tritons) nothing overlaps.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import AsyncIterator, Callable, Protocol

from .devices import NoMemoryMeter
from .errors import (
    CapacityExhausted,
    ControlPlaneError,
    InvalidInput,
    ModelLoadFailed,
    ModelNotFound,
    OperationTimeout,
    TritonUnavailable,
)
from .eviction import (
    DEFAULT_POLICY,
    DEFAULT_PRIORITY,
    CachePlanner,
    Capacity,
    HeadroomSpec,
    Resident,
    make_policy,
    victim_priority_limit,
)
from .metrics import ControlPlaneMetrics
from .names import validate_model_name
from .placement import Placer, plan_measured
from .state_store import StateStore
from .triton_admin import TritonAdmin, TritonModelState
from .triton_process import TritonProcess

log = logging.getLogger(__name__)


UNKNOWN_NAME_TTL_S = 5.0
UNKNOWN_NAMES_MAX = 10_000
# How often a load waiting for room re-reads the measured free memory (an unload finishing
# wakes it at once).
ROOM_POLL_S = 0.05


def host_available_bytes(meminfo: str | None = None, cgroup_max: str | None = None,
                         cgroup_current: str | None = None) -> int | None:
    """Host memory free for new processes now: ``MemAvailable`` of /proc/meminfo, capped by
    what a cgroup v2 limit leaves (a container sees the host's meminfo).  None when it
    cannot be read.  The ``free_memory`` probe of CPU servers (a /proc read, microseconds)."""
    def read(path: str) -> str | None:
        try:
            with open(path) as f:
                return f.read()
        except OSError:
            return None

    meminfo = read("/proc/meminfo") if meminfo is None else meminfo
    available = None
    for line in (meminfo or "").splitlines():
        if line.startswith("MemAvailable:"):
            parts = line.split()
            if len(parts) >= 2 and parts[1].isdigit():
                available = int(parts[1]) * 1024  # kB
            break
    if available is None:
        return None
    limit = (read("/sys/fs/cgroup/memory.max") if cgroup_max is None else cgroup_max) or ""
    current = (read("/sys/fs/cgroup/memory.current") if cgroup_current is None
               else cgroup_current) or ""
    if limit.strip().isdigit() and current.strip().isdigit():
        available = min(available, max(0, int(limit) - int(current)))
    return available


def _retrieve(fut: asyncio.Future) -> None:
    """Done callback of an unload nobody awaits: its failure is logged where it happens."""
    if not fut.cancelled():
        fut.exception()


class ModelState(str, enum.Enum):
    COLD = "cold"  # known, artifacts only in the cold store
    WARM = "warm"  # artifacts in Triton's repository, not loaded
    LOADING = "loading"
    READY = "ready"
    UNLOADING = "unloading"
    FAILED = "failed"


@dataclass
class ModelRecord:
    name: str
    state: ModelState = ModelState.WARM
    server: str | None = None
    pinned: bool = False
    last_used: float | None = None  # wall-clock seconds since the epoch
    load_time_s: float | None = None
    memory_bytes: int = 0
    failure: str | None = None
    warmup: dict | None = None
    loads: int = 0
    inflight: int = 0  # requests holding the model (waiting for it or running on it)
    active: int = 0  # of those, requests sent to Triton: what an unload drains
    last_inference_ms: int = 0  # newest Triton-reported inference, to refresh recency
    failed_at: float | None = None  # monotonic time of the last failed load

    def to_dict(self) -> dict:
        return {
            "model": self.name,
            "state": self.state.value,
            "server": self.server,
            "pinned": self.pinned,
            "last_used": self.last_used,
            "load_time_s": self.load_time_s,
            "memory_bytes": self.memory_bytes,
            "failure": self.failure,
            "inflight": self.inflight,
            "loads": self.loads,
            "healthy": self.healthy,
        }

    @property
    def healthy(self) -> bool:
        return self.state == ModelState.READY and bool(self.warmup and self.warmup.get("ok"))


@dataclass
class ServerSpec:
    """One Triton server bound to one device (CPU, a GPU, or a MIG slice)."""

    name: str
    grpc_url: str
    http_url: str
    metrics_url: str | None = None
    device: str = "cpu"
    memory_budget_bytes: int | None = None
    max_loaded: int | None = None

    def __post_init__(self):
        if self.memory_budget_bytes is not None and self.memory_budget_bytes <= 0:
            raise InvalidInput(f"memory budget ({self.memory_budget_bytes}) must be > 0 bytes")
        if self.max_loaded is not None and self.max_loaded < 1:
            raise InvalidInput(f"max_loaded ({self.max_loaded}) must be >= 1")


@dataclass
class TritonServer:
    spec: ServerSpec
    admin: TritonAdmin
    planner: CachePlanner
    process: TritonProcess | None = None
    up: bool = True
    restart_failures: int = 0
    next_restart_at: float = 0.0  # monotonic; restarts of a crashing Triton back off

    @property
    def name(self) -> str:
        return self.spec.name

    def to_dict(self) -> dict:
        return {
            "server": self.name,
            "device": self.spec.device,
            "grpc_url": self.spec.grpc_url,
            "http_url": self.spec.http_url,
            "metrics_url": self.spec.metrics_url,
            "up": self.up,
            "managed": self.process is not None,
            "memory_budget_bytes": self.spec.memory_budget_bytes,
            "max_loaded": self.spec.max_loaded,
            "used_bytes": self.planner.used_bytes,
            "headroom": vars(self.planner.headroom_target()),
            "loaded": sorted(self.planner.residents),
        }


@dataclass
class ManagerConfig:
    drain_timeout_s: float = 30.0
    unload_timeout_s: float = 60.0
    policy: str = DEFAULT_POLICY
    warmup: bool = True
    # After a failed load, on-demand ensures fail fast for this long instead of retrying
    # the load for every request (an explicit `mmctl load` always retries).
    failure_backoff_s: float = 10.0
    # How long a load waits for room held by other loads/unloads in progress.
    capacity_wait_s: float = 120.0
    # Room each server keeps free for the next miss (eviction.HeadroomSpec): None = the
    # default (one model where at least 8 fit), 0 = off.  headroom_bytes: explicit bytes
    # under a byte budget instead of models x the median resident's size.
    headroom_models: int | None = None
    headroom_bytes: int | None = None
    # Overlap: memory beyond a model's own size that a load may take while it starts (a
    # python stub with torch: about 0.3 GB of RAM; on a GPU its CUDA context), kept free for
    # each load in flight before a load may start ahead of its victims' unloads.
    overlap_margin_bytes: int = 1 << 30

    def __post_init__(self):
        for name in ("headroom_models", "headroom_bytes", "overlap_margin_bytes"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise InvalidInput(f"{name} ({value}) must be >= 0")


@dataclass
class _Usage:
    last_inference_ms: int = 0
    names: list[str] = field(default_factory=list)


class Stager(Protocol):
    """Makes a model's artifacts present in Triton's repository (the warm tier) before a load.

    ``stage`` returns the model's size in bytes (downloading from the cold store if needed)
    and raises ModelNotFound / ModelLoadFailed with a clear reason; ``pin_warm`` marks
    models the warm tier must not drop while they are loaded or loading; ``known`` lists
    models that exist in any tier (cold included) so they can be ensured.
    """

    async def stage(self, model: str) -> int: ...

    def set_busy(self, model: str, busy: bool) -> None: ...

    def known(self) -> set[str]: ...


class ModelManager:
    def __init__(
        self,
        servers: list[TritonServer],
        store: StateStore,
        repository: Path | None = None,
        config: ManagerConfig | None = None,
        metrics: ControlPlaneMetrics | None = None,
        clock: Callable[[], float] = time.time,
        stager: Stager | None = None,
        priority_of: Callable[[str], int] | None = None,
        placer: Placer | None = None,
        warmup_enabled: Callable[[str], bool] | None = None,
        memory=None,
        free_memory: Callable[[TritonServer], int | None] | None = None,
    ):
        if not servers:
            raise InvalidInput("the fleet needs at least one Triton server")
        self.servers = {s.name: s for s in servers}
        self.store = store
        self.repository = repository
        self.config = config or ManagerConfig()
        self.metrics = metrics or ControlPlaneMetrics()
        self.clock = clock
        self.stager = stager
        # Rollout-stage eviction priority of a model (registry.stage_priority); SLA/tenant
        # aware placement (placement.Placer).  Defaults: one priority, filters without labels.
        self.priority_of = priority_of or (lambda _name: DEFAULT_PRIORITY)
        headroom = HeadroomSpec(self.config.headroom_models, self.config.headroom_bytes)
        for s in servers:
            s.planner.priority_of = self.priority_of  # a shadow never evicts serving models
            s.planner.headroom = headroom
        # Measured free bytes of a server's device now, or None: the overlap rule (see the
        # module docstring); host_available_bytes on CPU.  None: nothing overlaps.
        self.free_memory = free_memory
        self._probe_failed: set[str] = set()  # servers whose probe raised (logged once)
        self.placer = placer or Placer()
        # Whether the synthetic warm-up may run for a model (the registry's per-model setting);
        # the model's own config can turn it off too (triton_admin.WARMUP_PARAMETER).
        self.warmup_enabled = warmup_enabled or (lambda _name: True)
        # Measures each load on a GPU and says when an unload's memory is back
        # (devices.GpuMemoryMeter); CPU servers: artifact sizes, nothing measured.
        self.memory = memory or NoMemoryMeter()
        self.records: dict[str, ModelRecord] = {}
        self.catalog: set[str] = set()
        self._lock = asyncio.Lock()
        self._loads: dict[str, asyncio.Task] = {}
        self._unloads: dict[str, asyncio.Task] = {}
        self._background: set[asyncio.Task] = set()
        self._load_listeners: list[Callable[[str, ModelRecord], None]] = []
        self._unknown: dict[str, float] = {}  # name -> when it was last found unknown
        self._pin_repairs: set[str] = set()  # pinned models the reconcile is loading
        self._pin_retry_at: dict[str, float] = {}  # monotonic; after a failed pin repair
        # Loads reserved and not sent to Triton yet (server -> model -> bytes), and loads
        # sent and not finished (model -> (device, bytes)): held room and the overlap rule.
        self._queued: dict[str, dict[str, int]] = {}
        self._sent: dict[str, tuple[str, int]] = {}
        pins = store.pins()
        for name, row in store.model_rows().items():
            rec = self._record(name)
            rec.last_used = row["last_used"]
            rec.load_time_s = row["load_time_s"]
            rec.memory_bytes = row["memory_bytes"] or 0
        for name in pins:
            self._record(name).pinned = True
        for s in servers:
            self.metrics.capacity_bytes.labels(s.name).set(s.spec.memory_budget_bytes or 0)

    @staticmethod
    def make_server(spec: ServerSpec, policy: str = DEFAULT_POLICY,
                    process: TritonProcess | None = None, admin: TritonAdmin | None = None):
        planner = CachePlanner(make_policy(policy), Capacity(spec.memory_budget_bytes, spec.max_loaded))
        return TritonServer(spec, admin or TritonAdmin(spec.grpc_url), planner, process)

    # ------------------------------------------------------------------ lookups
    def _record(self, name: str) -> ModelRecord:
        rec = self.records.get(name)
        if rec is None:
            rec = self.records[name] = ModelRecord(name)
        return rec

    def get(self, name: str) -> ModelRecord:
        validate_model_name(name)
        if name not in self.catalog and name not in self.records:
            raise ModelNotFound(f"unknown model {name!r}; `mmctl status` lists the known models")
        return self._record(name)

    def status(self) -> list[dict]:
        names = sorted(self.catalog | {n for n, r in self.records.items() if r.state != ModelState.WARM or r.pinned})
        return [self._record(n).to_dict() for n in names]

    def fleet(self) -> list[dict]:
        return [{**s.to_dict(), **self.memory.describe(s)} for s in self.servers.values()]

    def ready_server_of(self, name: str) -> TritonServer | None:
        """The server on which ``name`` is READY, or None.  No I/O: the router's hit path."""
        rec = self.records.get(name)
        if rec is None or rec.state != ModelState.READY or rec.server is None:
            return None
        return self.servers.get(rec.server)

    def on_loaded(self, listener: Callable[[str, ModelRecord], None]) -> None:
        self._load_listeners.append(listener)

    async def _known(self, name: str) -> None:
        """Raise ModelNotFound unless some server's repository (or a tier) has ``name``.

        Unknown names are remembered for a few seconds: a client repeating a bad name must
        not turn each request into index RPCs and registry queries."""
        if name in self.catalog:
            return
        refused_at = self._unknown.get(name)
        if refused_at is not None and time.monotonic() - refused_at < UNKNOWN_NAME_TTL_S:
            raise ModelNotFound(f"unknown model {name!r}: it is not in the model repository; "
                                "`mmctl status` lists the known models")
        if self.stager is not None and name in self.stager.known():
            return
        await self.refresh_catalog()
        if name not in self.catalog and not (self.stager is not None and name in self.stager.known()):
            if len(self._unknown) >= UNKNOWN_NAMES_MAX:
                self._unknown.clear()
            self._unknown[name] = time.monotonic()
            raise ModelNotFound(
                f"unknown model {name!r}: it is not in the model repository; "
                "`mmctl status` lists the known models"
            )
        self._unknown.pop(name, None)

    async def refresh_catalog(self) -> None:
        errors = []
        for server in self.servers.values():
            try:
                self.catalog.update((await server.admin.index()).keys())
                server.up = True
            except TritonUnavailable as exc:
                server.up = False
                errors.append(exc)
        if errors and len(errors) == len(self.servers):
            raise errors[0]

    def artifact_bytes(self, name: str) -> int:
        """Bytes of the model's files in the repository (CPU memory estimate)."""
        if self.repository is None:
            return 0
        root = self.repository / name
        if not root.is_dir():
            return 0
        return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())

    # ------------------------------------------------------------------ usage
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

    async def acquire(self, name: str) -> ModelRecord:
        """Count one request for ``name`` as in flight *before* it waits for a load, so the
        model it waits for cannot be chosen as a victim before the request is served."""
        rec = self.records.get(name)
        if rec is None:
            validate_model_name(name)
            await self._known(name)
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

    # ------------------------------------------------------------------ ensure / load
    async def ensure(self, name: str, retry_failed: bool = False) -> ModelRecord:
        """Return once ``name`` is READY on some server, loading it if needed."""
        validate_model_name(name)
        rec = self.records.get(name)
        if rec is not None and rec.state == ModelState.READY:
            self.metrics.hits.labels(name).inc()
            self.touch(name)
            return rec
        if (rec is not None and rec.state == ModelState.FAILED and not retry_failed
                and rec.failed_at is not None
                and time.monotonic() - rec.failed_at < self.config.failure_backoff_s):
            wait_s = self.config.failure_backoff_s - (time.monotonic() - rec.failed_at)
            what = (f"{name} may still be loaded on {rec.server}" if rec.server is not None
                    else f"{name} failed to load")
            raise ModelLoadFailed(f"{what}: {rec.failure}; not retrying for "
                                  f"{wait_s:.0f}s (mmctl load {name} retries now)")
        task = self._loads.get(name)
        if task is None:
            await self._known(name)
            task = self._loads.get(name)  # re-read: another caller may have started it meanwhile
        if task is None:
            self.metrics.misses.labels(name).inc()
            task = asyncio.get_running_loop().create_task(self._load(name))
            self._loads[name] = task
            task.add_done_callback(lambda _t, n=name: self._loads.pop(n, None))
        return await asyncio.shield(task)

    def _place(self, name: str, size_bytes: int) -> tuple[TritonServer, list[str]]:
        """Pick a server and the victims to evict there.  Pure; raises if none fits."""
        rec = self.records.get(name)
        try:
            return self.placer.place(name, size_bytes, self.servers.values(),
                                     pinned=bool(rec is not None and rec.pinned))
        except CapacityExhausted:
            self.metrics.capacity_errors.inc()
            raise

    async def _load(self, name: str) -> ModelRecord:
        pending_unload = self._unloads.get(name)
        if pending_unload is not None:
            with contextlib.suppress(ControlPlaneError):
                await asyncio.shield(pending_unload)
        rec = self._record(name)
        if rec.state == ModelState.READY:
            return rec
        if rec.state == ModelState.FAILED and rec.server is not None:
            # Its unload failed: the server may still hold it.  Loading it elsewhere would
            # serve it twice and leak that server's room, so unload it there first.
            held_by = self.servers[rec.server]
            try:
                await self._unload_now(held_by, name, reason="retry_after_failure")
            except ControlPlaneError as exc:
                raise ModelLoadFailed(
                    f"{name} may still be loaded on {held_by.name} ({exc.message}); it is not "
                    f"loaded anywhere else until {held_by.name} confirms it gone; retrying "
                    f"in {self.config.failure_backoff_s:.0f}s") from exc
        if self.stager is not None:
            # Cold -> warm before anything is reserved: a failed download holds no capacity.
            self.stager.set_busy(name, True)
            try:
                size_bytes = await self.stager.stage(name)
            except BaseException as exc:
                self.stager.set_busy(name, False)
                if isinstance(exc, ControlPlaneError) and not isinstance(exc, ModelNotFound):
                    # A bad artifact or an unreachable store: back off like a failed load.
                    rec.state, rec.failure, rec.failed_at = (
                        ModelState.FAILED, exc.message, time.monotonic())
                raise
        else:
            size_bytes = await asyncio.to_thread(self.artifact_bytes, name)  # a file walk
        for server in self.servers.values():
            if server.up:
                with contextlib.suppress(ControlPlaneError):
                    await self.refresh_usage(server)
        deadline = time.monotonic() + self.config.capacity_wait_s
        while True:
            async with self._lock:
                # Re-check after the lock: someone may have loaded it meanwhile.
                if rec.state == ModelState.READY:
                    return rec
                try:
                    server, victims = self._place(name, size_bytes)
                except CapacityExhausted:
                    # Room held only by loads/unloads in progress frees up in seconds: wait
                    # for one of them instead of failing; room held by pins is final.
                    busy = self._room_is_busy(name)
                    if not busy or time.monotonic() >= deadline:
                        self._release_warm(name)
                        raise
                    waiting = self._busy_tasks()
                else:
                    now = self.clock()
                    for v in victims:
                        server.planner.residents[v].evictable = False
                        server.planner.residents[v].leaving = True
                        self.records[v].state = ModelState.UNLOADING
                    server.planner.admit(
                        Resident(name, size_bytes, pinned=rec.pinned, evictable=False,
                                 priority=self.priority_of(name)), now,
                        load_cost_s=rec.load_time_s or 1.0,
                    )
                    previous_state = rec.state
                    rec.state, rec.server, rec.memory_bytes, rec.failure = (
                        ModelState.LOADING, server.name, size_bytes, None)
                    self._queued.setdefault(server.name, {})[name] = size_bytes
                    self._maintain_headroom(server)  # the next miss finds room again
                    break
            # Room comes back when a load/unload task ends or a request releases a model.
            timeout_s = min(0.05, max(0.0, deadline - time.monotonic()))
            if waiting:
                await asyncio.wait(waiting, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
            else:
                await asyncio.sleep(timeout_s)
        log.info("loading %s on %s (%d bytes), evicting %s", name, server.name, size_bytes, victims or "nothing")

        # 1. Room.  The victims' unloads run; the load is sent once Triton confirms room for
        # it, or at once where measured free memory holds it (overlap, module docstring).  A
        # victim that does not free in time keeps its memory counted.
        evictions = [self._unload_now(server, v, reason="evicted") for v in victims]
        for fut in evictions:
            fut.add_done_callback(_retrieve)  # failures are raised below or logged
        try:
            overlapped = await self._wait_for_room(
                server, name, size_bytes, evictions,
                # The longest an unload in progress takes before it fails on its own.
                time.monotonic() + self.config.drain_timeout_s + self.config.unload_timeout_s)
        except BaseException as exc:
            self._queued.get(server.name, {}).pop(name, None)
            self._release_warm(name)
            server.planner.remove(name)
            rec.state = previous_state if previous_state != ModelState.LOADING else ModelState.WARM
            rec.server = None
            self.metrics.loads.labels(server.name, "evict_failed").inc()
            if isinstance(exc, ControlPlaneError):
                raise OperationTimeout(
                    f"could not free room for {name} on {server.name}: {exc}") from exc
            raise
        # No await between the room check and this: the next waiter sees this load as held.
        self._queued[server.name].pop(name, None)
        self._sent[name] = (server.spec.device, size_bytes)
        if overlapped:
            log.info("loading %s on %s while %s still shut down: measured free memory holds it",
                     name, server.name, ", ".join(v for v, f in zip(victims, evictions) if not f.done())
                     or "models of other loads")
        for _ in victims:
            self.metrics.evictions.labels(server.name).inc()

        # 2. Load and warm up.
        start = time.monotonic()
        rec.loads += 1
        try:
            async with self.memory.measuring(server, name) as measured:
                await server.admin.load(name)
                warmup = await self._warm_up(server, name)
            if measured.bytes is not None:
                await self._fit_measured(server, rec, measured.bytes)
        except BaseException as exc:
            self._sent.pop(name, None)
            await self._undo_failed_load(server, rec, exc)
            raise
        self._sent.pop(name, None)
        rec.load_time_s = time.monotonic() - start
        rec.warmup = warmup
        rec.state = ModelState.READY
        self._sync_evictable(rec)
        self._maintain_headroom(server)
        rec.last_used = self.clock()
        self.metrics.loads.labels(server.name, "ok").inc()
        self.metrics.load_seconds.labels(server.name).observe(rec.load_time_s)
        self._update_gauges(server)
        self.store.save_model(name, last_used=rec.last_used, load_time_s=rec.load_time_s,
                              memory_bytes=rec.memory_bytes, server=server.name, failure=None)
        log.info("loaded %s on %s in %.2fs", name, server.name, rec.load_time_s)
        for listener in self._load_listeners:
            listener(name, rec)
        return rec

    async def _fit_measured(self, server: TritonServer, rec: ModelRecord, measured_bytes: int) -> None:
        """Account the size NVML measured; evict more when the model no longer fits, or
        raise CapacityExhausted (the caller unloads it) when nothing can make room."""
        async with self._lock:
            victims = plan_measured(server.planner, rec.name, measured_bytes)
            for v in victims:
                server.planner.residents[v].evictable = False
                self.records[v].state = ModelState.UNLOADING
            resident = server.planner.residents.get(rec.name)
            if resident is not None:
                resident.size_bytes = measured_bytes
            rec.memory_bytes = measured_bytes
        if victims:
            log.info("%s measured %d bytes on %s: evicting %s", rec.name, measured_bytes,
                     server.name, victims)
            await asyncio.gather(*(self._unload_now(server, v, reason="evicted") for v in victims),
                                 return_exceptions=True)  # a failed one stays counted
        self._update_gauges(server)

    def _fits_held(self, server: TritonServer, size_bytes: int) -> bool:
        """Whether one more model of ``size_bytes`` fits next to what Triton holds: loaded,
        loading, and unloading until confirmed gone (loads not sent yet left out)."""
        planner, cap = server.planner, server.planner.capacity
        queued = self._queued.get(server.name, {})
        if cap.max_slots is not None and planner.used_slots - len(queued) + 1 > cap.max_slots:
            return False
        return (cap.max_bytes is None
                or planner.used_bytes - sum(queued.values()) + size_bytes <= cap.max_bytes)

    def _fits_measured(self, server: TritonServer, size_bytes: int) -> bool:
        """The overlap rule: the device's measured free memory holds this load and every
        load in flight on it, each with ``overlap_margin_bytes`` (see the module docstring)."""
        if self.free_memory is None:
            return False
        try:
            free_bytes = self.free_memory(server)
        except Exception:  # a failing probe means no overlap, never a failed load
            if server.name not in self._probe_failed:
                self._probe_failed.add(server.name)
                log.exception("measuring free memory for %s failed; loads there wait for "
                              "Triton to confirm room", server.name)
            return False
        if free_bytes is None:
            return False
        margin = self.config.overlap_margin_bytes
        in_flight = sum(b + margin for device, b in self._sent.values() if device == server.spec.device)
        return free_bytes - in_flight >= size_bytes + margin

    async def _wait_for_room(self, server: TritonServer, name: str, size_bytes: int,
                             evictions: list[asyncio.Future], deadline: float) -> bool:
        """Wait until the load of ``name`` may be sent to Triton.  False: Triton's held room
        fits it; True: it starts before its victims are confirmed gone (overlap).

        Raises the first failed eviction of its own, or OperationTimeout when the room is
        held by models no unload is freeing (an unload failed: its room stays counted) or
        is not freed by ``deadline``."""
        while True:
            for fut in evictions:
                if fut.done() and not fut.cancelled() and fut.exception() is not None:
                    raise fut.exception()
            if self._fits_held(server, size_bytes):
                return False
            if self._fits_measured(server, size_bytes):
                return True
            freeing = [t for n, t in self._unloads.items()
                       if not t.done() and (r := self.records.get(n)) is not None and r.server == server.name]
            if not freeing:
                raise OperationTimeout(
                    f"its room on {server.name} is held by models whose unload did not complete; "
                    "they stay counted until Triton confirms them gone (mmctl status)")
            remaining_s = deadline - time.monotonic()
            if remaining_s <= 0:
                raise OperationTimeout(f"Triton did not confirm room for {name} in time")
            await asyncio.wait(freeing, return_when=asyncio.FIRST_COMPLETED,
                               timeout=min(remaining_s, ROOM_POLL_S) if self.free_memory else remaining_s)

    def _maintain_headroom(self, server: TritonServer) -> None:
        """Start unloading the policy's next victims when the server's free room is below its
        headroom (eviction.CachePlanner.headroom_victims); returns at once, the unloads run
        in the background.  Synchronous: the choice and the marking see the same state."""
        if not server.up:
            return
        victims = server.planner.headroom_victims()
        for v in victims:
            resident = server.planner.residents[v]
            resident.evictable = False
            resident.leaving = True
            self.records[v].state = ModelState.UNLOADING
        if victims:
            log.info("%s: unloading %s to keep room for the next miss", server.name, ", ".join(victims))
        for v in victims:
            self._unload_now(server, v, reason="headroom").add_done_callback(_retrieve)

    async def _warm_up(self, server: TritonServer, name: str) -> dict:
        """Warm ``name`` up as the model says; the result is what ``health`` shows.

        ``model``: its config has ``model_warmup``, which Triton ran during the load;
        ``off``: the config's ``mms_warmup`` parameter, the registry or the control plane's
        configuration turned the synthetic warm-up off; ``synthetic``: one inference with
        zeros shaped from the config (raises ModelLoadFailed saying what it sent)."""
        result = {"ok": True, "latency_ms": None, "checked_at": self.clock(), "error": None}
        if not self.config.warmup:
            return {**result, "mode": "off", "note": "warm-up is off in the control plane's configuration"}
        plan = await server.admin.warmup_plan(name)
        if plan.model_samples:
            return {**result, "mode": "model",
                    "note": f"Triton ran the model's own model_warmup ({plan.model_samples} "
                            "samples) during the load"}
        if not plan.synthetic_enabled:
            return {**result, "mode": "off",
                    "note": "config.pbtxt parameter mms_warmup is false: no synthetic warm-up"}
        if not self.warmup_enabled(name):
            return {**result, "mode": "off",
                    "note": "the registry turned the synthetic warm-up off for this model"}
        ms = await server.admin.warmup(name, plan)
        return {**result, "latency_ms": ms, "mode": "synthetic"}

    async def _undo_failed_load(self, server: TritonServer, rec: ModelRecord, exc: BaseException) -> None:
        """Unload whatever Triton kept and mark the model failed; memory freed once confirmed."""
        reason = exc.message if isinstance(exc, ControlPlaneError) else repr(exc)
        rec.failure = reason
        rec.failed_at = time.monotonic()
        rec.warmup = {"ok": False, "latency_ms": None, "checked_at": self.clock(), "error": reason}
        self.metrics.loads.labels(server.name, "failed").inc()
        try:
            await server.admin.unload(rec.name)
            await server.admin.wait_unavailable(rec.name, self.config.unload_timeout_s)
            await self.memory.released(server, rec.name)
        except ControlPlaneError as cleanup_exc:
            # Triton may still hold it: keep the bytes counted, the reconcile loop retries.
            log.error("%s failed (%s) and could not be unloaded: %s", rec.name, reason, cleanup_exc)
            rec.state = ModelState.FAILED
            return
        server.planner.remove(rec.name)
        self._release_warm(rec.name)
        rec.state = ModelState.FAILED
        rec.server = None
        self._update_gauges(server)
        self.store.save_model(rec.name, failure=reason)
        log.warning("load of %s on %s failed: %s", rec.name, server.name, reason)

    # ------------------------------------------------------------------ unload
    async def unload(self, name: str, force: bool = False) -> ModelRecord:
        """Unload ``name`` (explicit request).  Pinned models are refused unless forced."""
        rec = self.get(name)
        if rec.pinned and not force:
            raise InvalidInput(f"{name} is pinned; unpin it first (mmctl unpin {name})")
        load = self._loads.get(name)
        if load is not None:
            with contextlib.suppress(ControlPlaneError):
                await asyncio.shield(load)
        async with self._lock:
            # A pin that arrived while this unload waited for the load wins: the pinned
            # model stays loaded instead of being unloaded under a pin.
            if rec.pinned and not force:
                raise InvalidInput(f"{name} was pinned while this unload waited for its load; "
                                   f"unpin it first (mmctl unpin {name})")
            if (rec.state not in (ModelState.READY, ModelState.FAILED, ModelState.UNLOADING)
                    or rec.server is None):
                return rec
            server = self.servers[rec.server]
            resident = server.planner.residents.get(name)
            if resident is not None:
                # On its way out it holds its slot as busy, not as a pin (a forced unload of
                # a pinned model keeps the pin: the reconcile loads it again).  A failed
                # model retried here is not leaving: its room stays held until confirmed.
                resident.evictable = False
                resident.pinned = False
                resident.leaving = rec.state == ModelState.READY
            if rec.state == ModelState.READY:
                rec.state = ModelState.UNLOADING
        await self._unload_now(server, name, reason="requested")
        return rec

    def _unload_now(self, server: TritonServer, name: str, reason: str) -> asyncio.Future:
        task = self._unloads.get(name)
        if task is None:
            task = asyncio.get_running_loop().create_task(self._do_unload(server, name, reason))
            self._unloads[name] = task
            task.add_done_callback(lambda _t, n=name: self._unloads.pop(n, None))
        return asyncio.shield(task)

    async def _do_unload(self, server: TritonServer, name: str, reason: str) -> None:
        rec = self.records[name]
        rec.state = ModelState.UNLOADING
        # Drain: requests holding a lease finish first (bounded by drain_timeout_s).
        deadline = time.monotonic() + self.config.drain_timeout_s
        # Only requests already sent to Triton are drained: requests still waiting for this
        # model wait for the unload to finish, so waiting on them would deadlock.
        while rec.active > 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        if rec.active > 0:
            log.warning("%s still has %d requests in flight after %.0fs; unloading anyway "
                        "(Triton lets running requests finish)", name, rec.active,
                        self.config.drain_timeout_s)
        start = time.monotonic()
        try:
            await server.admin.unload(name)
            await server.admin.wait_unavailable(name, self.config.unload_timeout_s)
        except ControlPlaneError as exc:
            # Triton may still hold it: the server, and its room, stay counted until Triton
            # confirms it gone (the reconcile retries after the backoff, as does a load).
            rec.state = ModelState.FAILED
            rec.failure = f"unload did not complete: {exc.message}"
            rec.failed_at = time.monotonic()
            resident = server.planner.residents.get(name)
            if resident is not None:
                resident.evictable = False
                resident.pinned = False
                resident.leaving = False  # it holds its room again
            log.error("unload of %s on %s failed: %s", name, server.name, exc.message)
            raise
        # Free only once NVML shows the memory back (on a GPU; what is not back stays counted).
        await self.memory.released(server, name)
        freed_s = time.monotonic() - start
        self.metrics.unload_free_seconds.labels(server.name).observe(freed_s)
        self.metrics.unloads.labels(server.name, reason).inc()
        server.planner.remove(name)
        self._release_warm(name)
        rec.state, rec.server, rec.warmup = ModelState.WARM, None, None
        self._update_gauges(server)
        self.store.save_model(name, server=None)
        log.info("unloaded %s from %s (%s); memory free after %.2fs", name, server.name, reason, freed_s)

    # ------------------------------------------------------------------ pins
    async def pin(self, name: str) -> ModelRecord:
        """Pin and make resident.  If it cannot be loaded, the pin is not kept.

        The pin counts from the start of the call: an unload still waiting for this model's
        load gives way to it, and one already under way is awaited before loading again."""
        validate_model_name(name)
        await self._known(name)  # cold models (registry only) can be pinned too
        rec = self._record(name)
        was_pinned = rec.pinned
        self._set_pinned(rec, True)
        try:
            await self.ensure(name)
        except BaseException:
            if not was_pinned and rec.pinned:  # an unpin meanwhile already undid it
                self._set_pinned(rec, False)
            raise
        if rec.pinned:  # not unpinned while the load ran
            self._set_pinned(rec, True)
            self.store.set_pin(name, True)
        return rec

    async def unpin(self, name: str) -> ModelRecord:
        rec = self.get(name)
        self._set_pinned(rec, False)
        self.store.set_pin(name, False)
        return rec

    def _set_pinned(self, rec: ModelRecord, pinned: bool) -> None:
        """Set the pin on the record and on its resident, if it holds one."""
        rec.pinned = pinned
        server = self.servers.get(rec.server) if rec.server else None
        resident = server.planner.residents.get(rec.name) if server else None
        if resident is not None:
            # A model on its way out (unloading, or stuck after a failure) holds its slot as
            # busy, not as a pin: the pin takes its slot again when the model is reloaded.
            resident.pinned = pinned and rec.state in (ModelState.READY, ModelState.LOADING)

    def _repair_pins(self) -> None:
        """Start a load of every pinned model that is not loaded: Triton dropped it, a
        forced unload took it, or it lost a race with an unload.  Failures back off."""
        now = time.monotonic()
        for name, rec in self.records.items():
            if (not rec.pinned or rec.state in (ModelState.READY, ModelState.LOADING, ModelState.UNLOADING)
                    or name in self._loads or name in self._unloads or name in self._pin_repairs
                    or now < self._pin_retry_at.get(name, 0.0)):
                continue
            if (rec.state == ModelState.FAILED and rec.failed_at is not None
                    and now - rec.failed_at < self.config.failure_backoff_s):
                continue
            self._pin_repairs.add(name)
            self._spawn(self._repair_pin(rec))

    async def _repair_pin(self, rec: ModelRecord) -> None:
        try:
            await self.ensure(rec.name)
        except ControlPlaneError as exc:
            self._pin_retry_at[rec.name] = time.monotonic() + self.config.failure_backoff_s
            failure = f"pinned but not loaded: {exc.message}"
            if rec.failure != failure:  # once per distinct reason, not once per pass
                log.error("pinned model %s could not be loaded: %s", rec.name, exc.message)
            rec.failure = failure
        else:
            self._pin_retry_at.pop(rec.name, None)
            log.info("loaded pinned model %s again", rec.name)
        finally:
            self._pin_repairs.discard(rec.name)

    # ------------------------------------------------------------------ health
    async def health(self, name: str, probe: bool = False) -> dict:
        rec = self.get(name)
        if probe and rec.state == ModelState.READY and rec.server:
            server = self.servers[rec.server]
            try:
                # A probe sends the synthetic request only to a model warmed up that way;
                # for the others it asks Triton whether the model is READY.
                result = await self._warm_up(server, name)
                if result["mode"] != "synthetic":
                    entry = (await server.admin.index()).get(name)
                    if entry is None or entry.state != TritonModelState.READY:
                        state = entry.state.value if entry is not None else "absent"
                        result = {**result, "ok": False,
                                  "error": f"Triton reports {name} {state or 'not loaded'}"}
                rec.warmup = result
            except ControlPlaneError as exc:
                rec.warmup = {"ok": False, "latency_ms": None, "checked_at": self.clock(),
                              "error": exc.message, "mode": "synthetic"}
        return {
            "model": name,
            "state": rec.state.value,
            "server": rec.server,
            "healthy": rec.healthy,
            "warmup": rec.warmup,
            "failure": rec.failure,
        }

    # ------------------------------------------------------------------ reconcile
    async def start(self) -> None:
        """Reconcile with every Triton, then load the pinned models."""
        await self.step()
        await self.load_pinned()

    async def load_pinned(self) -> None:
        for name in sorted(n for n, r in self.records.items() if r.pinned):
            rec = self.records[name]
            if rec.state == ModelState.READY:
                continue
            try:
                await self.ensure(name)
            except ControlPlaneError as exc:
                rec.failure = f"pinned but not loaded: {exc.message}"
                log.error("pinned model %s could not be loaded: %s", name, exc.message)

    async def step(self) -> None:
        """One reconcile pass: re-read each Triton's index and correct what drifted."""
        for server in list(self.servers.values()):
            try:
                await self._reconcile_server(server)
            except Exception:  # one failing server never stops the loop
                log.exception("reconcile of %s failed", server.name)
            self._maintain_headroom(server)
        self._repair_pins()

    async def _reconcile_server(self, server: TritonServer) -> None:
        if server.process is not None and not server.process.alive():
            await self._restart_triton(server)
            return
        try:
            index = await server.admin.index()
        except TritonUnavailable:
            if server.up:
                log.error("Triton %s at %s is not answering", server.name, server.spec.grpc_url)
            server.up = False
            self.metrics.server_up.labels(server.name).set(0)
            return
        was_down = not server.up
        server.up = True
        self.metrics.server_up.labels(server.name).set(1)
        self.catalog.update(index)

        def ours(rec: ModelRecord | None) -> bool:
            return (rec is not None and rec.server == server.name
                    and rec.state in (ModelState.READY, ModelState.FAILED))

        # Models to adopt are sized first, in a thread (a file walk), outside the lock.
        to_adopt = [n for n, e in index.items()
                    if e.state == TritonModelState.READY and not ours(self.records.get(n))]
        sizes = (await asyncio.to_thread(lambda: {n: self.artifact_bytes(n) for n in to_adopt})
                 if to_adopt else {})
        busy = set(self._loads) | set(self._unloads)
        async with self._lock:
            for name, entry in index.items():
                if name in busy:
                    continue
                rec = self._record(name)
                if entry.state == TritonModelState.READY and not ours(rec):
                    if rec.state == ModelState.READY and rec.server != server.name:
                        continue  # loaded on another server too; keep our placement
                    size = sizes.get(name)
                    if size is None:
                        continue  # it changed while the others were sized: the next pass
                    server.planner.admit(Resident(name, size, pinned=rec.pinned,
                                                  priority=self.priority_of(name)), self.clock())
                    rec.state, rec.server, rec.memory_bytes = ModelState.READY, server.name, size
                    rec.warmup = rec.warmup or {"ok": True, "latency_ms": None,
                                                "checked_at": self.clock(), "error": None,
                                                "note": "adopted from Triton's index"}
                    log.warning("adopted %s: Triton %s has it loaded", name, server.name)
                elif (entry.state == TritonModelState.READY and rec.state == ModelState.FAILED
                        and rec.server == server.name):
                    # Its unload (after a failure) did not complete: try again after the
                    # backoff, so the memory is freed and counted free once Triton confirms.
                    if (rec.failed_at is None
                            or time.monotonic() - rec.failed_at >= self.config.failure_backoff_s):
                        self._spawn(self._retry_unload(server, name))
                elif entry.state != TritonModelState.READY and ours(rec):
                    if entry.state in (TritonModelState.LOADING, TritonModelState.UNLOADING):
                        continue
                    server.planner.remove(name)
                    self._release_warm(name)
                    if rec.state == ModelState.READY:
                        log.warning("%s is no longer loaded on %s (%s)", name, server.name,
                                    entry.reason or entry.state.value)
                        rec.state = ModelState.WARM
                    else:
                        rec.state = ModelState.FAILED  # keep the failure reason visible
                    rec.server = None
            for name, rec in self.records.items():
                if rec.server == server.name and name not in index and name not in busy:
                    server.planner.remove(name)
                    self._release_warm(name)
                    rec.state, rec.server = ModelState.WARM, None
        self._update_gauges(server)
        with contextlib.suppress(ControlPlaneError):
            await self.refresh_usage(server)
        await self._enforce_capacity(server)
        if was_down:
            self._spawn(self.load_pinned())

    async def _restart_triton(self, server: TritonServer) -> None:
        """Relaunch a managed Triton that died; the event loop keeps serving meanwhile."""
        now = time.monotonic()
        if now < server.next_restart_at:
            return
        log.error("tritonserver %s exited (code %s); restarting it", server.name,
                  server.process.proc.returncode if server.process.proc else None)
        server.up = False
        self.metrics.server_up.labels(server.name).set(0)
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
        self.metrics.server_up.labels(server.name).set(1)
        self._spawn(self.load_pinned())

    def _forget_server_models(self, server: TritonServer, reason: str) -> None:
        for name, rec in self.records.items():
            if rec.server == server.name:
                server.planner.remove(name)
                self._release_warm(name)
                rec.state, rec.server = ModelState.WARM, None
                rec.failure = reason
        self._update_gauges(server)

    async def _retry_unload(self, server: TritonServer, name: str) -> None:
        with contextlib.suppress(ControlPlaneError):
            await self._unload_now(server, name, reason="retry_after_failure")

    async def _enforce_capacity(self, server: TritonServer) -> None:
        """After adopting what Triton had loaded, evict down to the budget (unpinned, LRU)."""
        cap = server.planner.capacity
        while True:
            # A load in progress is reserved while its victims still count until Triton frees
            # them: that transient overshoot is by design, not drift.
            if self._loads or self._unloads:
                return
            over_slots = cap.max_slots is not None and server.planner.used_slots > cap.max_slots
            over_bytes = cap.max_bytes is not None and server.planner.used_bytes > cap.max_bytes
            if not (over_slots or over_bytes):
                return
            victim = next((k for k in server.planner.policy.victim_order()
                           if not server.planner.residents[k].pinned
                           and server.planner.residents[k].evictable), None)
            if victim is None:
                log.error("%s is over its budget (%s) with only pinned models", server.name,
                          cap.describe())
                return
            server.planner.residents[victim].evictable = False
            server.planner.residents[victim].leaving = True
            try:
                await self._unload_now(server, victim, reason="over_budget")
            except ControlPlaneError:
                return

    def _room_is_busy(self, name: str) -> bool:
        """Room held by loads/unloads in progress or by requests (not by pins or failures)
        that ``name`` could get once they end.  A shadow can only get room that an unload
        frees or that a shadow holds: room of a serving model that is loading or in use
        never becomes its."""
        limit = victim_priority_limit(self.priority_of(name))
        for server in self.servers.values():
            for r in server.planner.residents.values():
                rec = self.records.get(r.key)
                if r.evictable or r.pinned or rec is None or rec.state == ModelState.FAILED:
                    continue
                if limit is None or rec.state == ModelState.UNLOADING or r.priority <= limit:
                    return True
        return False

    def _busy_tasks(self) -> set[asyncio.Task]:
        me = asyncio.current_task()
        return {t for t in (*self._loads.values(), *self._unloads.values()) if t is not me and not t.done()}

    def _release_warm(self, name: str) -> None:
        """The warm tier may drop ``name`` again (it is neither loaded nor loading)."""
        if self.stager is not None:
            self.stager.set_busy(name, False)

    def _update_gauges(self, server: TritonServer) -> None:
        self.metrics.loaded_bytes.labels(server.name).set(server.planner.used_bytes)
        self.metrics.loaded_models.labels(server.name).set(server.planner.used_slots)

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def run_forever(self, interval_s: float = 2.0) -> None:
        while True:
            await asyncio.sleep(interval_s)
            await self.step()

    async def close(self) -> None:
        for task in list(self._background) + list(self._loads.values()) + list(self._unloads.values()):
            task.cancel()
        for server in self.servers.values():
            await server.admin.close()
