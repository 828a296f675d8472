"""The planner's view of each copy, derived from the copy's record: never set by hand.

A model's copy on a server is a ``Copy`` in its record (``ModelRecord.move`` is the only
writer), with the model's pin and the requests holding it.  The eviction planner of that server needs
three facts about it: whether it is pinned, whether it may be chosen as a victim, and
whether its room is promised to a load (being unloaded).  ``resident_view`` computes them
from the record in one place, and ``Residency.sync`` puts them into the planner after every
change a record announces, so the two can never disagree:

=================  ============  ==============================  ===========================
copy state         holds room    evictable                       room promised (``leaving``)
=================  ============  ==============================  ===========================
loading            yes           no                              no
ready              yes           when no request holds it        no
unloading          yes           no                              yes, unless a failed unload
                                                                 is being retried
unload_failed      yes           no                              no (Triton may still hold it)
warm, failed       no            -                               -
=================  ============  ==============================  ===========================

A pinned copy is pinned only while it serves or is loading: on its way out it holds its
room as busy, and the pin takes a room again when the model is reloaded.

Slot pools (a model family's Triton model, ``ModelRecord.slot_bytes``): the pool's copy is
admitted with the most slots it takes (``Resident.holds``) and counts nothing of the
server's room; a copy of a model that goes into a slot (``records.slot_pool``: a family's
variant) is admitted as a member of its pool on that server (``Resident.pool``) and counts
its slot's bytes and one place, as a model does (one cache per server: the planner).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from control_plane.eviction import Resident
from control_plane.manager.records import (
    Copy,
    ModelRecord,
    ModelState,
    PoolKey,
    TritonServer,
)


@dataclass(frozen=True, slots=True)
class ResidentView:
    pinned: bool
    evictable: bool
    leaving: bool


def resident_view(rec: ModelRecord, copy: Copy) -> ResidentView:
    """How ``rec``'s ``copy`` looks to its server's planner."""
    state = copy.state
    if state == ModelState.LOADING:
        return ResidentView(pinned=rec.pinned, evictable=False, leaving=False)
    if state == ModelState.READY:
        return ResidentView(pinned=rec.pinned, evictable=rec.inflight == 0, leaving=False)
    if state == ModelState.UNLOADING:
        return ResidentView(pinned=False, evictable=False, leaving=copy.room_promised)
    return ResidentView(pinned=False, evictable=False, leaving=False)  # unload_failed


class Residency:
    """Keeps every server's planner equal to ``resident_view`` of the records' copies.

    ``sync(rec)`` runs after each change of a record's copies, size, pin or holds (the
    record calls it); it admits, updates or removes the planners' entries and nothing else
    writes one.  ``placed`` remembers which planners count each model, so a copy that leaves
    its server is removed from the planner that counted it."""

    def __init__(self, servers: dict[str, TritonServer], clock: Callable[[], float],
                 priority_of: Callable[[str], int],
                 on_room_changed: Callable[[TritonServer, bool], None]):
        self.servers = servers
        self.clock = clock
        self.priority_of = priority_of
        # (server, whether room may have come back there): the gauges of a server's used
        # room, and the loads waiting for room (RoomLedger.changed).
        self.on_room_changed = on_room_changed
        self.placed: dict[str, set[str]] = {}  # model -> the servers whose planners count it

    def sync(self, rec: ModelRecord) -> None:
        placed = self.placed.setdefault(rec.name, set())
        for where in sorted(placed - set(rec.copies)):
            placed.discard(where)
            old = self.servers.get(where)
            if old is not None:
                gone = old.planner.residents.get(rec.name)
                old.planner.remove(rec.name)
                # A model or variant on its way out gave its room to placement when it started
                # leaving (the planner counts it free from then): its end gives nothing more.
                # A family's slots do: a variant of a family being unloaded waits for them.
                self.on_room_changed(old, gone is None or not gone.leaving or bool(gone.holds))
        for where, copy in rec.copies.items():
            server = self.servers.get(where)
            if server is not None:
                self._sync_copy(rec, copy, server, placed)
        if not placed:
            del self.placed[rec.name]

    def _sync_copy(self, rec: ModelRecord, copy: Copy, server: TritonServer,
                   placed: set[str]) -> None:
        view = resident_view(rec, copy)
        current = server.planner.residents.get(rec.name)
        if current is None or server.name not in placed:
            # (An extra copy of a variant is a member of its family there too.)
            pool = None if rec.slot_bytes else server.admin.slot_pool(rec.triton_name)
            # A variant takes its slot's bytes (the weights' data section), whatever its file.
            size = pool.slot_bytes if pool is not None else rec.memory_bytes
            server.planner.admit(
                Resident(rec.name, size, pinned=view.pinned,
                         priority=self.priority_of(rec.name), evictable=view.evictable,
                         leaving=view.leaving,
                         pool=PoolKey(pool.name, server.name) if pool is not None else None,
                         holds=rec.slots),
                self.clock(), load_cost_s=rec.load_time_s or 1.0)
            placed.add(server.name)
            freed = False  # a newcomer takes room
        elif (current.pinned, current.evictable, current.leaving, current.size_bytes,
              current.holds) != (view.pinned, view.evictable, view.leaving,
                                 size := current.size_bytes if current.pool else rec.memory_bytes,
                                 rec.slots):
            # Room may have come back: a victim again (its requests answered, its pin gone),
            # on its way out, or smaller.
            freed = ((view.evictable and not current.evictable) or (view.leaving and not current.leaving)
                     or (current.pinned and not view.pinned) or size < current.size_bytes
                     or rec.slots < current.holds)
            server.planner.update(rec.name, pinned=view.pinned, evictable=view.evictable,
                                  leaving=view.leaving, size_bytes=size, holds=rec.slots)
        else:
            return
        self.on_room_changed(server, freed)

    def set_priority(self, name: str, priority: int) -> None:
        """A model's rollout stage changed: its eviction priority with it, on every server
        that counts it."""
        for where in self.placed.get(name, ()):
            server = self.servers.get(where)
            if server is not None:
                server.planner.update(name, priority=priority)
