"""What the cache planner plans over, as values: a server's entries (``Resident``), its
budget (``Capacity``), a plan (``EvictionPlan``) and the rollout-stage priorities that order
victims before the policy does (planner.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

# Rollout stage -> eviction priority; lower is evicted first, pinned is never evicted.
STAGE_PRIORITY = {"shadow": 0, "canary": 1, "registered": 2, "production": 2, "retired": 0}
DEFAULT_PRIORITY = 2
SHADOW_PRIORITY = STAGE_PRIORITY["shadow"]
# A model's extra copy (mmctl scale): the first to go, and its load evicts only other extra
# copies, never a model's last copy.
EXTRA_COPY_PRIORITY = -1


def victim_priority_limit(priority: int) -> int | None:
    """The highest stage priority a newcomer of ``priority`` may evict; None: any.

    A shadow (or a retired model) may evict only shadow or retired models: mirrored traffic
    must never take the room of a model that serves clients (canary included); an extra
    copy may evict only extra copies."""
    return min(priority, SHADOW_PRIORITY) if priority <= SHADOW_PRIORITY else None


@dataclass(frozen=True, slots=True)
class Resident:
    """A loaded (or loading) model as the planner sees it: a value.

    Nothing changes a Resident in place: ``CachePlanner.update(key, evictable=False)``
    replaces the planner's entry and its running totals in one visible step, so
    ``used_bytes`` and planning stay O(1) and no assignment has a hidden effect."""

    key: str
    size_bytes: int = 0
    pinned: bool = False
    priority: int = DEFAULT_PRIORITY
    evictable: bool = True  # False while loading/unloading/serving-only-by-lease etc.
    # Being unloaded: still counted in used_bytes until it is removed (the server confirmed
    # it gone), but its room is promised and counts as free when planning.  A model whose
    # unload failed is not leaving: it holds its room.
    leaving: bool = False
    # A member of a slot pool: the key of the pool resident whose slot it takes (it counts
    # its slot's bytes and one place of the server's ``max_slots``, as a model does).
    pool: str | None = None
    # A slot pool: the most members its Triton model takes at once (the slots it was loaded
    # with).  A pool counts nothing of the server's room: its members do.
    holds: int = 0

    @property
    def server_slots(self) -> int:
        """Places of the server's ``max_slots`` it takes: none for a pool, one otherwise."""
        return 0 if self.holds else 1

    @property
    def room_bytes(self) -> int:
        """Bytes of the server's budget it takes: none for a pool (its members count)."""
        return 0 if self.holds else self.size_bytes


@dataclass
class Capacity:
    max_bytes: int | None = None
    max_slots: int | None = None

    def describe(self) -> str:
        parts = []
        if self.max_slots is not None:
            parts.append(f"{self.max_slots} models")
        if self.max_bytes is not None:
            parts.append(f"{self.max_bytes} bytes")
        return " and ".join(parts) or "unlimited"


@dataclass
class EvictionPlan:
    victims: list[str] = field(default_factory=list)
    freed_bytes: int = 0
    # A member's newcomer whose pool is not on the server, or grows: the slots the pool
    # holds once it is loaded (the caller reserves them); 0: the newcomer takes a slot of a
    # pool already there.
    pool_slots: int = 0
