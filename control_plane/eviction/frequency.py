"""Frequency-aware policies: W-TinyLFU (``wtinylfu``, ``wtinylfu-hits``) and GDSF (``gdsf``).

Both count requests in an aging count-min sketch (``eviction_sketch.FrequencySketch``) and
weigh a model by its load cost (per byte under a byte budget).  Neither refuses admission:
doubt about a newcomer is expressed by ranking it as an early victim.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Callable, Iterator
from itertools import chain, islice
from typing import Any

from control_plane.eviction.policy import EvictionPolicy
from control_plane.eviction.sketch import FrequencySketch


def _weight(size_bytes: int, load_cost_s: float) -> float:
    """Value of keeping a model per unit of capacity, per request: load seconds per byte.

    With a slot budget (size_bytes 0) every model costs one slot and only the load cost
    counts.  A non-positive load cost still gets a small weight so frequency decides.
    """
    cost_s = load_cost_s if load_cost_s > 0 else 1e-3
    return cost_s / size_bytes if size_bytes > 0 else cost_s


class WTinyLFUPolicy(EvictionPolicy):
    """W-TinyLFU with forced admission and load-cost-weighted scores.

    Layout (all LRU-ordered OrderedDicts): a *window* of ``window_fraction`` of the
    residents takes every newcomer; the *main* area is a segmented LRU (``probation`` and
    ``protected``, the latter ``protected_fraction`` of main).  When a new model arrives and
    room is needed, the window's oldest entry (the candidate) competes with the weakest of
    main's ``incumbents`` oldest entries: the lower ``score`` is the victim, ties evict the
    candidate.  A surviving candidate moves to probation on the next ``admit``; a probation
    hit promotes to protected, whose overflow is demoted back to probation.

    Looking at a few incumbents instead of only the oldest keeps one formerly popular model
    (high but fading count) from blocking every newcomer after a popularity shift.

    ``score`` = sketch frequency * (load seconds, per byte under a byte budget) **
    ``cost_exponent``.  1 aims at the fewest seconds spent loading, 0 at the most hits; the
    default 0.5 (a model 4x slower to load counts as if requested 2x as often) measured
    best on both together (bench/policy_replay.py: hit ratio about 0.9x Belady's and about
    30% fewer load seconds than LRU on 1,000-model traces).

    The sketch's counters halve every ``sample_size`` requests and saturate at ``count_cap``
    times a resident's fair share of that period: the cap bounds how long a model that
    stopped being requested keeps its place.

    O(1) amortized per request: a few dict operations plus the sketch's ``depth`` counters;
    ``victim_order`` costs O(incumbents) per key it yields.
    """

    name = "wtinylfu"

    def __init__(
        self,
        window_fraction: float = 0.01,
        protected_fraction: float = 0.8,
        incumbents: int = 8,
        sample_size: int = 16384,
        count_cap: float = 2.0,
        sketch_width: int = 4096,
        cost_exponent: float = 0.5,
    ) -> None:
        if not 0.0 < window_fraction < 1.0:
            raise ValueError(f"window_fraction ({window_fraction}) must be in (0, 1)")
        if not 0.0 <= protected_fraction < 1.0:
            raise ValueError(f"protected_fraction ({protected_fraction}) must be in [0, 1)")
        if incumbents < 1:
            raise ValueError(f"incumbents ({incumbents}) must be >= 1")
        if count_cap <= 0:
            raise ValueError(f"count_cap ({count_cap}) must be > 0")
        if cost_exponent < 0:
            raise ValueError(f"cost_exponent ({cost_exponent}) must be >= 0")
        self.window_fraction = window_fraction
        self.protected_fraction = protected_fraction
        self.incumbents = incumbents
        self.cost_exponent = cost_exponent
        self.count_cap = count_cap
        self.sketch = FrequencySketch(width=sketch_width, sample_size=sample_size)
        self._window: OrderedDict[str, None] = OrderedDict()
        self._probation: OrderedDict[str, None] = OrderedDict()
        self._protected: OrderedDict[str, None] = OrderedDict()
        self._weight: dict[str, float] = {}

    # -- sizes ------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._weight)

    def _window_target(self) -> int:
        return max(1, int(self.window_fraction * len(self._weight)))

    def _protected_target(self) -> int:
        return int(self.protected_fraction * (len(self._weight) - self._window_target()))

    def score(self, key: str) -> float:
        """Relative value of keeping ``key``: recent frequency times its cost weight."""
        return self.sketch.estimate(key) * self._weight.get(key, 1.0)

    def _scorer(self) -> Callable[[str], float]:
        # ``score`` with the lookups bound once: victim_order calls it ~incumbents times.
        counters, indexes = self.sketch.table, self.sketch.indexes
        weight = self._weight
        return lambda key: min(map(counters.__getitem__, indexes(key))) * weight[key]

    # -- events -----------------------------------------------------------------------
    def touch(self, key: str, now: float) -> None:
        self.sketch.increment(key)
        if key in self._window:
            self._window.move_to_end(key)
        elif key in self._protected:
            self._protected.move_to_end(key)
        elif key in self._probation:
            del self._probation[key]
            self._protected[key] = None
            if len(self._protected) > self._protected_target():
                demoted, _ = self._protected.popitem(last=False)
                self._probation[demoted] = None

    def admit(self, key: str, now: float, size_bytes: int = 0, load_cost_s: float = 1.0) -> None:
        self.remove(key)
        self._weight[key] = _weight(size_bytes, load_cost_s) ** self.cost_exponent
        self._window[key] = None
        self._resize_cap()
        target = self._window_target()
        while len(self._window) > target:
            candidate, _ = self._window.popitem(last=False)
            self._probation[candidate] = None

    def remove(self, key: str) -> None:
        if self._weight.pop(key, None) is None:
            return
        self._resize_cap()
        for segment in (self._window, self._probation, self._protected):
            if key in segment:
                del segment[key]
                return

    def _resize_cap(self) -> None:
        # Counters saturate at count_cap times a resident's fair share of a sample period:
        # well above the counts near the eviction boundary, so the ranking there is intact,
        # and only a few halvings away from it, so a model that stopped being requested
        # loses its place within a few sample periods.
        sketch = self.sketch
        share = sketch.sample_size / max(1, len(self._weight))
        sketch.max_count = max(15, int(self.count_cap * share))

    def _main_order(self) -> Iterator[tuple[str, float]]:
        """Main area weakest-first among a sliding group of its ``incumbents`` oldest."""
        score = self._scorer()
        keys = chain(self._probation, self._protected)
        group = [(key, score(key)) for key in islice(keys, self.incumbents)]
        while group:
            weakest, low = 0, group[0][1]
            for i in range(1, len(group)):
                if group[i][1] < low:  # strict: the oldest wins ties
                    weakest, low = i, group[i][1]
            yield group.pop(weakest)
            refill = next(keys, None)
            if refill is not None:
                group.append((refill, score(refill)))

    def victim_order(self) -> Iterator[str]:
        # Merge the window (oldest first) with main's order: at each step the lower score
        # goes first, the window on ties (TinyLFU admits a candidate only if it is better).
        score = self._scorer()
        window = iter(self._window)
        main = self._main_order()
        candidate = next(window, None)
        candidate_score = score(candidate) if candidate is not None else 0.0
        incumbent, incumbent_score = next(main, (None, 0.0))
        while candidate is not None or incumbent is not None:
            if incumbent is None or (candidate is not None and candidate_score <= incumbent_score):
                yield candidate  # type: ignore[misc]
                candidate = next(window, None)
                if candidate is not None:
                    candidate_score = score(candidate)
            else:
                yield incumbent
                incumbent, incumbent_score = next(main, (None, 0.0))

    def __contains__(self, key: str) -> bool:
        return key in self._weight


class WTinyLFUHitsPolicy(WTinyLFUPolicy):
    """W-TinyLFU ranking by frequency alone (``cost_exponent`` 0): the most hits, more
    load seconds than ``wtinylfu`` when load costs differ between models."""

    name = "wtinylfu-hits"

    def __init__(self, **options: Any) -> None:
        options.setdefault("cost_exponent", 0.0)
        super().__init__(**options)


class GDSFPolicy(EvictionPolicy):
    """GreedyDual-Size-Frequency: evict the lowest ``L + frequency * load_cost_s / size``.

    ``frequency`` comes from an aging count-min sketch, so a model keeps its history across
    evictions.  ``L`` (the inflation value) rises to the priority of each removed model, so
    models that stop being requested age out behind newcomers.  An administrative unload of
    a hot model also raises ``L``; that only makes the policy favour recency for a while.

    A binary heap with lazy deletion: O(log n) per request for resident keys (n residents),
    stale entries compacted when they outnumber live ones.
    """

    name = "gdsf"

    def __init__(self, sample_size: int = 32768, sketch_width: int = 4096) -> None:
        self.sketch = FrequencySketch(width=sketch_width, sample_size=sample_size)
        self.inflation = 0.0
        self._heap: list[tuple[float, int, str]] = []
        self._live: dict[str, tuple[float, int]] = {}  # key -> (priority, seq) of its entry
        self._weight: dict[str, float] = {}
        self._seq = 0

    def __len__(self) -> int:
        return len(self._live)

    def _push(self, key: str) -> None:
        priority = self.inflation + self.sketch.estimate(key) * self._weight[key]
        self._seq += 1
        self._live[key] = (priority, self._seq)
        heapq.heappush(self._heap, (priority, self._seq, key))
        if len(self._heap) > 2 * len(self._live) + 64:
            self._heap = [(p, s, k) for k, (p, s) in self._live.items()]
            heapq.heapify(self._heap)

    def touch(self, key: str, now: float) -> None:
        self.sketch.increment(key)
        if key in self._live:
            self._push(key)

    def admit(self, key: str, now: float, size_bytes: int = 0, load_cost_s: float = 1.0) -> None:
        self._weight[key] = _weight(size_bytes, load_cost_s)
        self._push(key)

    def remove(self, key: str) -> None:
        entry = self._live.pop(key, None)
        if entry is None:
            return
        del self._weight[key]
        self.inflation = max(self.inflation, entry[0])
        if not self._live:
            self._heap.clear()

    def victim_order(self) -> Iterator[str]:
        # Walk the heap in priority order without popping: a frontier heap of indexes
        # whose parents were visited; stale entries are skipped but their subtrees kept.
        heap, live = self._heap, self._live
        if not heap:
            return
        frontier = [(heap[0][0], heap[0][1], 0)]
        size = len(heap)
        while frontier:
            _, _, i = heapq.heappop(frontier)
            priority, seq, key = heap[i]
            if live.get(key) == (priority, seq):
                yield key
            for child in (2 * i + 1, 2 * i + 2):
                if child < size:
                    entry = heap[child]
                    heapq.heappush(frontier, (entry[0], entry[1], child))

    def __contains__(self, key: str) -> bool:
        return key in self._live
