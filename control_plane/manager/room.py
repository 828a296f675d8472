"""Room on a server that Triton holds, and the device memory measured free.

Two checks decide when a load reserved under the manager's lock may be sent to Triton
(see the package docstring): ``fits_held`` (Triton's held room plus the newcomer fits the
budget) and ``fits_measured`` (the overlap rule).  ``host_available_bytes`` is the
``free_memory`` probe of CPU servers.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import logging
import time
from collections.abc import Callable, Iterator

from control_plane.manager.manager_config import ManagerConfig
from control_plane.manager.records import ModelRecord, TritonServer
from domain.errors import OperationTimeout

log = logging.getLogger(__name__)

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


class Turns:
    """Waiters for room in the order they started waiting: each holds a ``Place`` (a ticket
    taken at its first wait, kept over its retries) and waits on its turn between tries;
    ``wake_oldest`` completes the turn of the oldest still waiting.

    Room that came back is promised to the waiter woken for it until that waiter has tried
    (``Place.trying``) or left: a load that has not waited yet does not take it meanwhile
    (``promised``).  Between the wake and the woken waiter's try the event loop runs other
    tasks, and a miss arriving then would otherwise place at once and take the room, the
    woken waiter passing its turn on down the queue for nothing: under thrash the newest
    misses were served first and the oldest waited on (the tail)."""

    def __init__(self):
        # (ticket, entry, turn): a heap.  A ticket may be there twice (a turn passed on is
        # left in place, done, beside its waiter's next one): the entry number breaks the tie.
        self._turns: list[tuple[int, int, asyncio.Future]] = []
        self._tickets = itertools.count()
        self._entries = itertools.count()
        self._promised: set[int] = set()  # tickets woken that have not tried since

    def promised(self) -> bool:
        """Whether room that came back waits for a woken waiter's try."""
        return bool(self._promised)

    def place(self) -> Place:
        return Place(self)

    def wake_oldest(self) -> bool:
        """Complete the oldest waiter's turn; False when none waits."""
        while self._turns:
            ticket, _entry, turn = heapq.heappop(self._turns)
            if not turn.done():  # a waiter that left cancelled its own
                turn.set_result(None)
                self._promised.add(ticket)
                return True
        return False

    def wake_next_after(self, ticket: int) -> bool:
        """Complete the turn of the oldest waiter younger than ``ticket``; False when none
        waits.  A turn passed on goes one way, so passing it on ends at the youngest."""
        younger = [entry for entry in self._turns if entry[0] > ticket and not entry[2].done()]
        if not younger:
            return False
        ticket, _entry, turn = min(younger)
        turn.set_result(None)  # popped as done later
        self._promised.add(ticket)
        return True

    def _queue(self, ticket: int) -> asyncio.Future:
        turn = asyncio.get_running_loop().create_future()
        heapq.heappush(self._turns, (ticket, next(self._entries), turn))
        return turn


class Place:
    """One waiter's place in ``Turns``."""

    def __init__(self, turns: Turns):
        self._turns = turns
        self._ticket: int | None = None
        self._turn: asyncio.Future | None = None

    @property
    def woken(self) -> bool:
        """Its last turn came (``wake_oldest`` chose it, or an older waiter passed it on)."""
        return self._turn is not None and self._turn.done()

    def turn(self) -> asyncio.Future:
        """The future done when it is this waiter's turn to try again: the one waited on
        before while it did not come, else a new one in the ticket's place."""
        if self._ticket is None:
            self._ticket = next(self._turns._tickets)
        if self._turn is None or self._turn.done():
            self._turn = self._turns._queue(self._ticket)
        return self._turn

    def pass_on(self) -> bool:
        """After a try that failed: if it was woken for that try (for room it could not use),
        wake the next waiter after it (one that may fit where this one did not).  Never the
        waiters before it, which already had this turn: passed back, two waiters that cannot
        use the room would wake each other without end.  Not woken: nothing to pass on."""
        return self.woken and self._turns.wake_next_after(self._ticket)

    async def behind_promised(self, timeout_s: float) -> None:
        """Before a load's first try: while room that came back is promised to a woken
        waiter (``Turns.promised``), wait behind it, at most ``timeout_s``."""
        if self._turns.promised():
            await asyncio.wait({self.turn()}, timeout=timeout_s)

    def trying(self) -> None:
        """It tries for room now: what was promised to it is its own or, once it passes
        its turn on, the next waiter's."""
        self._turns._promised.discard(self._ticket)

    def leave(self) -> None:
        """Stop waiting: its turn, if still queued, goes to nobody; room woken for it that
        it left without trying for goes to the next waiter."""
        if self._turn is not None:
            self._turn.cancel()
        if self._ticket in self._turns._promised:
            self._turns._promised.discard(self._ticket)
            self._turns.wake_next_after(self._ticket)


