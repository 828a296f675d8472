"""Serving one request and sending it to Triton: route it and spend its limits, find the
server that holds the model (``router.serving.server_lookup``: the control plane loads it on
a miss), send, send once
more after an ensure when Triton unloaded the model in between or its server could not be
reached (the control plane places it on a server that is up), and record the outcome.

``Sender`` serves requests through the transport each gives it (``send``: an ``Exchange`` of
``router.serving.inference_pipeline``, over ``router.serving.triton_channels`` for gRPC).
Every retry of a request sent to Triton lives in ``Sender.send``, for gRPC and HTTP
alike: one deadline per request, bounded resends, and a wait
on a server cut short when the control plane declares that server down (``DownWatch``: a
frozen Triton neither answers nor refuses, so without it a request would wait out its
deadline)."""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import time
from collections.abc import Awaitable
from typing import TYPE_CHECKING

from domain import tracing
from domain.router_errors import (
    BackendUnavailable,
    RequestTimeout,
    RouterError,
    UnknownModel,
)
from domain.routes import Decision
from router.rollouts.routing_decisions import Decider
from router.serving.copy_queues import CopyQueues
from router.serving.down_watch import DownWatch, ServerDown
from router.serving.fair_shares import ShareGate
from router.serving.metrics import Recording, RouterMetrics
from router.serving.server_lookup import Call, ServerLookup, placed_name
from router.serving.serving_state import ServerAddress, ServingState
from router.serving.triton_channels import Channels

if TYPE_CHECKING:
    from router.serving.router_config import RouterConfig

log = logging.getLogger(__name__)

# Sends of one request that may each meet its model unloaded (then loaded again for it): the
# load held for it keeps the model for its next send, so more than one resend means an
# explicit unload or a restart in between.
MAX_RESENDS = 3
# A cancellation this close to the client's deadline is the deadline (gRPC read the time left
# a moment before the router set its own deadline from it).
DEADLINE_SLACK_S = 0.02
_NO_GATE = contextlib.nullcontext()  # a server without a concurrency: no fair-share turn


class Resend(enum.Enum):
    """Why a request is sent once more (``Sender.send``)."""

    UNLOADED = "unloaded"  # Triton no longer holds the model: loaded again, sent again
    UNREACHABLE = "unreachable"  # its server could not be reached, or was declared down


