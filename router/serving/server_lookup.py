"""Where one request is served: the server that holds its model READY (the least loaded
of its copies), or, on a miss, the one the control plane loads it on, within the request's
deadline and the client's miss budget.  ``router.serving.ensure_and_resend.Sender`` asks
here before each send and after Triton said the model is gone or its server was out of
reach."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from domain import errors as cp
from domain import tracing
from domain.errors import ControlPlaneError
from domain.router_errors import (
    BackendUnavailable,
    DeadlineTooShort,
    RequestTimeout,
    RouterError,
    UnknownModel,
    from_control_plane,
)
from domain.routes import ADAPTER_SEPARATOR, Decision
from router.serving.copy_queues import CopyQueues
from router.serving.metrics import RouterMetrics
from router.serving.miss_budget import MissBudget
from router.serving.serving_state import ServerAddress, ServingState

if TYPE_CHECKING:
    from router.serving.router_config import RouterConfig

log = logging.getLogger(__name__)

QUEUE_MARGIN = 0.8  # a request is sent when its expected wait and turn fit 80% of its time left


def placed_name(decision: Decision) -> str:
    """What the control plane places for a request: its model, or for a LoRA adapter the
    entry ``BASE:ADAPTER`` (the adapter in a slot of its base)."""
    if decision.adapter is None:
        return decision.model
    return f"{decision.model}{ADAPTER_SEPARATOR}{decision.adapter}"


@dataclass(slots=True)
class Call:
    decision: Decision
    start: float
    server: ServerAddress | None = None
    code: str = "OK"
    ready_at: float | None = None  # perf_counter when the model was ready (after any load)
    holds: int = 0  # ensures made for this request: the model is held until it is answered
    deadline: float | None = None  # time.monotonic() when the client stops waiting, if it said


class ServerLookup:
    """``state`` says where models are and loads them; ``queues`` hold the requests on each
    copy and the rate it answers at; ``config`` bounds the wait for a load."""

    def __init__(self, state: ServingState, queues: CopyQueues, metrics: RouterMetrics,
                 config: RouterConfig):
        self.state = state
        self.queues = queues
        self.metrics = metrics
        self.config = config
        self.miss_budget = MissBudget(config.miss_budget,
                                      on_refused=metrics.miss_budget_refused.inc)
        self._prefetching: set[asyncio.Task] = set()  # loads started for refused requests

    async def server_for(self, model: str, asked: str | None = None, fresh: bool = False,
                         unreachable: str | None = None, call: Call | None = None) -> ServerAddress:
        """The server with ``model`` READY; waits (bounded) for a load on a miss.

        ``fresh``: ask the control plane even if this process believes the model loaded
        (Triton just said it is not).  ``unreachable``: the server this request could not
        reach.  A model on a server the control plane reports down is a miss too: the
        control plane places it on one that is up.  Errors name ``asked``, the model as the
        client knows it.  ``call``: the request the model is ensured for; it counts the hold
        (``Call.holds``) that ``serving`` ends once the request is answered."""
        if not fresh:
            server = self.state.ready_server(model)
            if server is not None:
                if server.up:
                    return self._serve_on(server, model, asked, call)
                unreachable = server.name
        return await self._ensured(model, asked or model, fresh, unreachable, call)

    def hit(self, model: str, asked: str, call: Call) -> ServerAddress | None:
        """``server_for`` of a model this process believes READY on a server that is up,
        without a coroutine (the common case: ``serving`` awaits ``server_for`` only when this
        is None)."""
        server = self.state.ready_server(model)
        if server is None or not server.up:
            return None
        return self._serve_on(server, model, asked, call)

    def _serve_on(self, server: ServerAddress, model: str, asked: str | None,
                  call: Call | None) -> ServerAddress:
        """Of ``model``'s READY copies (``server`` and any others), the one to send to;
        refuses a request that could not start there before its deadline."""
        copies = self.state.copy_servers(model)
        if copies:
            server = self.queues.least_loaded([server, *copies])
        if call is not None and call.deadline is not None:
            self._refuse_queued_past_deadline(server, model, asked or model, call.deadline)
        return server

    async def _ensured(self, model: str, asked: str, fresh: bool, unreachable: str | None,
                       call: Call | None) -> ServerAddress:
        """``server_for`` on a miss: the control plane loads ``model`` (or places it on a
        server that is up), within the request's deadline and the client's miss budget."""
        if not fresh and unreachable is None:  # the client's own miss, not one of our resends
            self.miss_budget.spend(asked)
        if call is not None and call.deadline is not None and unreachable is None:
            self._refuse_past_deadline(model, asked, call.deadline)
        start = time.perf_counter()
        counted = False
        try:
            ensuring = (self.state.ensure(model) if unreachable is None
                        else self.state.ensure(model, unreachable=unreachable))
            with tracing.span("ensure", tracing.SpanKind.CLIENT, model=model, unreachable=unreachable):
                server = await asyncio.wait_for(ensuring, self.config.load_timeout_s)
            counted = True
            if call is not None:
                call.holds += 1
        except RouterError:
            counted = True
            raise
        except TimeoutError:
            counted = True
            raise RequestTimeout(f"'{asked}' did not finish loading within {self.config.load_timeout_s:.0f}s; "
                                 "the load goes on, retry shortly") from None
        except ControlPlaneError as exc:
            counted = not isinstance(exc, cp.ModelNotFound)
            raise self.serving_error(exc, asked) from exc
        finally:
            if counted:  # unknown names get no series of their own (label cardinality)
                series_model = self.metrics.model_label(model)
                self.metrics.cold_waits.labels(series_model).inc()
                self.metrics.cold_wait_seconds.labels(series_model).observe(time.perf_counter() - start)
        return server

    def _refuse_queued_past_deadline(self, server: ServerAddress, model: str, asked: str,
                                     deadline: float) -> None:
        """A request that could not even start before its deadline (the requests queued
        before it on its copy take longer to answer than the time it has left) is refused
        now: sent, it would only take a turn from requests that can still be answered in
        time, and its client would hear of it only at the deadline."""
        expected = self.queues.expected_wait_s(server.name, model)
        left_s = deadline - time.monotonic()
        if expected is None or expected[0] == 0.0:
            return
        wait_s, queued, rate = expected
        # Its own turn too, and a margin: the wait is a mean, answers come unevenly, and a
        # request admitted to miss its deadline by a little costs a turn all the same.
        if (queued + 1) / rate <= left_s * QUEUE_MARGIN:
            return
        self.metrics.deadline_refused.labels("queue").inc()
        raise DeadlineTooShort(
            f"'{asked}' cannot start within this request's deadline: {queued} requests wait for "
            f"it on {server.name}, which answers about {rate:.0f} per second, about "
            f"{wait_s * 1000:.0f} ms, longer than the {max(0.0, left_s) * 1000:.0f} ms left; "
            f"retry in {wait_s:.1f} s, or with a longer deadline", wait_s)

    def _refuse_past_deadline(self, model: str, asked: str, deadline: float) -> None:
        """A miss whose load would outlast the request's deadline (its last load took
        longer than the time left) is refused now, with why, and the load is started so that
        a retry finds the model: waiting would only end in the client's own timeout."""
        expected_s = self.state.expected_miss_s(model)
        left_s = deadline - time.monotonic()
        if expected_s is None or expected_s <= left_s:
            return
        self.metrics.deadline_refused.labels("load").inc()
        self._prefetch(model)
        raise DeadlineTooShort(
            f"'{asked}' is not loaded and its load takes about {expected_s:.2f} s (its last one), "
            f"longer than the {max(0.0, left_s):.3f} s left of this request's deadline; its load "
            f"has started: retry in {expected_s:.1f} s, or with a longer deadline", expected_s)

    def _prefetch(self, model: str) -> None:
        """Have ``model`` loaded for the next request, holding it no longer than the load."""
        async def load() -> None:
            try:
                await asyncio.wait_for(self.state.ensure(model), self.config.load_timeout_s)
            except (ControlPlaneError, RouterError, TimeoutError) as exc:
                log.info("loading %s after a request whose deadline was too short: %s", model, exc)
                return
            self.state.requests_answered(model, 1)  # no request waits on this hold

        task = asyncio.get_running_loop().create_task(load())
        self._prefetching.add(task)
        task.add_done_callback(self._prefetching.discard)

    @staticmethod
    def serving_error(exc: ControlPlaneError, asked: str) -> RouterError:
        """A control-plane failure met while serving ``asked``, as the client should see it.

        Triton answers a model that is not in its repository "unknown model" and one whose
        load failed "has no available versions"; the router does the same.  The reason of a
        failed load is the operator's (``mmctl health``), and a full fleet is not explained
        to clients with the names of other models."""
        if isinstance(exc, cp.ModelNotFound):
            return UnknownModel(asked)
        if isinstance(exc, cp.ModelLoadFailed):
            return UnknownModel(asked, no_versions=True)
        if isinstance(exc, cp.CapacityExhausted):
            return BackendUnavailable(f"'{asked}' cannot be loaded now: the servers have no room "
                                      "for it; retry later")
        if isinstance(exc, cp.TritonUnavailable):
            # Which server is down and where it listens is the operator's (the log, `mmctl
            # health`), not a client's.
            log.warning("no server is up for %s: %s", asked, exc.message)
            return BackendUnavailable(f"the server of '{asked}' is unavailable; the control "
                                      "plane is bringing it back: retry shortly")
        return from_control_plane(exc)