class RoomLedger:
    """Loads reserved and not sent to Triton yet (server -> model -> bytes), and loads sent
    and not finished (model -> (device, bytes)): held room and the overlap rule.

    Every change happens on the event loop with no ``await`` between a check and the
    change that follows it, so the next waiter sees a load as held."""

    def __init__(self, config: ManagerConfig,
                 free_memory: Callable[[TritonServer], int | None] | None = None):
        self.config = config
        # Measured free bytes of a server's device now, or None: the overlap rule (see the
        # package docstring); host_available_bytes on CPU.  None: nothing overlaps.
        self.free_memory = free_memory
        self.queued: dict[str, dict[str, int]] = {}
        self.queued_slots: dict[str, dict[str, int]] = {}  # server -> model -> slots reserved
        self.sent: dict[str, tuple[str, int]] = {}
        self._probe_failed: set[str] = set()  # servers whose probe raised (logged once)
        self.turns = Turns()  # loads waiting for room, oldest first
        self._placing = False  # a placement is taking the room its victims give (``placing``)

    @contextlib.contextmanager
    def placing(self) -> Iterator[None]:
        """A placement under way: its victims leaving give their room to its newcomer, not
        to the loads waiting, so their changes wake none (a load woken for it would find
        the room taken, and pass its turn on down the whole queue for nothing)."""
        self._placing = True
        try:
            yield
        finally:
            self._placing = False

    def changed(self) -> None:
        """Room may have come back on some server (a planner's view: a hold ended, a model
        left): the load that has waited longest for room tries again now, not at its next poll
        (``ROOM_POLL_S``, 50 ms).  Under thrash a slot turns over as soon as its
        request is answered; with the poll alone a miss waited up to 50 ms more for each
        slot it lost to another, and the order was chance.  One load per change: a change
        that makes room for one wakes one, whatever the number waiting; the load it wakes
        makes the next change if it takes the room."""
        if not self._placing:
            self.turns.wake_oldest()

    def queue(self, server: TritonServer, name: str, size_bytes: int, slots: int = 1) -> None:
        """``name`` is reserved on ``server`` (``size_bytes`` and ``slots`` of its room: a
        family's whole slots when its load loads the family) and waits for room there."""
        self.queued.setdefault(server.name, {})[name] = size_bytes
        self.queued_slots.setdefault(server.name, {})[name] = slots

    def unqueue(self, server: TritonServer, name: str) -> None:
        self.queued.get(server.name, {}).pop(name, None)
        self.queued_slots.get(server.name, {}).pop(name, None)

    def send(self, server: TritonServer, name: str, size_bytes: int) -> None:
        """The load of ``name`` leaves the queue and goes to Triton."""
        self.unqueue(server, name)
        self.sent[name] = (server.spec.device, size_bytes)

    def finish(self, name: str) -> None:
        """The load sent for ``name`` ended (loaded or failed)."""
        self.sent.pop(name, None)

    def fits_held(self, server: TritonServer, size_bytes: int, slots: int = 1) -> bool:
        """Whether one more model of ``size_bytes`` (taking ``slots``) fits next to what Triton
        holds: loaded, loading, and unloading until confirmed gone (loads not sent yet left
        out)."""
        planner, cap = server.planner, server.planner.capacity
        queued = self.queued.get(server.name, {})
        queued_slots = self.queued_slots.get(server.name, {})
        if (cap.max_slots is not None
                and planner.used_slots - sum(queued_slots.values()) + slots > cap.max_slots):
            return False
        return (cap.max_bytes is None
                or planner.used_bytes - sum(queued.values()) + size_bytes <= cap.max_bytes)

    def fits_measured(self, server: TritonServer, size_bytes: int) -> bool:
        """The overlap rule: the device's measured free memory holds this load and every
        load in flight on it, each with ``overlap_margin_bytes`` (see the package docstring)."""
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
        in_flight = sum(b + margin for device, b in self.sent.values() if device == server.spec.device)
        return free_bytes - in_flight >= size_bytes + margin

    async def wait(self, server: TritonServer, name: str, size_bytes: int,
                   evictions: list[asyncio.Future], freeing: Callable[[], list[asyncio.Future]],
                   deadline: float, room_bytes: int | None = None, room_slots: int = 1,
                   pool: ModelRecord | None = None) -> bool:
        """Wait until the load of ``name`` may be sent to Triton.  False: Triton's held room
        fits it; True: it starts before its victims are confirmed gone (overlap).
        ``evictions``: its victims' unloads; ``freeing()``: every unload in progress on
        ``server``; ``room_bytes`` / ``room_slots``: the server room its load takes;
        ``pool``: the family whose slot it takes, free once no more variants hold its slots
        than it has (a leaving one's evict is done).

        Raises the first failed eviction of its own, or OperationTimeout when the room is
        held by models no unload is freeing (an unload failed: its room stays counted) or
        is not freed by ``deadline``."""
        room_bytes = size_bytes if room_bytes is None else room_bytes
        while True:
            for fut in evictions:
                if fut.done() and not fut.cancelled() and fut.exception() is not None:
                    raise fut.exception()
            slot_free = pool is None or server.planner.members(pool.name) <= pool.slots
            if slot_free and (room_slots == 0 or self.fits_held(server, room_bytes, room_slots)):
                return False
            # A fixed-size slot (a family's variant) is free only once its evict is done.
            if server.admin.measured(name) and self.fits_measured(server, size_bytes):
                return True
            unloads = freeing()
            if not unloads:
                raise OperationTimeout(
                    f"its room on {server.name} is held by models whose unload did not complete; "
                    "they stay counted until Triton confirms them gone (mmctl status)")
            remaining_s = deadline - time.monotonic()
            if remaining_s <= 0:
                raise OperationTimeout(f"Triton did not confirm room for {name} in time")
            await asyncio.wait(unloads, return_when=asyncio.FIRST_COMPLETED,
                               timeout=min(remaining_s, ROOM_POLL_S) if self.free_memory else remaining_s)
