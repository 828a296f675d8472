"""Seeded, deterministic request traces for replaying eviction policies.

Every generator takes ``seed`` and returns the same ``Trace`` for the same arguments (numpy's
PCG64 stream; nothing depends on Python's salted ``hash`` or on wall-clock time).  A trace
carries, besides the requested model ids and their arrival times (simulated seconds), each
model's size and load cost, the popularity order the generator intended (what an operator
would pin) and a suggested number of GPU slots.

Traces (``STANDARD_TRACES`` lists the set the replay runs):

* ``zipf-<alpha>``: stationary Zipf popularity over a random permutation of the models.
* ``shift``: Zipf(1.0), popularity permuted afresh halfway through.
* ``diurnal``: three regions a third of a day apart; each region's models swell and fade
  with its daytime, and the total rate follows the sum.
* ``seed``: 50 customers, the top 12 sending 80% of requests (the product's seed scenario).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

DAY_S = 86_400.0


@dataclass(frozen=True)
class Trace:
    name: str
    models: list[str]  # index = model id
    requests: np.ndarray  # int32 model ids, one per request
    times_s: np.ndarray  # float64 arrival times, non-decreasing, simulated seconds
    sizes_bytes: list[int]  # per model id
    load_costs_s: list[float]  # per model id: seconds to load it into the GPU
    popularity: list[int]  # model ids, most requested first, as generated (first phase)
    slots: int  # suggested GPU slots for replay
    pin_top: int  # how many of the most popular models an operator would pin
    seed: int

    @property
    def n_requests(self) -> int:
        return int(self.requests.shape[0])

    @property
    def n_models(self) -> int:
        return len(self.models)

    @property
    def duration_s(self) -> float:
        return float(self.times_s[-1] - self.times_s[0]) if self.n_requests > 1 else 0.0

    def keys(self) -> list[str]:
        """Requested model names in order (shared string objects, cheap)."""
        models = self.models
        return [models[i] for i in self.requests.tolist()]


def _rng(seed: int, stream: int) -> np.random.Generator:
    # One independent stream per purpose, so e.g. asking for more requests does not change
    # the model sizes.
    return np.random.default_rng([seed, stream])


def zipf_weights(n: int, alpha: float) -> np.ndarray:
    """Probabilities proportional to 1 / rank**alpha, rank 1..n."""
    w = 1.0 / np.arange(1, n + 1, dtype=np.float64) ** alpha
    return w / w.sum()


def model_costs(
    n_models: int, seed: int, median_bytes: float = 600e6, spread: float = 1.0
) -> tuple[list[int], list[float]]:
    """Per-model sizes (log-normal around ``median_bytes``) and load costs.

    A load costs a fixed 0.25 s (process/stub start) plus the bytes over an effective
    1.5 GB/s, times a per-model factor 0.7..1.4 for framework initialisation.
    """
    rng = _rng(seed, 1)
    sizes = np.exp(rng.normal(math.log(median_bytes), spread, n_models))
    sizes = np.clip(sizes, 50e6, 8e9).astype(np.int64)
    factor = rng.uniform(0.7, 1.4, n_models)
    costs = 0.25 + sizes / 1.5e9 * factor
    return [int(s) for s in sizes], [round(float(c), 4) for c in costs]


def _arrivals(rng: np.random.Generator, n: int, rate_per_s: float) -> np.ndarray:
    return np.cumsum(rng.exponential(1.0 / rate_per_s, n))


def _names(prefix: str, n: int) -> list[str]:
    width = max(3, len(str(n - 1)))
    return [f"{prefix}{i:0{width}d}" for i in range(n)]


def zipf(
    alpha: float = 1.0,
    n_models: int = 1000,
    n_requests: int = 1_000_000,
    seed: int = 1,
    slots: int | None = None,
    rate_per_s: float = 100.0,
) -> Trace:
    """Stationary Zipf(``alpha``) popularity; model ids ranked by a seeded permutation."""
    rng = _rng(seed, 2)
    ranking = rng.permutation(n_models)  # ranking[r] = model id of popularity rank r
    ranks = rng.choice(n_models, size=n_requests, p=zipf_weights(n_models, alpha))
    sizes, costs = model_costs(n_models, seed)
    if slots is None:
        slots = max(2, n_models // 10) if n_models > 100 else 12
    return Trace(
        name=f"zipf-{alpha:g}" if alpha != int(alpha) else f"zipf-{alpha:.1f}",
        models=_names("m", n_models),
        requests=ranking[ranks].astype(np.int32),
        times_s=_arrivals(_rng(seed, 3), n_requests, rate_per_s),
        sizes_bytes=sizes,
        load_costs_s=costs,
        popularity=[int(i) for i in ranking],
        slots=slots,
        pin_top=slots // 2,
        seed=seed,
    )


def shift(
    n_models: int = 1000,
    n_requests: int = 1_000_000,
    seed: int = 1,
    alpha: float = 1.0,
    slots: int = 100,
    rate_per_s: float = 100.0,
) -> Trace:
    """Zipf(``alpha``) whose popularity is permuted afresh halfway through the trace."""
    rng = _rng(seed, 4)
    before, after = rng.permutation(n_models), rng.permutation(n_models)
    p = zipf_weights(n_models, alpha)
    half = n_requests // 2
    ranks = rng.choice(n_models, size=n_requests, p=p)
    requests = np.concatenate([before[ranks[:half]], after[ranks[half:]]]).astype(np.int32)
    sizes, costs = model_costs(n_models, seed)
    return Trace(
        name="shift",
        models=_names("m", n_models),
        requests=requests,
        times_s=_arrivals(_rng(seed, 3), n_requests, rate_per_s),
        sizes_bytes=sizes,
        load_costs_s=costs,
        popularity=[int(i) for i in before],
        slots=slots,
        pin_top=slots // 2,
        seed=seed,
    )


def diurnal(
    n_models: int = 1000,
    n_requests: int = 1_000_000,
    seed: int = 1,
    alpha: float = 1.0,
    slots: int = 100,
    days: float = 3.0,
    regions: int = 3,
    amplitude: float = 0.85,
    buckets_per_day: int = 96,
) -> Trace:
    """Regions in different time zones: each model peaks in its region's daytime.

    Model i has base weight Zipf(alpha) and belongs to region ``i % regions`` (after a
    seeded permutation); its weight at time t is ``base * (1 + amplitude * cos(phase))``
    with the region's phase a fraction of a day apart.  Time is cut into
    ``buckets_per_day`` buckets; each gets requests in proportion to the total weight then
    and draws them from that bucket's popularity.
    """
    rng = _rng(seed, 5)
    ranking = rng.permutation(n_models)
    base = np.empty(n_models)
    base[ranking] = zipf_weights(n_models, alpha)
    region = rng.permutation(n_models) % regions
    phase = region / regions + rng.uniform(-0.03, 0.03, n_models)  # peak time, in days
    n_buckets = max(1, round(days * buckets_per_day))
    bucket_s = days * DAY_S / n_buckets
    centres_day = (np.arange(n_buckets) + 0.5) * bucket_s / DAY_S
    weights = base[None, :] * (
        1.0 + amplitude * np.cos(2 * np.pi * (centres_day[:, None] - phase[None, :]))
    )
    rate = weights.sum(axis=1)
    counts = rng.multinomial(n_requests, rate / rate.sum())
    requests = np.empty(n_requests, dtype=np.int32)
    times = np.empty(n_requests, dtype=np.float64)
    at = 0
    for b, count in enumerate(counts.tolist()):
        if count == 0:
            continue
        p = weights[b] / weights[b].sum()
        requests[at:at + count] = rng.choice(n_models, size=count, p=p)
        times[at:at + count] = np.sort(rng.uniform(b * bucket_s, (b + 1) * bucket_s, count))
        at += count
    sizes, costs = model_costs(n_models, seed)
    return Trace(
        name="diurnal",
        models=_names("m", n_models),
        requests=requests,
        times_s=times,
        sizes_bytes=sizes,
        load_costs_s=costs,
        popularity=[int(i) for i in ranking],
        slots=slots,
        pin_top=slots // 2,
        seed=seed,
    )


def seed_scenario(
    n_customers: int = 50,
    n_requests: int = 1_000_000,
    seed: int = 1,
    top: int = 12,
    top_share: float = 0.8,
    slots: int = 14,
    rate_per_s: float = 50.0,
) -> Trace:
    """Per-customer fine-tunes of one base model: the top ``top`` send ``top_share``.

    Within each group popularity is Zipf(0.6); sizes are alike (one base model, 1.5 GB
    +-10%).  Suggested: ``slots`` GPU slots with the top customers pinned.
    """
    if not 0 < top < n_customers:
        raise ValueError(f"top ({top}) must be between 1 and n_customers - 1 ({n_customers - 1})")
    rng = _rng(seed, 6)
    p = np.concatenate([
        top_share * zipf_weights(top, 0.6),
        (1.0 - top_share) * zipf_weights(n_customers - top, 0.6),
    ])
    ranking = np.arange(n_customers)  # customer 0 is the busiest: names read naturally
    requests = rng.choice(n_customers, size=n_requests, p=p).astype(np.int32)
    sizes, costs = model_costs(n_customers, seed, median_bytes=1.5e9, spread=0.05)
    return Trace(
        name="seed",
        models=_names("cust", n_customers),
        requests=requests,
        times_s=_arrivals(_rng(seed, 3), n_requests, rate_per_s),
        sizes_bytes=sizes,
        load_costs_s=costs,
        popularity=[int(i) for i in ranking],
        slots=slots,
        pin_top=top,
        seed=seed,
    )


@dataclass(frozen=True)
class TraceSpec:
    """A named trace of the standard set and how to build it at a given length."""

    name: str
    models: int
    default_requests: int
    build: Callable[[int, int], Trace]  # (n_requests, seed) -> Trace


def _zipf_spec(alpha: float, models: int, default_requests: int) -> TraceSpec:
    name = f"zipf-{alpha:.1f}"
    return TraceSpec(name, models, default_requests,
                     lambda n, seed: zipf(alpha, models, n, seed))


STANDARD_TRACES: list[TraceSpec] = [
    *(_zipf_spec(a, 50, 200_000) for a in (0.8, 1.0, 1.2)),
    *(_zipf_spec(a, 1000, 1_000_000) for a in (0.8, 1.0, 1.2)),
    TraceSpec("shift", 1000, 1_000_000, lambda n, seed: shift(1000, n, seed)),
    TraceSpec("diurnal", 1000, 1_000_000, lambda n, seed: diurnal(1000, n, seed)),
    TraceSpec("seed", 50, 200_000, lambda n, seed: seed_scenario(50, n, seed)),
]
