"""How many misses one client may cause: a miss loads a model (or fills a family's slot) and
may evict another client's, so a client cycling through model names could otherwise push
every hot model out of memory.

Each client has a token bucket per router worker (``rate_per_s``, up to ``burst``); a request
that needs a load spends a token, and a client with none left gets RESOURCE_EXHAUSTED / 429
with the reason and when to retry, before anything is loaded or evicted for it.  Requests for
resident models never spend one.  A client is its peer address, or the value of a header the
operator names (set by a proxy they trust); peers on the loopback interface are not counted
unless that header names them (local tools, health checks, a proxy on the same host that does
not say who its clients are).

The frontends set ``CLIENT`` at the start of each inference call (the transport knows the
peer: ``router.frontends.peers.grpc_client`` / ``http_client``); the sender reads it where it
finds a miss, so gRPC and HTTP share one check.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextvars import ContextVar

from domain.router_errors import RateLimited

# The client of the inference call this task serves (None: not counted).
CLIENT: ContextVar[str | None] = ContextVar("mms_client", default=None)
BURST_SECONDS = 10.0  # the bucket holds this many seconds of the rate


class MissBudget:
    """Token buckets of misses, one per client.  ``rate_per_s`` <= 0 turns the budget off."""

    MAX_CLIENTS = 10_000

    def __init__(self, rate_per_s: float, clock: Callable[[], float] = time.monotonic,
                 on_refused: Callable[[], None] | None = None):
        self.rate_per_s = rate_per_s
        self.burst = max(1.0, rate_per_s * BURST_SECONDS)
        self.clock = clock
        self.on_refused = on_refused
        self._buckets: dict[str, tuple[float, float]] = {}  # client -> (tokens, at)

    def spend(self, model: str, client: str | None = None) -> None:
        """Count a miss for ``client`` (default: this call's, ``CLIENT``); raises RateLimited
        when it has none left."""
        client = CLIENT.get() if client is None else client
        if self.rate_per_s <= 0 or client is None:
            return
        now = self.clock()
        tokens, at = self._buckets.get(client, (self.burst, now))
        tokens = min(self.burst, tokens + (now - at) * self.rate_per_s)
        if tokens < 1.0:
            self._buckets[client] = (tokens, now)
            if self.on_refused is not None:
                self.on_refused()
            retry_after_s = (1.0 - tokens) / self.rate_per_s
            raise RateLimited(
                f"'{model}' is not loaded and client {client} has caused more misses than its "
                f"budget ({self.rate_per_s:g} a second, {self.burst:g} at once): each one loads a "
                f"model and may evict another's; retry in {retry_after_s:.1f} s, or ask for "
                "models that are loaded", retry_after_s)
        if len(self._buckets) >= self.MAX_CLIENTS and client not in self._buckets:
            self._forget_full(now)
        self._buckets[client] = (tokens - 1.0, now)

    def _forget_full(self, now: float) -> None:
        """Drop clients whose bucket has refilled (they are as if never seen); if every one is
        still spending, drop them all rather than grow without bound."""
        self._buckets = {c: (t, at) for c, (t, at) in self._buckets.items()
                         if t + (now - at) * self.rate_per_s < self.burst}
        if len(self._buckets) >= self.MAX_CLIENTS:
            self._buckets.clear()
