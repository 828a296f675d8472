"""How many misses one client may cause: a miss loads a model (or fills a family's slot) and
may evict another client's, so a client cycling through model names could otherwise push
every hot model out of memory.

Each client has a token bucket per router worker (``rate_per_s``, up to ``burst``); a request
that needs a load spends a token, and a client with none left gets RESOURCE_EXHAUSTED / 429
with the reason and when to retry, before anything is loaded or evicted for it.  Requests for
resident models never spend one.  A client is its peer address, or what a header the operator
names says (set by a proxy they trust: the last entry of all its lines); an IPv6 address
counts as its /64 (``router.frontends.peers.client_key``).  Peers on the loopback interface
are not counted unless that header names them (local tools, health checks, a proxy on the
same host that does not say who its clients are).

The frontends set ``CLIENT`` at the start of each inference call to a function that says who
the client is (the transport knows the peer: ``router.frontends.peers.grpc_client`` /
``http_client``); the sender calls it only where it finds a miss, so gRPC and HTTP share one
check and a hit parses no address.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from contextvars import ContextVar

from domain.router_errors import RateLimited

# Who the client of the inference call this task serves is, asked on a miss (a function
# returning None, or no function: not counted).
CLIENT: ContextVar[Callable[[], str | None] | None] = ContextVar("mms_client", default=None)
BURST_SECONDS = 10.0  # the bucket holds this many seconds of the rate


class MissBudget:
    """Token buckets of misses, one per client, at most ``MAX_CLIENTS`` of them; ``rate_per_s``
    <= 0 turns the budget off.

    The table is bounded without resetting anyone's budget.  A bucket left alone for as long
    as an empty one takes to fill (``burst / rate_per_s``: 10 s, or one miss's worth if that
    is longer) is full again, as if never seen, and is dropped; buckets are kept least recently
    touched first, so those are found at the front at no cost per call.  When the table is
    still full, every client in it has spent within that time, and a client that is not in it
    gets no bucket of its own: all such new clients share one overflow bucket (the same rate
    and burst) until a bucket is dropped and makes room.  A flood of new addresses therefore
    neither grows memory nor gives anyone a fresh budget; what it costs is that clients new to
    this worker share one budget while the flood lasts.  A bucket is never evicted while it
    is still refilling, so a refused client stays refused until it has earned its next miss.
    """

    MAX_CLIENTS = 10_000

    def __init__(self, rate_per_s: float, clock: Callable[[], float] = time.monotonic,
                 on_refused: Callable[[], None] | None = None):
        self.rate_per_s = rate_per_s
        self.burst = max(1.0, rate_per_s * BURST_SECONDS)
        self.clock = clock
        self.on_refused = on_refused
        # client -> (tokens, at), least recently touched first
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()
        # The bucket that clients without one of their own share while the table is full.
        # Kept apart from the table so that no client (a header may name anything) can be it.
        self._overflow: tuple[float, float] | None = None

    def spend(self, model: str, client: str | None = None) -> None:
        """Count a miss for ``client`` (default: this call's, ``CLIENT``); raises RateLimited
        when it (or the overflow bucket it shares, see the class) has none left."""
        if self.rate_per_s <= 0:
            return
        if client is None:
            who = CLIENT.get()
            client = who() if who is not None else None
        if client is None:
            return
        now = self.clock()
        self._forget_refilled(now)
        shared = False
        if client in self._buckets:
            self._buckets.move_to_end(client)
            tokens, at = self._buckets[client]
        elif len(self._buckets) < self.MAX_CLIENTS:
            tokens, at = self.burst, now
        else:
            shared = True
            tokens, at = self._overflow or (self.burst, now)
        tokens = min(self.burst, tokens + (now - at) * self.rate_per_s)
        if tokens < 1.0:
            self._keep(client, shared, tokens, now)
            if self.on_refused is not None:
                self.on_refused()
            retry_after_s = (1.0 - tokens) / self.rate_per_s
            who = (f"the clients new to this router worker, {client} among them, have caused "
                   f"more misses than the one budget they share while {len(self._buckets)} "
                   "others are spending theirs" if shared
                   else f"client {client} has caused more misses than its budget")
            raise RateLimited(
                f"'{model}' is not loaded and {who} ({self.rate_per_s:g} a second, "
                f"{self.burst:g} at once): each one loads a model and may evict another's; "
                f"retry in {retry_after_s:.1f} s, or ask for models that are loaded",
                retry_after_s)
        self._keep(client, shared, tokens - 1.0, now)

    def _keep(self, client: str, shared: bool, tokens: float, now: float) -> None:
        # A client's own bucket is at the end of the table (moved there, or new).
        if shared:
            self._overflow = (tokens, now)
        else:
            self._buckets[client] = (tokens, now)

    def _forget_refilled(self, now: float) -> None:
        """Drop the buckets untouched for as long as an empty one takes to fill: they are full
        again.  Buckets touched since may be full too, but finding them would take a pass over
        the table on every call a flood of new clients makes; they go when their time comes."""
        refill_s = self.burst / self.rate_per_s
        while self._buckets:
            _, at = next(iter(self._buckets.values()))
            if now - at < refill_s:
                break
            self._buckets.popitem(last=False)
        if self._overflow is not None and now - self._overflow[1] >= refill_s:
            self._overflow = None
