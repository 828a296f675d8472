"""``CachePlanner``: capacity, pins and rollout stage priority around a policy.

Pinned keys are never evicted, stage priority (shadow before canary before production)
comes before the policy's own order, a shadow newcomer may evict only shadow (or retired)
models, and capacity is a byte budget and/or a slot count.  ``plan`` returns the victims
to free room for a new key, or raises CapacityExhausted naming the pinned keys and the
budget; it changes nothing until the caller commits.  Residents marked ``leaving`` count
as used but their room as already free (it is promised).

One cache per server: a resident may be a slot pool (``holds`` slots: a model family's
Triton model and its weight slots), and its members (``pool`` set) take one slot each.  A
pool costs nothing of the server's room by itself: a slot is allocated when a member arrives
and released when it leaves (elastic slots), so each member counts its slot's bytes and one
place of ``max_slots``, exactly as a model does.  Every entry of a server -- a model, an
extra copy, a variant in its family's slots -- is ordered by the one policy, and a miss of
any kind may evict the least recently used evictable entry of any kind.  A pool is never a
victim: once no member is left the manager unloads it.  ``holds`` bounds how many members
the pool's Triton model can take at once (the slots it was loaded with); a member's newcomer
beyond it grows the pool (a load with more slots) or, when it cannot grow, evicts a member
of that pool.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

from control_plane.eviction import no_room
from control_plane.eviction.entries import (
    DEFAULT_PRIORITY,
    Capacity,
    EvictionPlan,
    Resident,
    victim_priority_limit,
)
from control_plane.eviction.headroom import (
    HEADROOM_DEFAULT_MODELS,
    HEADROOM_MAX_FRACTION,
    HEADROOM_MIN_CAPACITY_MODELS,
    Headroom,
    HeadroomSpec,
)
from control_plane.eviction.policy import EvictionPolicy
from domain.errors import CapacityExhausted


class CachePlanner:
    """Capacity + pins + stage priority around a policy.  Not thread-safe: one owner.

    Keeps running totals (bytes used, evictable residents per priority) so ``used_bytes``
    is O(1) and ``plan`` walks the policy's victim order once, usually stopping at the
    first key.
    """

    def __init__(self, policy: EvictionPolicy, capacity: Capacity,
                 priority_of: Callable[[str], int] | None = None,
                 headroom: HeadroomSpec | None = None):
        self.policy = policy
        self.capacity = capacity
        # Stage priority of a newcomer (registry.stage_priority): a shadow evicts shadows only.
        self.priority_of = priority_of
        self.headroom = headroom if headroom is not None else HeadroomSpec(models=0)
        self.residents: dict[str, Resident] = {}
        self._used_bytes = 0
        self._used_slots = 0
        self._pools = 0  # residents that are slot pools
        self._leaving_bytes = 0
        self._leaving_slots = 0
        # priority -> residents that free server room when evicted, neither pinned nor busy
        # (a pool only while it has no members; members never: they free none)
        self._evictable: dict[int, int] = {}
        self._members: dict[str, int] = {}  # pool key -> its members (loading ones included)
        self._leaving_members: dict[str, int] = {}  # pool key -> its members being unloaded

    # -- running totals (admit, update, remove) -----------------------------------------
    def _count(self, r: Resident) -> None:
        if r.pool is not None:
            self._change_members(r, +1)
        self._count_own(r)

    def _uncount(self, r: Resident) -> None:
        if r.pool is not None:
            self._change_members(r, -1)
        self._uncount_own(r)

    def _change_members(self, member: Resident, delta: int) -> None:
        for counts, applies in ((self._members, True), (self._leaving_members, member.leaving)):
            if applies:
                left = counts.get(member.pool, 0) + delta
                if left:
                    counts[member.pool] = left
                else:
                    counts.pop(member.pool, None)

    @staticmethod
    def _frees_room(r: Resident) -> bool:
        """Whether evicting ``r`` frees server room and may be planned: a model, an extra
        copy or a variant in its family's slot, neither pinned nor busy (never a pool)."""
        return not r.holds and r.evictable and not r.pinned

    def _count_own(self, r: Resident) -> None:
        self._used_bytes += r.room_bytes
        self._used_slots += r.server_slots
        self._pools += 1 if r.holds else 0
        if r.leaving:
            self._leaving_bytes += r.room_bytes
            self._leaving_slots += r.server_slots
        if self._frees_room(r):
            self._evictable[r.priority] = self._evictable.get(r.priority, 0) + 1

    def _uncount_own(self, r: Resident) -> None:
        self._used_bytes -= r.room_bytes
        self._used_slots -= r.server_slots
        self._pools -= 1 if r.holds else 0
        if r.leaving:
            self._leaving_bytes -= r.room_bytes
            self._leaving_slots -= r.server_slots
        if self._frees_room(r):
            left = self._evictable[r.priority] - 1
            if left:
                self._evictable[r.priority] = left
            else:
                del self._evictable[r.priority]

    # -- bookkeeping ------------------------------------------------------------------
    @property
    def used_bytes(self) -> int:
        return self._used_bytes

    @property
    def used_slots(self) -> int:
        """Places of ``max_slots`` taken: one per model, copy or variant (pools none)."""
        return self._used_slots

    @property
    def committed_bytes(self) -> int:
        """Bytes held once every unload in progress completes (leaving residents left out)."""
        return self._used_bytes - self._leaving_bytes

    @property
    def committed_slots(self) -> int:
        return self._used_slots - self._leaving_slots

    @property
    def models(self) -> int:
        """Models resident (loading and leaving included), slot pools left out."""
        return len(self.residents) - self._pools

    def frees_room(self, key: str) -> bool:
        """Whether evicting ``key`` may free server room now (see ``_frees_room``)."""
        r = self.residents.get(key)
        return r is not None and self._frees_room(r)

    def members(self, pool: str) -> int:
        """Members of ``pool`` that hold one of its slots (loading and leaving included)."""
        return self._members.get(pool, 0)

    def empty_pools(self) -> list[str]:
        """Pools no member holds or loads into, that are not leaving: the manager unloads
        them (a pool holds no room of its own, so no plan ever picks one)."""
        return sorted(k for k, r in self.residents.items()
                      if r.holds and not r.leaving and r.evictable and not self._members.get(k))

    def pool_growth(self, pool: str, pool_slots: int) -> int:
        """The slots ``pool``'s Triton model must be loaded with for one more member: 0 when
        it is here and has a slot for it (counting members on their way out as gone), else
        ``pool_slots`` (not here: its first load; here but full: a load with more slots),
        or -1 when it is full and cannot grow (a member of it must leave)."""
        holder = self.residents.get(pool)
        if holder is None:
            return max(pool_slots, 1)
        taken = self._members.get(pool, 0) - self._leaving_members.get(pool, 0)
        if taken + 1 <= holder.holds:
            return 0
        return pool_slots if pool_slots > holder.holds else -1

    def touch(self, key: str, now: float) -> None:
        self.policy.touch(key, now)

    def admit(self, resident: Resident, now: float, load_cost_s: float = 1.0) -> None:
        """Record ``resident`` as loaded; re-admitting a key replaces its old entry."""
        old = self.residents.get(resident.key)
        if old is not None:
            self._uncount(old)
        self.residents[resident.key] = resident
        self._count(resident)
        # The policy weighs size only when bytes are what runs out.
        size_bytes = resident.size_bytes if self.capacity.max_bytes is not None else 0
        self.policy.admit(resident.key, now, size_bytes, load_cost_s)

    def update(self, key: str, **fields: Any) -> Resident | None:
        """Change fields of ``key``'s resident (``evictable``, ``leaving``, ``pinned``,
        ``size_bytes``, ``priority``) and the running totals with them; None (and nothing
        changed) when ``key`` holds no room here."""
        old = self.residents.get(key)
        if old is None:
            return None
        new = replace(old, **fields)
        self._uncount(old)
        self.residents[key] = new
        self._count(new)
        return new

    def remove(self, key: str) -> None:
        r = self.residents.get(key)
        if r is not None:
            self._uncount(r)
            del self.residents[key]
        self.policy.remove(key)

    # -- decisions --------------------------------------------------------------------
    def fits_at_all(self, size_bytes: int) -> bool:
        cap = self.capacity
        if cap.max_slots is not None and cap.max_slots < 1:
            return False
        return cap.max_bytes is None or size_bytes <= cap.max_bytes

    def plan(self, key: str, size_bytes: int, pool: str | None = None,
             pool_slots: int = 0) -> EvictionPlan:
        """Victims that make room for ``key``; raises CapacityExhausted if none can.

        Victims come lowest stage priority first, then in the policy's order; pinned and
        busy (not evictable) residents are skipped.  One pass over ``victim_order``: keys
        of a higher priority level are held back until every evictable key of the lower
        levels has been seen (the running counts say when).

        ``pool``: ``key`` goes into a slot (of ``size_bytes``) of that pool, which a load
        would give ``pool_slots`` slots now.  The slot takes room as a model does; when the
        pool is not here (or full and may grow) its load is part of the plan
        (``EvictionPlan.pool_slots``).
        """
        limit = victim_priority_limit(
            self.priority_of(key) if self.priority_of is not None else DEFAULT_PRIORITY)
        if pool is not None:
            return self._plan_slot(key, size_bytes, pool, pool_slots, limit)
        return self._plan_room(key, size_bytes, 1, limit)

    def _plan_slot(self, key: str, slot_bytes: int, pool: str, pool_slots: int,
                   limit: int | None) -> EvictionPlan:
        holder = self.residents.get(pool)
        if holder is not None and (holder.leaving or not (holder.evictable or self._members.get(pool))):
            # Being unloaded (or its unload failed): its slots are going; the newcomer waits
            # for the unload, then loads it again.
            raise CapacityExhausted(f"no room for {key}: its family {pool} is being unloaded "
                                    "from this server")
        growth = self.pool_growth(pool, pool_slots)
        if growth >= 0:
            plan = self._plan_room(key, slot_bytes, 1, limit)
            plan.pool_slots = growth
            return plan
        # The family's Triton model has no slot left and cannot grow: a member of it leaves
        # (its slot is the newcomer's; the same room).
        victims = [r.key for r in self._members_in_order(key, pool, limit)][:1]
        if not victims:
            raise no_room.exhausted_in_pool(self, key, pool, holder.holds)
        return EvictionPlan(victims, slot_bytes)

    def _members_in_order(self, key: str, pool: str, limit: int | None) -> list[Resident]:
        """``pool``'s evictable members, lowest stage priority first, then the policy's order."""
        found = []
        for candidate in self.policy.victim_order():
            r = self.residents.get(candidate)
            if (r is None or r.pool != pool or r.pinned or not r.evictable or candidate == key
                    or (limit is not None and r.priority > limit)):
                continue
            found.append(r)
        found.sort(key=lambda r: r.priority)  # stable: the policy's order within a stage
        return found

    def _plan_room(self, key: str, size_bytes: int, slots: int,
                   limit: int | None) -> EvictionPlan:
        cap = self.capacity
        if not self.fits_at_all(size_bytes) or (cap.max_slots is not None
                                                and slots > cap.max_slots):
            raise CapacityExhausted(
                f"{key} needs {size_bytes} bytes but the whole budget is {cap.describe()}; "
                "raise --memory-budget / --max-loaded or place it on a larger device"
            )
        # Room that leaving residents free is already promised: count it as free.  A shadow
        # leaves the headroom alone (restoring it would evict a serving model for it).
        reserve = self.headroom_target() if limit is not None else Headroom()
        need_bytes = 0
        if cap.max_bytes is not None:
            need_bytes = max(0, self.committed_bytes + size_bytes + reserve.bytes - cap.max_bytes)
        need_slots = 0
        if cap.max_slots is not None:
            need_slots = max(0, self.committed_slots + slots + reserve.slots - cap.max_slots)
        if need_bytes <= 0 and need_slots <= 0:
            return EvictionPlan()
        evictable = sum(n for p, n in self._evictable.items() if limit is None or p <= limit)
        if need_slots <= evictable:
            plan = self._collect(key, need_bytes, need_slots, limit)
            if plan is not None:
                return plan
        if limit is not None:
            raise no_room.exhausted_for_shadow(self, key, size_bytes, limit)
        raise no_room.exhausted(self, key, size_bytes)

    def headroom_target(self) -> Headroom:
        """The room this server keeps free now (see ``HeadroomSpec``); pure."""
        spec, cap = self.headroom, self.capacity
        slots = size = 0
        if cap.max_slots is not None:
            n = spec.models
            if n is None:
                n = HEADROOM_DEFAULT_MODELS if cap.max_slots >= HEADROOM_MIN_CAPACITY_MODELS else 0
            slots = min(n, int(cap.max_slots * HEADROOM_MAX_FRACTION))
        if cap.max_bytes is not None:
            if spec.bytes is not None:
                size = spec.bytes
            elif spec.models != 0:
                sizes = sorted(r.room_bytes for r in self.residents.values() if r.room_bytes > 0)
                typical = sizes[len(sizes) // 2] if sizes else 0
                n = spec.models
                if n is None:
                    fits = cap.max_bytes // typical if typical else 0
                    n = HEADROOM_DEFAULT_MODELS if fits >= HEADROOM_MIN_CAPACITY_MODELS else 0
                size = n * typical
            size = min(size, int(cap.max_bytes * HEADROOM_MAX_FRACTION))
        return Headroom(slots, size)

    def headroom_victims(self) -> list[str]:
        """Residents to unload so that the headroom is free once they are gone; pure.

        The policy's order with the usual rules (never pinned or busy ones, lowest stage
        priority first); leaving residents count as gone.  Empty when the headroom is free,
        when what is evictable cannot restore all of it (evicting for part of it would cost
        hits and still leave the next miss waiting), or when it would take the last
        evictable model: with everything else pinned or busy, that one is what a newcomer
        just loaded (``mmctl load`` must not see it leave at once), and the next miss would
        have to evict it anyway.  Empty too when the next victim is a variant in its
        family's slot: the next miss evicts it at the speed of a fill (in the same request
        when that miss is a variant of its family), so there is no slow unload to take off
        that miss's path."""
        target = self.headroom_target()
        if not target:
            return []
        cap = self.capacity
        need_bytes = need_slots = 0
        if cap.max_bytes is not None and target.bytes:
            need_bytes = max(0, self.committed_bytes + target.bytes - cap.max_bytes)
        if cap.max_slots is not None and target.slots:
            need_slots = max(0, self.committed_slots + target.slots - cap.max_slots)
        if need_bytes <= 0 and need_slots <= 0:
            return []
        evictable = sum(self._evictable.values())
        if need_slots >= evictable:
            return []
        plan = self._collect(None, need_bytes, need_slots)
        if (plan is None or len(plan.victims) >= evictable
                or self.residents[plan.victims[0]].pool is not None):
            return []
        return plan.victims

    def _collect(self, key: str | None, need_bytes: int, need_slots: int,
                 limit: int | None = None) -> EvictionPlan | None:
        residents = self.residents
        levels = sorted(p for p in self._evictable if limit is None or p <= limit)
        if not levels:
            return None
        if len(levels) == 1:  # the usual case: one stage priority among evictable residents
            victims: list[str] = []
            freed = 0
            for candidate in self.policy.victim_order():
                r = residents.get(candidate)
                if r is None or not self._frees_room(r) or candidate == key:
                    continue
                if limit is not None and r.priority > limit:
                    continue
                victims.append(candidate)
                freed += r.room_bytes
                if freed >= need_bytes and len(victims) >= need_slots:
                    return EvictionPlan(victims, freed)
            return None
        expected = [self._evictable[p] for p in levels]
        buckets: dict[int, list[Resident]] = {p: [] for p in levels}
        victims = []
        freed = 0
        level = taken = 0

        def drain(final: bool) -> bool:
            """Take ready keys in order; True once the need is met."""
            nonlocal level, taken, freed
            while level < len(levels):
                bucket = buckets[levels[level]]
                while taken < len(bucket):
                    r = bucket[taken]
                    taken += 1
                    victims.append(r.key)
                    freed += r.room_bytes
                    if freed >= need_bytes and len(victims) >= need_slots:
                        return True
                if not final and taken < expected[level]:
                    return False  # more keys of this level may still come
                level += 1
                taken = 0
            return False

        for candidate in self.policy.victim_order():
            r = residents.get(candidate)
            if r is None or not self._frees_room(r) or candidate == key:
                continue
            bucket = buckets.get(r.priority)
            if bucket is None:  # above the limit, or priority changed mid-walk
                continue
            bucket.append(r)
            if drain(final=False):
                return EvictionPlan(victims, freed)
        if drain(final=True):
            return EvictionPlan(victims, freed)
        return None
