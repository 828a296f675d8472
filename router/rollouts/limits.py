"""Rate limits per logical name and per model.

``LocalLimiter``: token buckets in this process, the limit as configured (one router).
Router workers are granted tokens in small batches (``grant_batch``) from the control
plane's buckets (``control_plane.dataplane.rate_grants``), so a limit holds across every
worker (``router.serving.state_client``).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

from domain.router_errors import RateLimited
from domain.token_bucket import TokenBucket


def rate_limited(name: str, spec: dict, retry_after_s: float) -> RateLimited:
    return RateLimited(
        f"rate limit for {name} is {spec['qps']:g} requests/s (burst {spec['burst']:g}); "
        f"retry in {retry_after_s:.3f}s", retry_after_s)


class LocalLimiter:
    """``limits()``: the route table's limits now ({name: {"qps", "burst"}})."""

    def __init__(self, limits: Callable[[], dict], on_limited: Callable[[str], None] | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.limits = limits
        self.on_limited = on_limited
        self.clock = clock
        self._buckets: dict[str, tuple[dict, TokenBucket]] = {}

    def check(self, names) -> None:
        limits = self.limits()
        if not limits:
            return
        for name in names:
            spec = limits.get(name)
            if spec is None:
                continue
            cached = self._buckets.get(name)
            if cached is None or cached[0] != spec:
                cached = self._buckets[name] = (spec, TokenBucket(spec["qps"], spec["burst"], self.clock))
            ok, retry_after_s = cached[1].try_acquire()
            if not ok:
                if self.on_limited is not None:
                    self.on_limited(name)
                raise rate_limited(name, spec, retry_after_s)

    def acquire(self, names) -> None:
        """Spent at once (``check``): nothing to await."""
        self.check(names)


def grant_batch(qps: float, workers: int) -> int:
    """Tokens a worker asks for at once: about 5% of a second's worth shared by the
    workers, so that what idle workers hold unused stays a few percent of the limit."""
    return max(1, math.floor(qps * 0.05 / max(1, workers)))
