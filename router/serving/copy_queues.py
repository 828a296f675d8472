"""The requests this router process has on each copy of each model: how many wait there
(sent, or waiting for a fair-share turn; those whose client stopped waiting too, while Triton
still has them) and the rate the copy answers them at.  From them: the copy a request goes
to (``least_loaded``), the wait a request sent now would have (``expected_wait_s``, which a
deadline is checked against) and the requests per model a report gives the control plane
(``outstanding_by_model``, what ``mmctl scale --replicas auto`` follows)."""

from __future__ import annotations

import asyncio
import collections
import random
import time
from collections.abc import Callable

from router.serving.serving_state import ServerAddress

# The rate a copy answers a model, from the answers of the last RATE_WINDOW_S seconds (at
# least RATE_MIN_ANSWERS of them, at most RATE_MAX_ANSWERS kept): the wait a new request would
# have there, which a deadline is checked against.
RATE_WINDOW_S = 2.0
RATE_MIN_ANSWERS = 5
RATE_MAX_ANSWERS = 4096
# A request whose deadline passes while Triton has it is still run there (Triton does not drop
# a queued request whose client stopped waiting): its send is kept open until Triton answers
# it (at most the router's request_timeout_s), so that it counts in its copy's queue and its
# answer in the copy's rate, at most this many at a time per router process: half the HTTP
# frontend's pool of connections to Triton (256), so kept sends never hold all of it.
MAX_KEPT_PAST_DEADLINE = 128

Pair = tuple[str, str]  # (server name, model)


class CopyQueues:
    """``on_kept(n)``: told the number of sends kept past their deadline when it changes."""

    def __init__(self, on_kept: Callable[[int], None] = lambda n: None):
        self.on_kept = on_kept
        # Requests on each server: a model with copies on several is sent where the fewest wait.
        self.outstanding: collections.Counter[str] = collections.Counter()
        self.queued: collections.Counter[Pair] = collections.Counter()
        self.answered_at: dict[Pair, collections.deque[float]] = {}
        self.kept_past_deadline = 0  # sends kept open after their client's deadline passed

    def count_in(self, pair: Pair) -> None:
        """A request sent (or waiting for its turn) on ``pair``'s server for its model."""
        # dict.get, not Counter's ``+= 1`` on a missing key and ``del``: those call
        # Counter.__missing__ and Counter.__delitem__, Python methods, on every request.
        outstanding, queued = self.outstanding, self.queued
        outstanding[pair[0]] = outstanding.get(pair[0], 0) + 1
        queued[pair] = queued.get(pair, 0) + 1

    def count_out(self, pair: Pair) -> None:
        outstanding, queued = self.outstanding, self.queued
        outstanding[pair[0]] -= 1
        left = queued[pair] - 1
        if left:
            queued[pair] = left
        else:
            queued.pop(pair)

    def answered(self, pair: Pair) -> None:
        """Triton answered a request of ``pair``: it counts in the copy's rate."""
        answered = self.answered_at.get(pair)
        if answered is None:
            answered = self.answered_at[pair] = collections.deque(maxlen=RATE_MAX_ANSWERS)
        answered.append(time.monotonic())

    def least_loaded(self, servers: list[ServerAddress]) -> ServerAddress:
        """Of a model's copies, the one with fewer requests outstanding from this process of
        two chosen at random (a tie goes to the first drawn, so idle copies share evenly):
        two random choices spread the load nearly as well as looking at all of them, and
        workers that each count only their own requests do not all rush the same copy."""
        up = [s for s in servers if s.up]
        if len(up) < 2:
            return up[0] if up else servers[0]
        first, second = random.sample(up, 2)
        return second if self.outstanding[second.name] < self.outstanding[first.name] else first

    def outstanding_by_model(self) -> dict[str, int]:
        """Requests sent to Triton and not answered, per model: what the control plane scales
        copies by (mmctl scale --replicas auto).  Read with each report, not per request."""
        by_model: collections.Counter[str] = collections.Counter()
        for (_server, model), n in self.queued.items():
            by_model[model] += n
        return dict(by_model)

    def expected_wait_s(self, server: str, model: str) -> tuple[float, int, float] | None:
        """(seconds a request sent now would wait before ``server`` starts it, requests
        queued there, the rate it answers them) for ``model``, from this process's own
        requests (its share of the queue over its share of the answers: the same ratio over
        all workers); None when it has answered too few lately to tell.  Little's law: the
        requests before it over the rate they leave."""
        queued = self.queued.get((server, model), 0)
        if queued == 0:
            return 0.0, 0, 0.0
        answered = self.answered_at.get((server, model))
        now = time.monotonic()
        while answered and answered[0] < now - RATE_WINDOW_S:
            answered.popleft()
        if not answered or len(answered) < RATE_MIN_ANSWERS:
            return None
        rate = len(answered) / max(now - answered[0], RATE_WINDOW_S / 4)
        return queued / rate, queued, rate

    def may_keep(self) -> bool:
        """Whether one more send may outlive its client's deadline (``keep``)."""
        return self.kept_past_deadline < MAX_KEPT_PAST_DEADLINE

    def keep(self, task: asyncio.Task) -> None:
        """``task`` (a send whose client stopped waiting) runs until Triton answers it."""
        if task.done():
            return
        self.kept_past_deadline += 1
        self.on_kept(self.kept_past_deadline)

        def done(task: asyncio.Task) -> None:
            self.kept_past_deadline -= 1
            self.on_kept(self.kept_past_deadline)
            if not task.cancelled():
                task.exception()  # retrieved: nobody waits for this answer any more
        task.add_done_callback(done)
