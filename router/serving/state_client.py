"""A router worker's read-only view of the control plane (``control_plane.admin.dataplane``).

* a versioned snapshot, kept current by a long-poll watch; when the control plane is away
  the worker serves from its last snapshot;
* a miss is one ``ensure`` call, shared by every request waiting for that model;
* per-model use and per-variant outcomes go back in batches (the control plane's eviction
  policy and canary judgements use every worker's traffic);
* rate-limit tokens come from the control plane's global buckets in small batches
  (``router.serving.granted_limits``); without the control plane each worker keeps its
  share locally.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import time
from collections.abc import Callable

import aiohttp

from domain import tracing
from domain.errors import ERRORS_BY_CODE, ControlPlaneError
from domain.router_errors import BackendUnavailable
from router.serving.published_view import PublishedView
from router.serving.serving_state import ServerAddress

log = logging.getLogger(__name__)

WATCH_WAIT_S = 20.0
REPORT_INTERVAL_S = 0.25
MAX_PENDING_SAMPLES = 100_000  # kept while the control plane is away; the oldest go first
RETRY_MIN_S, RETRY_MAX_S = 0.1, 2.0


# Longest pause between asks for a miss while the control plane is away: a restarted one
# answers within a second or two of being up.
ENSURE_RETRY_MAX_S = 1.0
# Holds whose requests have their answers are told to the control plane with the next
# ensure call, or on their own after this long when no ensure goes (a stream of misses
# then costs one call per miss, not two).  Meanwhile the model is no eviction victim.
ANSWERED_DELAY_S = 0.01
MAX_ANSWERED_WITH_ENSURE = 256  # models per ensure call (the control plane's bound)


class ControlPlaneAway(Exception):
    """The control plane did not answer (restarting, or down)."""


def _count_uses(uses: collections.Counter[str], model: str, count: int) -> None:
    """Count ``model``'s uses and move it last: a report lists the models in the order of
    their last use, the most recent last, and the control plane's least-recently-used order
    takes them in that order (counted in the order of first use, a model used at the start
    and at the end of a report's interval would rank older than one used once between)."""
    uses[model] = uses.pop(model, 0) + count


class RemoteState(PublishedView):
    """``router.serving.serving_state.ServingState`` from the control plane at ``control_url``.

    ``control_url`` may list several control planes, comma-separated (a leader and its
    standbys): a worker talks to one, and moves to the next when it does not answer or
    answers that it is a standby.
    """

    def __init__(self, control_url: str, token: str, worker: str, request_timeout_s: float = 130.0,
                 on_snapshot: Callable[[], None] = lambda: None,
                 outstanding: Callable[[], dict[str, int]] = dict,
                 shadow_counts: Callable[[], dict] = dict, loop_failures=None):
        super().__init__(on_snapshot)
        self.control_urls = [u.strip().rstrip("/") for u in control_url.split(",") if u.strip()]
        if not self.control_urls:
            raise ValueError("no control-plane URL given")
        self.control_url = self.control_urls[0]
        self.headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
        self.worker = worker
        self.pid = os.getpid()
        self.request_timeout_s = request_timeout_s
        self.session: aiohttp.ClientSession | None = None
        self.shadow_counts = shadow_counts  # () -> route -> cumulative ShadowReport counts
        # () -> model -> requests sent to Triton and not answered now (the worker's sender
        # counts them): the control plane scales copies by it (mmctl scale auto).
        self.outstanding = outstanding
        self._reported_outstanding: dict[str, int] = {}
        self._ensures: dict[tuple[str, str | None], asyncio.Task] = {}  # (model, unreachable)
        # Holds the control plane keeps for this worker's ensures, and the requests served
        # from them that are not answered yet: when none is left, the holds end
        # (``requests_answered``).  Concurrent misses share one ensure, so one hold.
        self._ensured_holds: collections.Counter[str] = collections.Counter()
        self._awaiting_answer: collections.Counter[str] = collections.Counter()
        # Holds to end, not yet told (ANSWERED_DELAY_S), and the call that tells them.
        self._answered_due: collections.Counter[str] = collections.Counter()
        self._answered_timer: asyncio.TimerHandle | None = None
        self._notices: set[asyncio.Task] = set()
        # The router's mmr_loop_failures_total: a failing watch or report pass is counted,
        # and the loop goes on.
        self.loop_failures = loop_failures
        self._uses: collections.Counter[str] = collections.Counter()
        self._requests = 0
        self._samples: collections.deque = collections.deque(maxlen=MAX_PENDING_SAMPLES)
        # The control plane's latest ask for a report now, and one report at a time: an
        # answer to an ask must not overtake a periodic report already on its way.
        self._report_asked = 0
        self._report_lock = asyncio.Lock()
        self._tasks: list[asyncio.Task] = []

    # ------------------------------------------------------------------ life
    async def start(self, first_snapshot_timeout_s: float = 300.0) -> None:
        self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None))
        deadline = time.monotonic() + first_snapshot_timeout_s
        delay = RETRY_MIN_S
        while True:
            try:
                await self._poll(wait_s=0)
                break
            except ControlPlaneAway as exc:
                if time.monotonic() > deadline:
                    raise
                log.info("waiting for the control plane at %s (%s)", self.control_url, exc)
                await asyncio.sleep(delay)
                delay = min(delay * 2, RETRY_MAX_S)
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._watch()), loop.create_task(self._report_loop())]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        self._tell_answered_now()
        if self._notices:
            await asyncio.wait(set(self._notices), timeout=2.0)
        try:
            await asyncio.wait_for(self._send_report(), 2.0)
        except (ControlPlaneAway, TimeoutError):
            pass
        if self.session is not None:
            await self.session.close()

    # ------------------------------------------------------------------ calls
    def _next_control_plane(self) -> None:
        if len(self.control_urls) > 1:
            i = self.control_urls.index(self.control_url)
            self.control_url = self.control_urls[(i + 1) % len(self.control_urls)]

    async def _call(self, method: str, path: str, body: dict | None = None, params: dict | None = None,
                    timeout_s: float = 10.0, accept: tuple[int, ...] = ()) -> dict:
        url = self.control_url
        try:
            async with self.session.request(method, url + path, json=body, params=params,
                                            headers=tracing.inject(dict(self.headers))
                                            if tracing.enabled() else self.headers,
                                            timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
                data = await resp.json(content_type=None)
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            self._next_control_plane()
            raise ControlPlaneAway(f"{url}: {type(exc).__name__}: {exc}") from None
        if resp.status == 503 and isinstance(data, dict) and data.get("error") == "standby":
            self._next_control_plane()
            raise ControlPlaneAway(f"{url} is a standby ({data.get('message')})")
        if resp.status >= 400 and resp.status not in accept:
            cls = ERRORS_BY_CODE.get(data.get("error") if isinstance(data, dict) else None, ControlPlaneError)
            raise cls(data.get("message", f"control plane answered {resp.status}")
                      if isinstance(data, dict) else str(data))
        return data

    async def _poll(self, wait_s: float) -> None:
        data = await self._call("GET", "/v1/dataplane/snapshot", params={
            "since": str(self.version), "epoch": self.epoch, "worker": self.worker,
            "pid": str(self.pid), "wait": str(wait_s), "reported": str(self._report_asked)},
            timeout_s=wait_s + 10.0)
        if data.get("unchanged"):
            asked = int(data.get("report_call") or 0)
            if asked > self._report_asked:  # statistics are being read: report at once
                self._report_asked = asked
                self._spawn(self._answer_report_call(asked))
            return
        if data.get("epoch") != self.epoch:
            self._report_asked = 0  # a new control-plane life counts its asks from 0
        self.apply(data)

    async def _watch(self) -> None:
        delay = RETRY_MIN_S
        while True:
            try:
                await self._poll(WATCH_WAIT_S)
                delay = RETRY_MIN_S
            except ControlPlaneAway as exc:
                log.warning("control plane not answering (%s); serving from snapshot %d", exc, self.version)
                await asyncio.sleep(delay)
                delay = min(delay * 2, RETRY_MAX_S)
            except Exception:  # a bad snapshot must not stop the watch
                log.exception("applying a snapshot failed")
                self._count_loop_failure("watch")
                await asyncio.sleep(RETRY_MAX_S)

    def _count_loop_failure(self, loop: str) -> None:
        if self.loop_failures is not None:
            self.loop_failures.labels(loop).inc()

    # ------------------------------------------------------------------ ServingState
    async def ensure(self, model: str, unreachable: str | None = None) -> ServerAddress:
        # Requests that could not reach the model's server do not share a plain miss's
        # answer: it may name that server again.
        key = (model, unreachable)
        task = self._ensures.get(key)
        if task is None:
            task = self._ensures[key] = asyncio.get_running_loop().create_task(
                self._ensure(model, unreachable))
            task.add_done_callback(lambda _t: self._ensures.pop(key, None))
        address = await asyncio.shield(task)
        self._awaiting_answer[model] += 1
        return address

    def requests_answered(self, model: str, ensures: int) -> None:
        self._awaiting_answer[model] -= ensures
        if self._awaiting_answer[model] > 0:
            return
        del self._awaiting_answer[model]
        holds = self._ensured_holds.pop(model, 0)
        if not holds:
            return
        if not self.sections.get("meta", {}).get("answered_with_ensure"):
            # A control plane of an earlier version reads no "answered" in an ensure.
            self._spawn(self._tell_answered(model, holds))
            return
        self._answered_due[model] += holds
        if self._answered_timer is None:
            self._answered_timer = asyncio.get_running_loop().call_later(
                ANSWERED_DELAY_S, self._tell_answered_now)

    def _take_answered(self) -> dict[str, int]:
        """The holds due to end, for an ensure call to carry (at most
        ``MAX_ANSWERED_WITH_ENSURE`` models; the rest wait for the next call or the timer)."""
        taken = dict(self._answered_due.most_common(MAX_ANSWERED_WITH_ENSURE))
        for model in taken:
            del self._answered_due[model]
        if not self._answered_due and self._answered_timer is not None:
            self._answered_timer.cancel()
            self._answered_timer = None
        return taken

    def _tell_answered_now(self) -> None:
        self._answered_timer = None
        due, self._answered_due = self._answered_due, collections.Counter()
        for model, holds in due.items():
            self._spawn(self._tell_answered(model, holds))

    def _spawn(self, call) -> None:
        """Run a one-off call to the control plane beside the serving; kept until done."""
        task = asyncio.get_running_loop().create_task(call)
        self._notices.add(task)
        task.add_done_callback(self._notices.discard)

    async def _tell_answered(self, model: str, holds: int) -> None:
        try:
            await self._call("POST", "/v1/dataplane/answered",
                             {"model": model, "count": holds, "worker": self.worker},
                             timeout_s=5.0)
        except (ControlPlaneAway, ControlPlaneError) as exc:  # the hold ends on its own
            log.debug("could not end the hold of %s: %s", model, exc)

    async def _ensure(self, model: str, unreachable: str | None = None) -> ServerAddress:
        # A control plane that is away (restarting under the supervisor, or a standby taking
        # over) is waited for: the miss is asked again, of the next control plane too, until
        # the request's own wait for its load (the router's load timeout) runs out.
        deadline = time.monotonic() + self.request_timeout_s
        delay = RETRY_MIN_S
        while True:
            # The changes since our version come with the answer (the models this load
            # evicted among them), before the long-poll brings them.
            body = {"model": model, "worker": self.worker}
            if self.version >= 0:
                body.update(since=self.version, epoch=self.epoch)
            if unreachable is not None:
                body["unreachable"] = unreachable
            answered = self._take_answered()
            if answered:
                # Ended before this ensure is served.  Not sent again should the call fail:
                # the control plane may have ended them, and a second time would end holds
                # of later ensures; unheard, they end on their own (on_its_way_s).
                body["answered"] = answered
            # The requests served since the last report or ensure, taken into the policy's
            # order before this miss picks its victim there (reports come every 0.25 s).
            # (A control plane of an earlier version reads no "uses" in an ensure.)
            uses = self._take_uses() if self.sections.get("meta", {}).get("uses_with_ensure") else {}
            if uses:
                body["uses"] = uses
            try:
                data = await self._call("POST", "/v1/dataplane/ensure", body,
                                        timeout_s=max(1.0, deadline - time.monotonic()))
                break
            except ControlPlaneAway as exc:
                self._keep_unsent_uses(uses)
                if time.monotonic() + delay >= deadline:
                    raise BackendUnavailable(
                        f"'{model}' is not loaded and the control plane has not answered for "
                        f"{self.request_timeout_s:.0f}s; retry later") from None
                log.info("ensure of %s: control plane away (%s); asking again in %.1fs", model,
                         exc, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, ENSURE_RETRY_MAX_S)
        if "state" in data:
            self.apply(data["state"])
        address = ServerAddress(data["server"], data["grpc_url"], data["http_url"], data["up"])
        self._ensured_holds[model] += 1
        self.addresses[address.name] = address  # its "up" is newer than the snapshot's
        self.placement[model] = address.name  # until the control plane says otherwise
        return address

    def touch(self, model: str) -> None:
        _count_uses(self._uses, model, 1)
        self._requests += 1

    def _take_uses(self) -> dict[str, int]:
        """The uses counted since they were last sent (a report or an ensure carries them)."""
        uses = dict(self._uses)
        self._uses.clear()
        return uses

    def _keep_unsent_uses(self, uses: dict[str, int]) -> None:
        """Uses a failed call did not deliver go back, before those counted since."""
        newer, self._uses = self._uses, collections.Counter(uses)
        for model, count in newer.items():
            _count_uses(self._uses, model, count)

    async def health(self, model: str) -> dict:
        try:
            return await self._call("GET", f"/health/{model}", accept=(503,))
        except ControlPlaneAway:
            raise BackendUnavailable("the control plane is not answering (restarting?); retry shortly") from None

    async def grant(self, name: str, want: int) -> tuple[int, float]:
        data = await self._call("POST", "/v1/dataplane/tokens", {
            "worker": self.worker, "pid": self.pid, "name": name, "want": want}, timeout_s=2.0)
        return int(data["granted"]), float(data["retry_after_s"])

    # ------------------------------------------------------------------ reports
    def record_outcome(self, scope: str, variant: str, code: str, served_ms: float | None,
                       randomly_assigned: bool = False) -> None:
        """The OutcomeSink surface (``router.serving.outcomes``): outcomes are judged by the
        control plane, over every worker."""
        self._samples.append((scope, variant, code, served_ms, randomly_assigned))

    async def _report_loop(self) -> None:
        while True:
            await asyncio.sleep(REPORT_INTERVAL_S)
            try:
                await self._send_report()
            except ControlPlaneAway:
                pass  # kept (bounded) for the next report
            except Exception:
                log.exception("reporting to the control plane failed")
                self._count_loop_failure("report")

    async def _answer_report_call(self, call: int) -> None:
        try:
            await self._send_report(call)
        except ControlPlaneAway:
            pass  # kept for the next report; the reader's wait ends at its timeout
        except Exception:
            log.exception("answering the control plane's ask for a report failed")
            self._count_loop_failure("report")

    async def _send_report(self, report_call: int = 0) -> None:
        """Send what was counted since the last report.  ``report_call``: the control
        plane's ask this answers, sent even when there is nothing new."""
        async with self._report_lock:
            shadow = self.shadow_counts()
            outstanding = {model: n for model, n in self.outstanding().items() if n > 0}
            if not (self._uses or self._samples or self._requests or shadow or report_call
                    or outstanding != self._reported_outstanding):
                return
            self._reported_outstanding = outstanding
            uses, requests, samples = self._take_uses(), self._requests, list(self._samples)
            self._samples.clear()
            self._requests = 0
            try:
                await self._call("POST", "/v1/dataplane/report", {
                    "worker": self.worker, "pid": self.pid, "uses": uses, "requests": requests,
                    "samples": samples, "shadow": shadow, "report_call": report_call,
                    "outstanding": outstanding})
            except ControlPlaneAway:
                self._keep_unsent_uses(uses)
                self._requests += requests
                self._samples.extendleft(reversed(samples))
                raise
