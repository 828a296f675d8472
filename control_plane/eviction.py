"""Which loaded models to evict: pure policy code, no sockets, no clock of its own.

The control plane and the benchmark replay (bench/) run this same code.

* An ``EvictionPolicy`` only ranks resident keys: it is told about requests (``touch``),
  admissions and removals, and yields resident keys best-victim-first.
* ``CachePlanner`` adds what every policy must respect: pinned keys are never evicted,
  rollout stage priority (shadow before canary before production) comes before the
  policy's own order, and capacity is a byte budget and/or a slot count.  ``plan`` returns
  the victims to free room for a new key, or raises CapacityExhausted naming the pinned
  keys and the budget; it changes nothing until the caller commits.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import ClassVar, Iterator

from .errors import CapacityExhausted

# Rollout stage -> eviction priority; lower is evicted first, pinned is never evicted.
STAGE_PRIORITY = {"shadow": 0, "canary": 1, "registered": 2, "production": 2, "retired": 0}
DEFAULT_PRIORITY = 2


class EvictionPolicy(ABC):
    """Ranks resident keys for eviction.  Implementations keep per-request work O(1)."""

    name: ClassVar[str]

    @abstractmethod
    def touch(self, key: str, now: float) -> None:
        """A request for ``key`` (resident or not) at time ``now``."""

    @abstractmethod
    def admit(self, key: str, now: float, size_bytes: int = 0, load_cost_s: float = 1.0) -> None:
        """``key`` became resident."""

    @abstractmethod
    def remove(self, key: str) -> None:
        """``key`` left the cache (evicted or unloaded); unknown keys are ignored."""

    @abstractmethod
    def victim_order(self) -> Iterator[str]:
        """Resident keys, best victim first.  Lazy: callers stop once they have enough."""

    def __contains__(self, key: str) -> bool:  # pragma: no cover - overridden
        return key in set(self.victim_order())


class LRUPolicy(EvictionPolicy):
    """Least recently used first: an OrderedDict, O(1) per request."""

    name = "lru"

    def __init__(self) -> None:
        self._order: OrderedDict[str, None] = OrderedDict()

    def touch(self, key: str, now: float) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def admit(self, key: str, now: float, size_bytes: int = 0, load_cost_s: float = 1.0) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def remove(self, key: str) -> None:
        self._order.pop(key, None)

    def victim_order(self) -> Iterator[str]:
        # Lazy over the live dict: planning never mutates it while iterating.
        return iter(self._order)

    def __contains__(self, key: str) -> bool:
        return key in self._order


POLICIES: dict[str, type[EvictionPolicy]] = {LRUPolicy.name: LRUPolicy}
DEFAULT_POLICY = LRUPolicy.name


def make_policy(name: str) -> EvictionPolicy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(
            f"unknown eviction policy {name!r}; choose one of {', '.join(sorted(POLICIES))}"
        ) from None


@dataclass
class Resident:
    key: str
    size_bytes: int = 0
    pinned: bool = False
    priority: int = DEFAULT_PRIORITY
    evictable: bool = True  # False while loading/unloading/serving-only-by-lease etc.


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


class CachePlanner:
    """Capacity + pins + stage priority around a policy.  Not thread-safe: one owner."""

    def __init__(self, policy: EvictionPolicy, capacity: Capacity):
        self.policy = policy
        self.capacity = capacity
        self.residents: dict[str, Resident] = {}

    # -- bookkeeping ------------------------------------------------------------------
    @property
    def used_bytes(self) -> int:
        return sum(r.size_bytes for r in self.residents.values())

    @property
    def used_slots(self) -> int:
        return len(self.residents)

    def touch(self, key: str, now: float) -> None:
        self.policy.touch(key, now)

    def admit(self, resident: Resident, now: float, load_cost_s: float = 1.0) -> None:
        self.residents[resident.key] = resident
        self.policy.admit(resident.key, now, resident.size_bytes, load_cost_s)

    def remove(self, key: str) -> None:
        self.residents.pop(key, None)
        self.policy.remove(key)

    # -- decisions --------------------------------------------------------------------
    def fits_at_all(self, size_bytes: int) -> bool:
        cap = self.capacity
        if cap.max_slots is not None and cap.max_slots < 1:
            return False
        return cap.max_bytes is None or size_bytes <= cap.max_bytes

    def plan(self, key: str, size_bytes: int) -> EvictionPlan:
        """Victims that make room for ``key``; raises CapacityExhausted if none can."""
        cap = self.capacity
        if not self.fits_at_all(size_bytes):
            raise CapacityExhausted(
                f"{key} needs {size_bytes} bytes but the whole budget is {cap.describe()}; "
                "raise --memory-budget / --max-loaded or place it on a larger device"
            )
        need_bytes = 0
        if cap.max_bytes is not None:
            need_bytes = max(0, self.used_bytes + size_bytes - cap.max_bytes)
        need_slots = 0
        if cap.max_slots is not None:
            need_slots = max(0, self.used_slots + 1 - cap.max_slots)
        plan = EvictionPlan()
        if need_bytes <= 0 and need_slots <= 0:
            return plan
        for priority in sorted({r.priority for r in self.residents.values()}):
            for victim in self.policy.victim_order():
                r = self.residents.get(victim)
                if r is None or r.pinned or not r.evictable or r.priority != priority or victim == key:
                    continue
                plan.victims.append(victim)
                plan.freed_bytes += r.size_bytes
                if plan.freed_bytes >= need_bytes and len(plan.victims) >= need_slots:
                    return plan
        pinned = sorted(k for k, r in self.residents.items() if r.pinned)
        busy = sorted(k for k, r in self.residents.items() if not r.evictable and not r.pinned)
        detail = f"pinned: {', '.join(pinned) or 'none'}"
        if busy:
            detail += f"; busy loading/unloading: {', '.join(busy)}"
        raise CapacityExhausted(
            f"no room for {key} ({size_bytes} bytes): budget is {cap.describe()}, "
            f"{self.used_slots} loaded using {self.used_bytes} bytes, and nothing evictable is "
            f"left ({detail}); unpin a model (mmctl unpin NAME) or raise the budget"
        )
