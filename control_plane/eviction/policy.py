"""The policy interface and ``lru``, the default policy.

An ``EvictionPolicy`` only ranks resident keys: it is told about every request
(``touch``), admissions and removals, and yields resident keys best-victim-first.  The
calling convention the policies are tuned for is in the package docstring.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Iterator
from typing import ClassVar


class EvictionPolicy(ABC):
    """Ranks resident keys for eviction.  Implementations keep per-request work O(1)."""

    name: ClassVar[str]

    @abstractmethod
    def touch(self, key: str, now: float) -> None:
        """A request for ``key`` (resident or not) at time ``now``."""

    @abstractmethod
    def admit(self, key: str, now: float, size_bytes: int = 0, load_cost_s: float = 1.0) -> None:
        """``key`` became resident.  ``size_bytes`` 0 means size does not matter (slots)."""

    @abstractmethod
    def remove(self, key: str) -> None:
        """``key`` left the cache (evicted or unloaded); unknown keys are ignored."""

    @abstractmethod
    def victim_order(self) -> Iterator[str]:
        """Resident keys, best victim first.  Lazy: callers stop once they have enough.

        The iterator reads live state: do not touch/admit/remove while holding it.
        """

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
