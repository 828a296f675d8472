"""The trace generators are deterministic for a seed and shaped as documented."""

from __future__ import annotations

import numpy as np
import pytest

from bench import traces
from bench.traces import DAY_S, STANDARD_TRACES, Trace


def same(a: Trace, b: Trace) -> bool:
    return (
        a.name == b.name
        and a.models == b.models
        and np.array_equal(a.requests, b.requests)
        and np.array_equal(a.times_s, b.times_s)
        and a.sizes_bytes == b.sizes_bytes
        and a.load_costs_s == b.load_costs_s
        and a.popularity == b.popularity
        and (a.slots, a.pin_top, a.seed) == (b.slots, b.pin_top, b.seed)
    )


@pytest.mark.parametrize("spec", STANDARD_TRACES, ids=lambda s: f"{s.name}-{s.models}")
def test_standard_traces_are_deterministic_and_well_formed(spec):
    first, again = spec.build(3000, 11), spec.build(3000, 11)
    assert same(first, again)
    assert not np.array_equal(first.requests, spec.build(3000, 12).requests)
    assert first.name == spec.name
    assert first.n_models == spec.models == len(first.sizes_bytes) == len(first.load_costs_s)
    assert first.n_requests == 3000
    assert first.requests.dtype == np.int32
    assert 0 <= first.requests.min() and first.requests.max() < first.n_models
    assert np.all(np.diff(first.times_s) >= 0)
    assert sorted(first.popularity) == list(range(first.n_models))
    assert 0 < first.pin_top < first.slots < first.n_models
    assert all(s > 0 for s in first.sizes_bytes) and all(c > 0 for c in first.load_costs_s)
    assert len(set(first.models)) == first.n_models
    assert first.keys()[:5] == [first.models[i] for i in first.requests[:5]]


def test_sizes_and_costs_do_not_depend_on_trace_length():
    short, long = traces.zipf(1.0, 1000, 100, seed=3), traces.zipf(1.0, 1000, 5000, seed=3)
    assert short.sizes_bytes == long.sizes_bytes
    assert short.load_costs_s == long.load_costs_s
    assert short.popularity == long.popularity
    assert np.array_equal(long.requests[:100], short.requests)


def test_zipf_popularity_follows_the_ranking():
    trace = traces.zipf(1.2, 50, 50_000, seed=5)
    counts = np.bincount(trace.requests, minlength=50)
    top = trace.popularity[0]
    assert counts.argmax() == top
    share = counts[top] / trace.n_requests
    assert share == pytest.approx(traces.zipf_weights(50, 1.2)[0], abs=0.01)
    assert trace.name == "zipf-1.2"
    assert traces.zipf(1.0, 10, 10, seed=1).name == "zipf-1.0"


def test_shift_permutes_popularity_halfway():
    trace = traces.shift(200, 40_000, seed=2)
    half = trace.n_requests // 2
    before = np.bincount(trace.requests[:half], minlength=200)
    after = np.bincount(trace.requests[half:], minlength=200)
    assert before.argmax() == trace.popularity[0]
    assert after.argmax() != before.argmax()
    top_before = set(np.argsort(-before)[:20].tolist())
    top_after = set(np.argsort(-after)[:20].tolist())
    assert len(top_before & top_after) < 10


def test_seed_scenario_top_customers_send_most_requests():
    trace = traces.seed_scenario(n_requests=50_000, seed=4)
    counts = np.bincount(trace.requests, minlength=50)
    top12 = counts[trace.popularity[:12]].sum() / trace.n_requests
    assert top12 == pytest.approx(0.8, abs=0.01)
    assert trace.models[0] == "cust000" and trace.n_models == 50
    assert trace.pin_top == 12 and 12 <= trace.slots <= 15
    with pytest.raises(ValueError, match="top"):
        traces.seed_scenario(n_customers=10, top=10)


def test_diurnal_popularity_follows_the_day():
    trace = traces.diurnal(300, 60_000, seed=6, days=2.0)
    assert trace.times_s[0] >= 0 and trace.times_s[-1] <= 2 * DAY_S
    # The busiest model of the first quarter-day is not the busiest half a day later.
    quarter = trace.times_s < DAY_S / 4
    later = (trace.times_s >= DAY_S / 2) & (trace.times_s < 3 * DAY_S / 4)
    morning = np.bincount(trace.requests[quarter], minlength=300)
    evening = np.bincount(trace.requests[later], minlength=300)
    assert set(np.argsort(-morning)[:10].tolist()) != set(np.argsort(-evening)[:10].tolist())


def test_model_costs_are_plausible():
    sizes, costs = traces.model_costs(2000, seed=1)
    assert min(sizes) >= 50e6 and max(sizes) <= 8e9
    assert 4e8 < float(np.median(sizes)) < 9e8
    assert min(costs) > 0.25
    # Bigger models take longer to load, on the whole.
    assert np.corrcoef(sizes, costs)[0, 1] > 0.8
