"""A count-min sketch of recent request counts, the frequency memory of TinyLFU policies.

Why a sketch and not a dict of counters: the keys a control plane sees over weeks (every
version of every fine-tune, typos included) are unbounded, while the sketch is a fixed
table.  It forgets evicted models slowly instead of at once, which is what lets a
frequency-aware policy remember that a model it just evicted is in fact popular.

* ``increment`` uses conservative update (only the smallest counters grow), which keeps
  over-estimates from hash collisions small.
* Aging: after ``sample_size`` increments every counter is halved, so the estimate is a
  decayed count over roughly the last ``2 * sample_size`` requests and a popularity shift
  is followed within a few sample periods.  Halving costs O(width * depth) once per
  ``sample_size`` requests: O(1) amortized when ``sample_size`` >= the table size.

Hashing is deterministic (blake2b, not Python's salted ``hash``), so replays repeat
exactly from one process to the next.
"""

from __future__ import annotations

import hashlib

_MAX_CACHED_KEYS = 1 << 16


class FrequencySketch:
    """Estimates how often each key was requested recently; never under-estimates."""

    def __init__(
        self, width: int = 4096, depth: int = 4, sample_size: int = 32768, max_count: int = 0
    ):
        if width < 1 or depth < 1 or depth > 8:
            raise ValueError(f"sketch width ({width}) must be >= 1 and depth ({depth}) 1..8")
        if sample_size < 1:
            raise ValueError(f"sample_size ({sample_size}) must be >= 1")
        self.width = 1 << max(0, (width - 1).bit_length())  # power of two: masks, not modulo
        self.depth = depth
        self.sample_size = sample_size
        self.max_count = max_count if max_count > 0 else 1 << 62
        self.additions = 0
        self.ages = 0
        self.table = [0] * (self.width * depth)
        self._slots: dict[str, tuple[int, ...]] = {}

    def indexes(self, key: str) -> tuple[int, ...]:
        """Positions of ``key``'s counters in ``table``, one per row."""
        slots = self._slots.get(key)
        if slots is None:
            digest = hashlib.blake2b(key.encode(), digest_size=4 * self.depth).digest()
            mask = self.width - 1
            slots = tuple(
                row * self.width + (int.from_bytes(digest[4 * row:4 * row + 4], "little") & mask)
                for row in range(self.depth)
            )
            if len(self._slots) >= _MAX_CACHED_KEYS:
                self._slots.clear()
            self._slots[key] = slots
        return slots

    def increment(self, key: str) -> None:
        table = self.table
        slots = self.indexes(key)
        low = min(map(table.__getitem__, slots))
        if low < self.max_count:
            for i in slots:
                if table[i] == low:
                    table[i] = low + 1
        self.additions += 1
        if self.additions >= self.sample_size:
            self._age()

    def estimate(self, key: str) -> int:
        return min(map(self.table.__getitem__, self.indexes(key)))

    def _age(self) -> None:
        self.table[:] = [c >> 1 for c in self.table]  # in place: holders of .table stay valid
        self.additions //= 2
        self.ages += 1
