"""Which resident adapter leaves a full tier: pure policy, plain data, no tensors or clock.

One ``LruTier`` per tier (device slots, host memory).  Pinned keys are never victims; keys
the current batch is using (``protect``) are not victims either, so a batch never evicts an
adapter it is about to compute with.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Iterable, Iterator


class LruTier:
    def __init__(self, capacity: int, tier: str):
        if capacity < 1:
            raise ValueError(f"{tier} capacity ({capacity}) must be >= 1")
        self.capacity = capacity
        self.tier = tier
        self._order: OrderedDict[str, None] = OrderedDict()  # least recently used first
        self.pinned: set[str] = set()

    def __contains__(self, key: object) -> bool:
        return key in self._order

    def __len__(self) -> int:
        return len(self._order)

    def __iter__(self) -> Iterator[str]:
        return iter(self._order)

    @property
    def full(self) -> bool:
        return len(self._order) >= self.capacity

    def touch(self, key: str) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def touch_all(self, keys: Iterable[str]) -> None:
        """``touch`` each key in turn: one call for a batch's resident adapters (a batch can
        name a hundred), without a method call per key."""
        order = self._order
        for key in keys:
            if key in order:
                order.move_to_end(key)

    def add(self, key: str) -> None:
        if key not in self._order and self.full:
            raise RuntimeError(f"{self.tier} tier is full ({self.capacity}); evict first")
        self._order[key] = None
        self._order.move_to_end(key)

    def remove(self, key: str) -> None:
        self._order.pop(key, None)

    def pin(self, key: str) -> None:
        self.pinned.add(key)

    def unpin(self, key: str) -> None:
        self.pinned.discard(key)

    def victim(self, protect: Collection[str] = ()) -> str | None:
        """The least recently used key that is neither pinned nor protected, or None."""
        for key in self._order:
            if key not in self.pinned and key not in protect:
                return key
        return None

    def all_pinned(self) -> bool:
        """Full, and every resident key pinned: no request can ever free a place."""
        return self.full and all(key in self.pinned for key in self._order)
