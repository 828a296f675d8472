"""Fair shares of a saturated server: one model's flood waits behind its own share instead of
in front of every other model's requests.

A server with a concurrency (``mmctl up --server-concurrency``, a servers file's
``concurrency``) takes at most that many requests at once from the router; Triton queues the
rest per model instance, first come first served, so without a gate a model that floods a
server puts its whole backlog in front of everyone else's requests (a family is one Triton
model: its variants share one queue).  Each router worker takes its part of the concurrency
(the concurrency over the workers, at least 1) and, when its part is in use, queues requests
per model and gives each freed turn by start-time fair queuing: every turn a model takes
moves its virtual time on by 1 / its weight (``mmctl share``; 1 when unset), a model that
starts waiting joins at the virtual time of the latest turn given, and a freed turn goes to
the waiting model with the earliest virtual time.  So turns are shared by weight among the
models that wait, a model alone gets the whole server, and a flood beside a trickle gets
what the trickle leaves: the trickle's next request goes before the flood's backlog.

Work is bounded: a model has at most ``max_waiting`` requests waiting per server in one worker;
the next is refused at once (RESOURCE_EXHAUSTED / 429) with what to do.  A request's wait counts
against its deadline: one whose deadline passes while it waits ends then, without reaching
Triton (the router's queue-deadline check refuses earlier the requests that could not start in
time: ``Sender.expected_wait_s`` counts the requests waiting here too).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from domain.router_errors import RateLimited, RequestTimeout

MAX_WAITING_PER_MODEL = 1024  # requests of one model waiting for one server, per worker


class ShareExhausted(RateLimited):
    """A model has as many requests waiting for its share of a saturated server as a worker
    holds: RESOURCE_EXHAUSTED / 429 with Retry-After."""


@dataclass
class _Server:
    """One server's turns in this worker: requests running per model, those waiting, and
    the virtual times of fair queuing."""

    running: collections.Counter = field(default_factory=collections.Counter)
    total: int = 0
    # model -> its waiting requests in arrival order: (arrival number, the turn's future)
    waiting: dict[str, collections.deque] = field(default_factory=dict)
    vtime: dict[str, float] = field(default_factory=dict)  # model -> its next turn's start tag
    clock: float = 0.0  # the start tag of the latest turn given

    def take(self, model: str, weight: float) -> None:
        """``model`` takes a turn: its start tag is its virtual time (not behind the clock)."""
        tag = max(self.vtime.get(model, 0.0), self.clock)
        self.clock = tag
        self.vtime[model] = tag + 1.0 / weight
        self.running[model] += 1
        self.total += 1

    def leave(self, model: str) -> None:
        self.running[model] -= 1
        self.total -= 1
        if not self.running[model]:
            del self.running[model]
            # An idle model's time is the clock's when it comes back: forget it unless it
            # is ahead (it took more than its share lately and keeps that debt).
            if model not in self.waiting and self.vtime.get(model, 0.0) <= self.clock:
                self.vtime.pop(model, None)


class ShareGate:
    """Turns on saturated servers, given out by weighted fair share.

    ``limit_of(server)``: this worker's part of the server's concurrency (None: no gate);
    ``weight_of(model)``: the model's weight (> 0).  ``on_wait(model, seconds)`` and
    ``on_refused(model)`` count waits and refusals."""

    def __init__(self, limit_of: Callable[[str], int | None], weight_of: Callable[[str], float],
                 on_wait: Callable[[str, float], None] = lambda model, s: None,
                 on_refused: Callable[[str], None] = lambda model: None,
                 max_waiting: int = MAX_WAITING_PER_MODEL):
        self.limit_of = limit_of
        self.weight_of = weight_of
        self.on_wait = on_wait
        self.on_refused = on_refused
        self.max_waiting = max_waiting
        self._servers: dict[str, _Server] = collections.defaultdict(_Server)
        self._arrivals = itertools.count()

    def waiting(self, server: str, model: str) -> int:
        s = self._servers.get(server)
        queue = None if s is None else s.waiting.get(model)
        return len(queue) if queue else 0

    @contextlib.asynccontextmanager
    async def turn(self, server: str, model: str, deadline: float | None,
                   asked: str | None = None) -> AsyncIterator[None]:
        """Hold one of ``server``'s turns for ``model`` while the body runs (at once while the
        server has a free turn and no one waits).  ``deadline``: time.monotonic() when the
        request's client stops waiting."""
        limit = self.limit_of(server)
        if limit is None:
            yield
            return
        s = self._servers[server]
        if s.total < limit and not s.waiting:
            s.take(model, self.weight_of(model))
        else:
            await self._wait(s, server, model, limit, deadline, asked or model)
        try:
            yield
        finally:
            s.leave(model)
            self._give_turns(s, self.limit_of(server))

    async def _wait(self, s: _Server, server: str, model: str, limit: int,
                    deadline: float | None, asked: str) -> None:
        queue = s.waiting.get(model)
        if queue is not None and len(queue) >= self.max_waiting:
            self.on_refused(model)
            raise ShareExhausted(
                f"'{asked}' has {len(queue)} requests waiting for its share of {server}, which "
                f"serves {limit} at once from this router and is saturated; retry in a second, "
                "send fewer at once, or raise its weight (mmctl share)", 1.0)
        if queue is None:
            queue = s.waiting[model] = collections.deque()
        turn: asyncio.Future = asyncio.get_running_loop().create_future()
        entry = (next(self._arrivals), turn)
        queue.append(entry)
        started = time.monotonic()
        try:
            if deadline is None:
                await turn
            else:
                async with asyncio.timeout_at(_loop_time(deadline)):
                    await turn
        except BaseException as exc:
            if turn.done() and not turn.cancelled():
                s.leave(model)  # given a turn just as it gave up: hand the turn on
                self._give_turns(s, self.limit_of(server))
            else:
                turn.cancel()
                _discard(s, model, entry)
            if isinstance(exc, TimeoutError):
                raise RequestTimeout(
                    f"'{asked}' waited {time.monotonic() - started:.2f} s for its share of "
                    f"{server} (saturated) and its deadline passed; retry with a longer "
                    "deadline, or give it more copies (mmctl scale) or weight (mmctl share)"
                ) from None
            raise
        finally:
            self.on_wait(model, time.monotonic() - started)

    def _give_turns(self, s: _Server, limit: int | None) -> None:
        """Free turns go to the waiting model with the earliest virtual time (the earliest
        arrival among equals)."""
        while s.waiting and (limit is None or s.total < limit):
            model = min(s.waiting, key=lambda m: (max(s.vtime.get(m, 0.0), s.clock),
                                                  s.waiting[m][0][0]))
            queue = s.waiting[model]
            _arrival, turn = queue.popleft()
            if not queue:
                del s.waiting[model]
            if turn.done():  # cancelled as it was chosen
                continue
            s.take(model, self.weight_of(model))
            turn.set_result(None)


def _discard(s: _Server, model: str, entry: tuple) -> None:
    queue = s.waiting.get(model)
    if queue is None:
        return
    with contextlib.suppress(ValueError):
        queue.remove(entry)
    if not queue:
        del s.waiting[model]


def _loop_time(deadline: float) -> float:
    """``deadline`` (time.monotonic()) on the event loop's clock."""
    return asyncio.get_running_loop().time() + (deadline - time.monotonic())