class Sender:
    """Serves requests: ``decider`` routes them and spends their limits, ``state`` says
    where their models are (and loads them), ``channels`` reach Triton, ``recording``
    counts each outcome; ``config`` bounds the waits."""

    def __init__(self, state: ServingState, decider: Decider, channels: Channels,
                 recording: Recording, metrics: RouterMetrics, config: RouterConfig):
        self.state = state
        self.decider = decider
        self.channels = channels
        self.recording = recording
        self.metrics = metrics
        self.config = config
        self.inflight = 0  # requests in serving(): shadows are shed first when it is high
        self.down_watch = DownWatch(lambda: self.state.servers())
        self.queues = CopyQueues(on_kept=metrics.past_deadline.set)  # requests on each copy, its rate
        self.lookup = ServerLookup(state, self.queues, metrics, config)
        # Turns on servers with a concurrency, by fair share (router.serving.fair_shares).
        self.shares = ShareGate(
            lambda server: self.state.concurrency(server),
            lambda model: self.state.share_weight(model),
            on_wait=lambda model, s: metrics.share_wait.labels(metrics.model_label(model)).observe(s),
            on_refused=lambda model: metrics.share_refused.labels(metrics.model_label(model)).inc())

    # ------------------------------------------------------------------ one request
    def serving(self, logical: str, user_id: str | None, version: str = "",
                timeout_s: float | None = None) -> _Serving:
        """``async with sender.serving(...) as call``: decide, rate-limit and find (or have
        loaded) the server for one request; record it when done.

        ``version``: the client's model version, already checked with ``parse_version``.
        ``timeout_s``: the client's deadline, when it gave one (a miss that cannot load in
        time is refused at once).  The body sets ``call.code`` to the outcome ("OK" or a
        status name).  A request that routing or its limits refuse is not recorded: it never
        became one."""
        return _Serving(self, logical, user_id, version, timeout_s)

    async def _begin(self, entry: _Serving) -> Call:
        """``serving``'s entry: the decision, its limits spent, the server found (on a hit
        without awaiting anything but the limiter); a failure once the request counts is
        recorded here (``_end``), as its exit would have."""
        start = time.perf_counter()
        decision = self.decider.route(entry.logical, entry.user_id, entry.version)
        admitting = self.decider.admit(decision)
        if admitting is not None:
            await admitting
        call = entry.call = Call(decision, start)
        if entry.timeout_s is not None:
            call.deadline = time.monotonic() + entry.timeout_s
        self.metrics.writes.started()
        self.inflight += 1
        try:
            placed = placed_name(decision)
            server = self.lookup.hit(placed, decision.logical, call)
            if server is None:
                server = await self.lookup.server_for(placed, decision.logical, call=call)
            call.server = server
            call.ready_at = time.perf_counter()
            self.state.touch(decision.model)
            if decision.adapter is not None:
                self.state.touch(placed)
        except BaseException as exc:
            # Names that turned out unknown get no series (label cardinality).
            self._end(call, exc, known=not isinstance(exc, UnknownModel))
            raise
        return call

    def _end(self, call: Call, exc: BaseException | None, known: bool = True) -> None:
        """``serving``'s exit: the outcome's code from ``exc`` (what ended the request; None:
        it was answered), the holds its ensures took ended, the request recorded."""
        if exc is not None:
            if isinstance(exc, RouterError):
                call.code = exc.grpc_code.name
            elif isinstance(exc, asyncio.CancelledError):  # the client went away or its deadline passed
                # gRPC cancels the call at the client's deadline, usually a moment before the
                # router's own timer says DEADLINE_EXCEEDED: once the model had the request,
                # that is the model not answering in time (a canary or experiment judges it),
                # not the client going away.
                late = (call.deadline is not None and call.ready_at is not None
                        and time.monotonic() >= call.deadline - DEADLINE_SLACK_S)
                call.code = "DEADLINE_EXCEEDED" if late else "CANCELLED"
            elif call.code == "OK":
                call.code = "INTERNAL"
        decision = call.decision
        if call.holds:  # answered (or given up): the model need not be held for it now
            self.state.requests_answered(placed_name(decision), call.holds)
        self.metrics.writes.ended()
        self.inflight -= 1
        end = time.perf_counter()
        self.recording.record(decision, end - call.start, call.code, known=known,
                              served_s=None if call.ready_at is None else end - call.ready_at)

    async def send(self, call: Call, exchange, message, timeout_s: float | None, asked: str):
        """``exchange.attempt(server, message, left_s)`` on the call's server, sent once more
        where ``exchange.resend_for`` says; ``exchange`` is the transport
        (``router.serving.inference_pipeline.Exchange``).  Raises RouterError: the transport's
        failures as ``exchange.failure`` words them, about ``asked``, the name the client used.

        The resend rule of every transport: one deadline for the request and all its sends
        (``timeout_s``: the client's, else ``config.request_timeout_s``); at most MAX_RESENDS
        resends.  A model unloaded under the request is loaded again; a server that could not
        be reached, or that the control plane declared down while the request waited on it
        (``DownWatch``), has the control plane place the model on a server that is up (at
        once, not when the server is declared lost).  When no resend is left, or there is
        nowhere else to send, the last answer is returned or its exception raised (Triton's
        own UNAVAILABLE, say).  One coroutine, not one per rule: each level of awaiting is
        paid twice per request, on the way to Triton and back."""
        try:
            server = call.server
            deadline = time.monotonic() + (timeout_s or self.config.request_timeout_s)
            resends = 0
            queues = self.queues
            while True:
                try:
                    left_s = max(0.001, deadline - time.monotonic())
                    pair = (server.name, call.decision.model)
                    queues.count_in(pair)  # at once: the deadline check of the next request sees it
                    gated = self.state.concurrency(server.name) is not None
                    if timeout_s is None or not queues.may_keep():
                        try:
                            if not gated and not tracing.enabled():
                                # No turn to take and no span to open (most sends): the send alone.
                                outcome = await self.down_watch.wait(
                                    server, exchange.attempt(server, message, left_s))
                                queues.answered(pair)
                            else:
                                outcome = await self._send_once(call, server, exchange, message, gated,
                                                                deadline, left_s, resends, pair)
                        finally:
                            queues.count_out(pair)
                    else:  # the client's deadline ends the wait, not the send (``_within_deadline``)
                        sending = asyncio.ensure_future(self._send_once(
                            call, server, exchange, message, gated, deadline,
                            max(left_s, self.config.request_timeout_s), resends, pair))
                        sending.add_done_callback(lambda _task, pair=pair: queues.count_out(pair))
                        outcome = await self._within_deadline(sending, left_s, timeout_s,
                                                              call.decision.logical)
                    why = exchange.resend_for(outcome)
                except ServerDown as exc:
                    outcome, why = exc, Resend.UNREACHABLE
                except RouterError:
                    raise
                except Exception as exc:
                    why = exchange.resend_for(exc)
                    if why is None:
                        raise
                    outcome = exc
                if why is None:
                    return outcome
                if resends >= MAX_RESENDS or time.monotonic() >= deadline:
                    return _last(outcome)
                resends += 1
                if why is Resend.UNLOADED:
                    server = await self.resend_after_unload(call)
                    continue
                try:
                    server = await self.resend_after_unavailable(call, server)
                except BackendUnavailable:
                    return _last(outcome)  # nowhere else to serve it
        except RouterError:
            raise
        except Exception as exc:
            error = exchange.failure(call, exc, asked)
            if error is None:
                raise
            raise error from exc

    async def _send_once(self, call: Call, server: ServerAddress, exchange, message, gated: bool,
                         deadline: float, upstream_s: float, resends: int, pair: tuple[str, str]):
        """One send of ``call`` to ``server`` after its fair-share turn there when ``gated``
        (the server has a concurrency; the turn ends with the client's ``deadline``) and in a
        span when tracing, given ``upstream_s`` to answer; an answer counts in the rate the
        server answers the model at.  ``pair``: (server name, model)."""
        gate = (self.shares.turn(server.name, pair[1], deadline, call.decision.logical)
                if gated else _NO_GATE)
        async with gate:
            with tracing.span("triton.infer", tracing.SpanKind.CLIENT,
                              server=server.name, resend=resends or None):
                outcome = await self.down_watch.wait(server, exchange.attempt(server, message,
                                                                              upstream_s))
        self.queues.answered(pair)
        return outcome

    async def _within_deadline(self, sending: asyncio.Task, left_s: float, timeout_s: float,
                               asked: str):
        """``sending``'s outcome if it comes within ``left_s`` (of the client's ``timeout_s``).
        When the client's deadline passes first (or the client goes away), the send goes on
        without it: Triton runs the request all the same, and until it does, the request
        takes a place in its copy's queue that the deadline check of the requests after it
        must see.  Forgotten at the deadline, a copy that fell behind looked idle to the
        router (every request timed out, none was answered to learn a rate from): it refused
        nothing and sent every request to wait past its deadline, as long as the flood lasted."""
        try:
            return await asyncio.wait_for(asyncio.shield(sending), left_s)
        except TimeoutError:
            self.queues.keep(sending)
            raise RequestTimeout(f"'{asked}' was not answered within the request's deadline of "
                                 f"{timeout_s * 1000:.0f} ms") from None
        except asyncio.CancelledError:
            self.queues.keep(sending)
            raise

    async def resend_after_unload(self, call: Call) -> ServerAddress:
        """Triton no longer holds the model the request was sent to (evicted in between):
        have it loaded again and return where; the caller sends once more."""
        call.server = await self.lookup.server_for(placed_name(call.decision), call.decision.logical,
                                            fresh=True, call=call)
        call.ready_at = time.perf_counter()
        return call.server

    async def resend_after_unavailable(self, call: Call, server: ServerAddress) -> ServerAddress:
        """``server`` could not be reached for the request: the control plane checks it and,
        when it is down, places the model on a server that is up; returns where to send
        once more (``server`` again when it was alive after all)."""
        call.server = await self.lookup.server_for(placed_name(call.decision), call.decision.logical,
                                            fresh=True, unreachable=server.name, call=call)
        call.ready_at = time.perf_counter()
        return call.server

    async def send_shadow(self, model: str, request: bytes, timeout_s: float) -> bytes:
        """A shadow's copy of a request (``router.rollouts.shadow``): no resend, no record.
        Its miss holds the shadow model like a client's, until it is answered (unmatched,
        the hold kept the model until the control plane's own timeout)."""
        call = Call(Decision(model, model, "shadow"), time.perf_counter())
        try:
            server = await self.lookup.server_for(model, call=call)
            return await self.channels.raw_infer(server)(request, timeout=timeout_s)
        finally:
            if call.holds:
                self.state.requests_answered(model, call.holds)


class _Serving:
    """``Sender.serving``'s ``async with``: ``Sender._begin`` on entry, ``Sender._end`` on
    exit.  A class, not ``contextlib.asynccontextmanager``: that one's async generator and
    its protocol (a wrapper object, ``anext``/``athrow`` and their StopAsyncIteration) cost
    more per request than the lookups of a hit."""

    __slots__ = ("call", "logical", "sender", "timeout_s", "user_id", "version")

    def __init__(self, sender: Sender, logical: str, user_id: str | None, version: str,
                 timeout_s: float | None):
        self.sender = sender
        self.logical = logical
        self.user_id = user_id
        self.version = version
        self.timeout_s = timeout_s
        self.call: Call | None = None

    def __aenter__(self) -> Awaitable[Call]:
        return self.sender._begin(self)  # a coroutine of its own: not wrapped in another

    async def __aexit__(self, exc_type, exc, tb) -> bool:
        self.sender._end(self.call, exc)
        return False  # an exception goes on to the caller


def _last(outcome):
    """The answer a request ends with when it is not sent again: returned, or raised."""
    if isinstance(outcome, BaseException):
        raise outcome
    return outcome
