"""The control plane's side of rate limits across router workers: one token bucket per
limited name, from which workers are granted tokens in small batches
(``router.rollouts.limits.grant_batch``, ``router.serving.granted_limits``)."""

from __future__ import annotations

import time
from collections.abc import Callable

from domain.token_bucket import TokenBucket


class GlobalBuckets:
    """The control plane's side: one bucket per limited name, tokens granted in batches."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self._buckets: dict[str, tuple[dict, TokenBucket]] = {}

    def grant(self, name: str, spec: dict | None, want: int) -> tuple[int, float]:
        """(tokens granted, seconds until the next one) for a worker asking ``want``."""
        if spec is None:  # no limit (any more): the worker may serve freely
            return want, 0.0
        cached = self._buckets.get(name)
        if cached is None or cached[0] != spec:
            cached = self._buckets[name] = (spec, TokenBucket(spec["qps"], spec["burst"], self.clock))
        bucket = cached[1]
        granted = 0
        retry_after_s = 0.0
        while granted < want:
            ok, retry_after_s = bucket.try_acquire()
            if not ok:
                break
            granted += 1
        return granted, retry_after_s
