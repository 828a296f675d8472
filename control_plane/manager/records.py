"""What the model manager keeps per model and per Triton server, and its configuration.

Plain data: no I/O, no event loop.  ``ModelRecord``'s methods are the only writers of a record (the manager's parts call them).
"""

from __future__ import annotations

import enum
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol, Self

from control_plane.eviction import CachePlanner
from control_plane.triton.admin import TritonAdmin
from control_plane.triton.process import TritonProcess
from domain.errors import InvalidInput

log = logging.getLogger(__name__)


class ModelState(str, enum.Enum):
    """Where a model is: no copy (``warm``: its artifacts wait in a tier; ``failed``: its
    load failed and nothing holds it), or its copy's state on ``ModelRecord.server``."""

    WARM = "warm"  # no copy on any server; the artifacts are in the warm or cold tier
    LOADING = "loading"
    READY = "ready"
    UNLOADING = "unloading"
    FAILED = "failed"  # its load failed; no server holds it (retried after the backoff)
    UNLOAD_FAILED = "unload_failed"  # its unload did not complete: its server may hold it


_S = ModelState
# Every change of a model's state the manager makes, and why; ``ModelRecord.move`` is the
# only writer of ``state`` and checks each change against this table.  Staying in a state
# is always allowed.
TRANSITIONS: dict[ModelState, frozenset[ModelState]] = {
    # loaded; Triton already has it (adopted at start); staging failed
    _S.WARM: frozenset({_S.LOADING, _S.READY, _S.FAILED}),
    # Triton answered; the load failed (cleaned up, or not: it may hold room); no room after
    # all (back to where it was); its server went away mid-load
    _S.LOADING: frozenset({_S.READY, _S.FAILED, _S.UNLOAD_FAILED, _S.WARM, _S.UNLOADING}),
    # evicted or unloaded; Triton no longer has it or its server went down
    _S.READY: frozenset({_S.UNLOADING, _S.WARM}),
    # unloaded; the unload failed; Triton still has it (found by the reconcile)
    _S.UNLOADING: frozenset({_S.WARM, _S.UNLOAD_FAILED, _S.READY}),
    # retried; given up and forgotten; Triton has it after all (adopted)
    _S.FAILED: frozenset({_S.LOADING, _S.WARM, _S.READY}),
    # retried; Triton confirmed it gone (the load that failed stays visible: failed); Triton
    # serves it after all (adopted); forgotten with its server
    _S.UNLOAD_FAILED: frozenset({_S.UNLOADING, _S.FAILED, _S.WARM, _S.READY}),
}
# The test suite sets MMS_STRICT_TRANSITIONS=1: an illegal change fails loudly there.  In
# production it is logged and counted (``mms_illegal_transitions_total``) and made anyway:
# serving goes on with what Triton really holds.
STRICT_ENV = "MMS_STRICT_TRANSITIONS"


class IllegalTransition(RuntimeError):
    """A change of a model's state that ``TRANSITIONS`` does not list."""


# ``ModelRecord.move``'s default for ``server``: leave it as it is.
KEEP = object()
# The states of a copy on a server; the others (warm, failed) are a model's with no copy.
COPY_STATES = frozenset({ModelState.LOADING, ModelState.READY, ModelState.UNLOADING,
                         ModelState.UNLOAD_FAILED})


@dataclass
class Copy:
    """A model's copy on one server: the room it holds there and its state (one of
    ``COPY_STATES``).  ``room_promised``: while unloading, whether loads may plan on its room
    (not while a failed unload is retried, nor for a victim of a load that grew: its room
    is not free)."""

    server: str
    state: ModelState
    room_promised: bool = False


POOL_SEPARATOR = "@"  # never in a model's name (domain.names), so a pool's key is no model's
# Never in a model's name either: a model's extra copy's key is no model's.
COPY_SEPARATOR = "#"


class ServerEntryKey(str):
    """The key of an entry of one server that is not a model's own copy: ``name`` and
    ``server`` joined by the kind's separator where it is shown, its parts kept, so code asks
    the key's type and parts and never parses it.  Its record's name and its planner entry."""

    separator = ""
    name: str
    server: str

    def __new__(cls, name: str, server: str) -> Self:
        key = super().__new__(cls, f"{name}{cls.separator}{server}")
        key.name, key.server = name, server
        return key

    def __getnewargs__(self) -> tuple[str, str]:  # copies and pickles keep the parts
        return self.name, self.server


class PoolKey(ServerEntryKey):
    """``holder``'s slots (a family model's) on ``server``: ``holder@server``."""

    separator = POOL_SEPARATOR

    @property
    def holder(self) -> str:
        return self.name


class CopyKey(ServerEntryKey):
    """``model``'s extra copy on ``server`` (the model's own copy is keyed by its name):
    ``model#server``."""

    separator = COPY_SEPARATOR

    @property
    def model(self) -> str:
        return self.name


