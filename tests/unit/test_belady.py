"""Belady's MIN on hand-made traces with known optima, and against brute force."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bench.belady import belady, next_use


def optimal_misses(requests: list[int], slots: int) -> int:
    """Fewest misses of any demand-loading cache: exhaustive search over resident sets."""
    states: dict[frozenset[int], int] = {frozenset(): 0}
    for key in requests:
        nxt: dict[frozenset[int], int] = {}
        for resident, misses in states.items():
            if key in resident:
                options = [(resident, misses)]
            elif len(resident) < slots:
                options = [(resident | {key}, misses + 1)]
            else:
                options = [((resident - {v}) | {key}, misses + 1) for v in resident]
            for state, m in options:
                if m < nxt.get(state, 1 << 30):
                    nxt[state] = m
        states = nxt
    return min(states.values())


@pytest.mark.parametrize(
    ("requests", "slots", "misses"),
    [
        # Textbook reference strings with published OPT fault counts.
        ([1, 2, 3, 4, 1, 2, 5, 1, 2, 3, 4, 5], 3, 7),
        ([1, 2, 3, 4, 1, 2, 5, 1, 2, 3, 4, 5], 4, 6),
        ([7, 0, 1, 2, 0, 3, 0, 4, 2, 3, 0, 3, 2, 1, 2, 0, 1, 7, 0, 1], 3, 9),
        ([7, 0, 1, 2, 0, 3, 0, 4, 2, 3, 0, 3, 2, 1, 2, 0, 1, 7, 0, 1], 4, 8),
        # Cyclic scan one longer than the cache: LRU misses on every request; MIN, after
        # the 4 cold misses, once every 3 requests (positions 6, 9, 12, 15, 18).
        ([0, 1, 2, 3] * 5, 3, 9),
        ([5, 5, 5], 1, 1),
        ([0, 1, 0, 1, 0, 1], 1, 6),
        ([], 2, 0),
    ],
)
def test_belady_misses_as_few_as_the_known_optimum(requests, slots, misses):
    result = belady(requests, slots)
    assert result.misses == misses
    assert result.hits == len(requests) - misses
    assert result.misses == optimal_misses(requests, slots)


def test_cache_larger_than_key_set_only_misses_first_use():
    requests = [3, 1, 3, 2, 1, 1, 0, 2, 3]
    result = belady(requests, slots=10)
    assert result.misses == 4
    assert result.misses_per_key.tolist() == [1, 1, 1, 1]


def test_next_use_gives_each_requests_next_position_of_its_key_or_the_end():
    assert next_use(np.array([1, 2, 1, 1, 3, 2])).tolist() == [2, 5, 3, 6, 6, 6]
    assert next_use(np.array([], dtype=np.int64)).tolist() == []


def test_cost_weighted_misses():
    result = belady([0, 1, 2, 0, 1, 2], slots=2)
    costs = [1.0, 10.0, 100.0]
    assert result.cost_weighted_miss_s(costs) == pytest.approx(
        float(np.dot(result.misses_per_key, costs)))
    assert int(result.misses_per_key.sum()) == result.misses


def test_rejects_bad_arguments():
    with pytest.raises(ValueError, match="slots"):
        belady([1, 2], 0)
    with pytest.raises(ValueError, match="non-negative"):
        belady([1, -2], 2)


def naive_min_misses(requests: np.ndarray, slots: int) -> int:
    """MIN by a linear scan of the residents on every eviction (no heap)."""
    nxt = next_use(requests).tolist()
    resident: dict[int, int] = {}
    misses = 0
    for key, nu in zip(requests.tolist(), nxt):
        if key not in resident:
            misses += 1
            if len(resident) >= slots:
                del resident[max(resident, key=resident.__getitem__)]
        resident[key] = nu
    return misses


@pytest.mark.parametrize("slots", [1, 5, 17])
def test_long_trace_matches_linear_scan(slots):
    # Long enough for the heap to be compacted many times (every 4 * slots + 1024 pushes).
    requests = np.random.default_rng(slots).zipf(1.3, 8000) % 60
    assert belady(requests, slots).misses == naive_min_misses(requests, slots)


@settings(max_examples=150, deadline=None)
@given(
    requests=st.lists(st.integers(0, 4), min_size=0, max_size=14),
    slots=st.integers(1, 4),
)
def test_matches_brute_force(requests, slots):
    assert belady(requests, slots).misses == optimal_misses(requests, slots)


@settings(max_examples=50, deadline=None)
@given(requests=st.lists(st.integers(0, 30), min_size=1, max_size=300), slots=st.integers(1, 12))
def test_never_worse_than_lru(requests, slots):
    lru: list[int] = []
    lru_misses = 0
    for key in requests:
        if key in lru:
            lru.remove(key)
        else:
            lru_misses += 1
            if len(lru) >= slots:
                lru.pop(0)
        lru.append(key)
    assert belady(requests, slots).misses <= lru_misses
