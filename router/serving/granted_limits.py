"""Rate limits that hold across router workers: tokens come from the control plane's
global buckets (``control_plane.dataplane.rate_grants``) in small batches, asked for ahead of
need; without the control plane each worker keeps its share of the limit locally."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable

from domain.errors import ControlPlaneError
from domain.token_bucket import TokenBucket
from router.rollouts.limits import grant_batch, rate_limited
from router.serving.state_client import ControlPlaneAway, RemoteState


class _Stock:
    def __init__(self, spec: dict):
        self.spec = spec
        self.tokens = 0
        self.denied_until = 0.0
        self.pending: asyncio.Task | None = None
        self.local: TokenBucket | None = None  # this worker's share while the control plane is away


class GrantedLimiter:
    """Rate limits that hold across workers: tokens come from the control plane's bucket."""

    def __init__(self, state: RemoteState, on_limited=None):
        self.state = state
        self.on_limited = on_limited
        self._stock: dict[str, _Stock] = {}

    def acquire(self, names) -> Awaitable[None] | None:
        """A coroutine that spends a token of each limited name, or None when no limit
        applies to these names (nothing to await)."""
        limits = self.state.table.limits
        if not limits or not any(name in limits for name in names):
            return None
        return self._take_each(limits, names)

    async def _take_each(self, limits: dict, names) -> None:
        for name in names:
            spec = limits.get(name)
            if spec is not None:
                await self._take(name, spec)

    async def _take(self, name: str, spec: dict) -> None:
        stock = self._stock.get(name)
        if stock is None or stock.spec != spec:
            stock = self._stock[name] = _Stock(spec)
        batch = grant_batch(spec["qps"], self.state.workers)
        while stock.tokens < 1:
            # Refused only when the bucket said no: a grant that requests waiting beside this
            # one took first is asked for again (a grant of one token while the control plane
            # is away, or more waiters than a batch).
            now = time.monotonic()
            if now < stock.denied_until:
                self._refuse(name, spec, stock.denied_until - now)
            await self._refill(name, stock, batch)
        stock.tokens -= 1
        if stock.tokens < batch / 2 and stock.pending is None and stock.denied_until <= time.monotonic():
            # Ask ahead, so the next requests do not wait for the control plane.
            stock.pending = asyncio.get_running_loop().create_task(self._ask(name, stock, batch))

    def _refuse(self, name: str, spec: dict, retry_after_s: float):
        if self.on_limited is not None:
            self.on_limited(name)
        raise rate_limited(name, spec, retry_after_s)

    async def _refill(self, name: str, stock: _Stock, batch: int) -> None:
        if stock.pending is None:
            stock.pending = asyncio.get_running_loop().create_task(self._ask(name, stock, batch))
        await asyncio.shield(stock.pending)

    async def _ask(self, name: str, stock: _Stock, batch: int) -> None:
        try:
            granted, retry_after_s = await self.state.grant(name, batch)
            stock.local = None
        except (ControlPlaneAway, ControlPlaneError):
            # Without the control plane: this worker's share of the limit, locally.
            workers = self.state.workers
            if stock.local is None:
                stock.local = TokenBucket(stock.spec["qps"] / workers, max(1.0, stock.spec["burst"] / workers))
            granted = 0
            while granted < batch:
                ok, retry_after_s = stock.local.try_acquire()
                if not ok:
                    break
                granted += 1
        finally:
            stock.pending = None
        stock.tokens += granted
        if granted == 0:
            stock.denied_until = time.monotonic() + max(retry_after_s, 0.001)
