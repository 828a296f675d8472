"""Belady's offline optimum (MIN) for a cache of ``slots`` equally sized entries.

On a miss with the cache full, evict the resident key whose next request lies farthest in
the future (never requested again counts as infinitely far).  With demand loading (every
requested key must be resident when served, as in a model server) this minimises the
number of misses, so it is the reference the online policies are measured against.

O(n log slots) for n requests: a next-use array computed in numpy (stable sort by key),
then a max-heap of resident keys by next use with lazy deletion.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass
class BeladyResult:
    requests: int
    hits: int
    misses: int
    misses_per_key: np.ndarray  # int64, indexed by key id

    @property
    def hit_ratio(self) -> float:
        return self.hits / self.requests if self.requests else 0.0

    def cost_weighted_miss_s(self, load_costs_s: Sequence[float]) -> float:
        """Misses weighted by each key's load cost.  ``misses_per_key`` ends at the highest key
        requested; a short trace need not request the last keys of a catalogue, which missed
        nothing."""
        costs = np.asarray(load_costs_s, dtype=np.float64)
        if costs.size < self.misses_per_key.size:
            raise ValueError(f"{costs.size} load costs for {self.misses_per_key.size} keys")
        return float(np.dot(self.misses_per_key, costs[:self.misses_per_key.size]))


def next_use(requests: np.ndarray) -> np.ndarray:
    """For each position, the index of the next request for the same key, or ``len``."""
    n = len(requests)
    order = np.argsort(requests, kind="stable")
    nxt = np.full(n, n, dtype=np.int64)
    if n > 1:
        same = requests[order[1:]] == requests[order[:-1]]
        nxt[order[:-1][same]] = order[1:][same]
    return nxt


def belady(requests: Sequence[int] | np.ndarray, slots: int) -> BeladyResult:
    """Replay ``requests`` (non-negative int key ids) through MIN with ``slots`` entries."""
    if slots < 1:
        raise ValueError(f"slots ({slots}) must be >= 1")
    req = np.asarray(requests, dtype=np.int64)
    if req.size and req.min() < 0:
        raise ValueError("key ids must be non-negative")
    n = int(req.size)
    n_keys = int(req.max()) + 1 if n else 0
    nxt = next_use(req).tolist()
    keys = req.tolist()
    # Heap entries are ints: -(next_use * n_keys + key), so the top is the farthest use.
    # An entry is stale once its key was requested again (its next use moved) or evicted.
    resident: dict[int, int] = {}  # key -> its current next use
    heap: list[int] = []
    misses_per_key = [0] * n_keys
    hits = 0
    compact_at = 4 * slots + 1024
    push, pop = heapq.heappush, heapq.heappop
    for key, nu in zip(keys, nxt):
        if key in resident:
            hits += 1
        else:
            misses_per_key[key] += 1
            if len(resident) >= slots:
                while True:
                    entry = -pop(heap)
                    victim, victim_next = entry % n_keys, entry // n_keys
                    if resident.get(victim) == victim_next:
                        del resident[victim]
                        break
        resident[key] = nu
        push(heap, -(nu * n_keys + key))
        if len(heap) > compact_at:
            heap = [-(v * n_keys + k) for k, v in resident.items()]
            heapq.heapify(heap)
    return BeladyResult(n, hits, n - hits, np.asarray(misses_per_key, dtype=np.int64))