@dataclass
class ModelRecord:
    """A model and its copies, one per server that holds (or may hold) it: ``copies``.  A
    model has one copy at most today; its ``state`` is that copy's, or ``settled`` (warm, or
    failed) when it has none.

    ``move``, ``resize``, ``set_pinned``, ``hold`` and ``release`` are the only writers of
    what the eviction planner sees (copies, size, pin, holds); each tells ``on_change``,
    which derives the planner's entries (``residency.Residency.sync``).

    A record with ``slot_bytes`` is a slot pool's on one server (``ModelBook.pool``: a
    family model, named ``PoolKey(family, server)``): its copy holds ``memory_bytes``, all
    of its slots, from its load until Triton confirms it unloaded, whatever fills them."""

    name: str
    settled: ModelState = ModelState.WARM  # the state when it has no copy
    copies: dict[str, Copy] = field(default_factory=dict)  # server -> its copy there
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
    # Called with (from, to) for an illegal change (the manager counts it).
    on_illegal: Callable[[ModelState, ModelState], None] | None = field(default=None, repr=False,
                                                                         compare=False)
    # Called with the model's name after each change of state (the data-plane hub publishes
    # the model's placement then).
    on_move: Callable[[str], None] | None = field(default=None, repr=False, compare=False)
    # Called with the record after every change of what the planner sees.
    on_change: Callable[[ModelRecord], None] | None = field(default=None, repr=False,
                                                            compare=False)
    moved_at: float = 0.0  # monotonic time of the last change of state
    slot_bytes: int = 0  # a slot pool's bytes per slot (fixed when it is made); 0: a model
    # A model's extra copies (mmctl scale), server -> the copy's record (named
    # ``CopyKey(model, server)``): each moves through the states on its own, as a copy loads
    # on one server while the model serves on another.  Empty for the others.
    extra: dict[str, ModelRecord] = field(default_factory=dict, repr=False, compare=False)

    @property
    def triton_name(self) -> str:
        """The model Triton loads for this record: the model's, its family's (a slot pool's)."""
        return self.copy_of or self.holder or self.name

    @property
    def copy_of(self) -> str | None:
        """An extra copy's model (its key's), or None for a model's own record."""
        return self.name.model if isinstance(self.name, CopyKey) else None

    @property
    def holder(self) -> str | None:
        """A slot pool's Triton model (the family), or None for a model."""
        return self.name.holder if isinstance(self.name, PoolKey) else None

    @property
    def slots(self) -> int:
        """A slot pool's slots (0 for a model)."""
        return self.memory_bytes // self.slot_bytes if self.slot_bytes else 0

    @property
    def copy(self) -> Copy | None:
        """The model's copy (one at most today), or None."""
        return next(iter(self.copies.values()), None)

    @property
    def state(self) -> ModelState:
        copy = self.copy
        return copy.state if copy is not None else self.settled

    @property
    def server(self) -> str | None:
        """The server of its copy, or None."""
        copy = self.copy
        return copy.server if copy is not None else None

    @property
    def room_promised(self) -> bool:
        copy = self.copy
        return copy is not None and copy.room_promised

    def move(self, to: ModelState, server: str | None | object = KEEP,
             memory_bytes: int | None = None, room_promised: bool = True) -> None:
        """Change the model's state (one ``TRANSITIONS`` lists): a copy state on ``server``
        (its copy's server by default), or warm / failed, which leave no copy.  ``memory_bytes``:
        its size; ``room_promised``: for ``UNLOADING``, whether loads may plan on its room."""
        now = self.state
        if to != now and to not in TRANSITIONS[now]:
            message = f"{self.name}: illegal state change {now.value} -> {to.value}"
            if os.environ.get(STRICT_ENV) == "1":
                raise IllegalTransition(message)
            log.error("%s (made anyway; please report it)", message)
            if self.on_illegal is not None:
                self.on_illegal(now, to)
        if memory_bytes is not None:
            self.memory_bytes = memory_bytes
        if to in COPY_STATES:
            where = self.server if server is KEEP else server
            if not isinstance(where, str):
                raise ValueError(f"{self.name}: a {to.value} model is on a server; name it")
            copy = self.copies.get(where)
            if copy is None:  # one copy per model: a copy placed elsewhere replaces it
                copy = Copy(where, to)
                self.copies = {where: copy}
            if to != ModelState.UNLOADING:
                copy.room_promised = False
            elif copy.state != ModelState.UNLOADING:
                copy.room_promised = room_promised and copy.state != ModelState.UNLOAD_FAILED
            copy.state = to
        else:
            if server is not KEEP and server is not None:
                raise ValueError(f"{self.name}: a {to.value} model has no copy on a server")
            self.copies = {}
            self.settled = to
        self.moved_at = time.monotonic()
        self._changed()
        if to != now and self.on_move is not None:
            self.on_move(self.name)

    def resize(self, memory_bytes: int) -> None:
        """The copy's measured size."""
        self.memory_bytes = memory_bytes
        self._changed()

    def set_pinned(self, pinned: bool) -> None:
        self.pinned = pinned
        self._changed()

    def hold(self) -> None:
        """One more request holds the model (waiting for it or running on it)."""
        self.inflight += 1
        if self.inflight == 1:
            self._changed()

    def release(self) -> None:
        self.inflight -= 1
        if self.inflight == 0:
            self._changed()

    def _changed(self) -> None:
        if self.on_change is not None:
            self.on_change(self)

    def to_dict(self) -> dict:
        return {
            "model": self.name,
            "state": self.state.value,
            "server": self.server,
            "copies": [{"server": c.server, "state": c.state.value} for c in self.copies.values()],
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
    # Requests it takes at once from the router; past that, fair shares (None: no gate).
    concurrency: int | None = None

    def __post_init__(self):
        if self.memory_budget_bytes is not None and self.memory_budget_bytes <= 0:
            raise InvalidInput(f"memory budget ({self.memory_budget_bytes}) must be > 0 bytes")
        if self.max_loaded is not None and self.max_loaded < 1:
            raise InvalidInput(f"max_loaded ({self.max_loaded}) must be >= 1")
        if self.concurrency is not None and self.concurrency < 1:
            raise InvalidInput(f"concurrency ({self.concurrency}) must be >= 1")


class ServerHealth(str, enum.Enum):
    """Whether a Triton answers (``control_plane.manager.health.Health`` moves it)."""

    UP = "up"
    SUSPECT = "suspect"  # missed a probe, fewer than ManagerConfig.probe_failures in a row: serves
    DOWN = "down"  # missed probe_failures in a row, refused a request, or its index read failed
    LOST = "lost"  # down past ManagerConfig.server_lost_after_s: its models were placed elsewhere


_H = ServerHealth
# Every change of a server's health; ``Health`` is the only writer and checks each change
# against this table.  A down server is up again only once it answers.
HEALTH_TRANSITIONS: dict[ServerHealth, frozenset[ServerHealth]] = {
    _H.UP: frozenset({_H.SUSPECT, _H.DOWN}),  # a probe missed; no answer at all
    _H.SUSPECT: frozenset({_H.UP, _H.DOWN}),  # it answered; probe_failures missed in a row
    _H.DOWN: frozenset({_H.UP, _H.LOST}),  # it answers again; down for server_lost_after_s
    _H.LOST: frozenset({_H.UP}),  # it answers again
}


@dataclass
class TritonServer:
    spec: ServerSpec
    admin: TritonAdmin
    planner: CachePlanner
    process: TritonProcess | None = None
    # health, missed_probes, down_since and the restart back-off: written by
    # manager.health.Health only.
    health: ServerHealth = ServerHealth.UP
    missed_probes: int = 0  # in a row, since it last answered
    restart_failures: int = 0
    next_restart_at: float = 0.0  # monotonic; restarts of a crashing Triton back off
    down_since: float | None = None  # monotonic; when it stopped answering
    # Models forgotten here while it did not answer (placed elsewhere since): a copy it
    # still has when it answers again is unloaded, so nothing is loaded twice.
    left_behind: set[str] = field(default_factory=set)
    # Whether Triton's model control needs the restricted-API key: "restricted", "open"
    # (anyone who reaches its ports can load code: an attached Triton started without
    # the key) or "unknown" (not checked, or it did not answer).
    model_control: str = "unknown"

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def up(self) -> bool:
        """Serves and takes models: up, or suspect (one missed probe is no alarm)."""
        return self.health in (ServerHealth.UP, ServerHealth.SUSPECT)

    @property
    def lost(self) -> bool:
        """Down past ``server_lost_after_s``: what it held was placed on the others."""
        return self.health is ServerHealth.LOST

    def to_dict(self) -> dict:
        return {
            "server": self.name,
            "device": self.spec.device,
            "grpc_url": self.spec.grpc_url,
            "http_url": self.spec.http_url,
            "metrics_url": self.spec.metrics_url,
            "up": self.up,
            "health": self.health.value,
            "lost": self.lost,
            "managed": self.process is not None,
            "model_control": self.model_control,
            "memory_budget_bytes": self.spec.memory_budget_bytes,
            "max_loaded": self.spec.max_loaded,
            "used_bytes": self.planner.used_bytes,
            "headroom": vars(self.planner.headroom_target()),
            "loaded": sorted(k for k, r in self.planner.residents.items() if not r.holds),
            # Model families loaded here: the most variants their slots take, the variants
            # in them and the bytes those fill (counted in used_bytes; empty slots hold none).
            "slot_pools": {k.holder: {
                "slots": r.holds, "members": self.planner.members(k),
                "bytes": self.planner.members(k) * (r.size_bytes // max(r.holds, 1))}
                for k, r in sorted(self.planner.residents.items()) if r.holds},
        }


class Stager(Protocol):
    """Makes a model's artifacts present in Triton's repository (the warm tier) before a load.

    ``stage`` returns the model's size in bytes (downloading from the cold store if needed)
    and raises ModelNotFound / ModelLoadFailed with a clear reason; ``set_busy`` marks
    models the warm tier must not drop while they are loaded or loading; ``known`` lists
    models that exist in any tier (cold included) so they can be ensured.
    """

    async def stage(self, model: str) -> int: ...

    def set_busy(self, model: str, busy: bool) -> None: ...

    def known(self) -> set[str]: ...
