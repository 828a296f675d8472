"""The control plane's side of the router workers, as HTTP: a thin layer over the parts in
``control_plane.dataplane``.

Router workers are separate processes.  From here they get what they serve from (routes,
limits, experiments, canaries, public names, which server holds which model) as versioned
per-key changes through a long-poll watch (``dataplane.publisher``), send misses as one
``ensure`` call, take rate-limit tokens from global buckets in small batches
(``dataplane.rate_grants``), and report per-model use and per-variant outcomes in batches
(``dataplane.reports``); which of them are alive is ``dataplane.workers``.  Canary and
experiment decisions are made on the control plane, on the outcomes of every worker, by the
rollouts the hub is given (``control_plane.rollouts.owner``).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from functools import cached_property

from aiohttp import web

from control_plane.admin.api import json_body
from control_plane.dataplane.publisher import PublishedState, Publisher
from control_plane.dataplane.rate_grants import GlobalBuckets
from control_plane.dataplane.reports import (
    GATHER_TIMEOUT_S,
    ReportGathering,
    ShadowReports,
    parse_report,
    parse_uses,
    worker_of,
)
from control_plane.dataplane.workers import WorkerRegistry, WorkerSeen
from control_plane.rollouts.owner import CANARY_INTERVAL_S, Rollouts
from domain import tracing
from domain.errors import InvalidInput
from domain.periodic import run_periodically

# How often the servers, the worker count and the tables' generations are looked at (a
# model's placement is published as soon as its state changes).
PUBLISH_INTERVAL_S = 0.1
SETTLE_TIMEOUT_S = 2.0  # an admin change waits this long at most for workers to have it
MAX_WAIT_S = 30.0
# A worker's long-poll woken by a new version answers this much later, with what came
# meanwhile: a miss publishes twice within a millisecond or two (its victim leaving, then
# the newcomer ready), and each answer is an HTTP round trip for the worker and this process.
SNAPSHOT_LINGER_S = 0.003
MAX_ANSWERED_WITH_ENSURE = 256  # models whose holds one ensure call may end
# Changes an ensure's answer carries at most (a worker further behind catches up through its
# long-poll, as it would without them).
MAX_CHANGES_WITH_ENSURE = 512


def _no_use(_model: str) -> None:
    """Uses reported to a hub without a manager (canary judgement alone) count nowhere."""


class DataPlaneHub:
    """The parts, each with what it needs: ``publisher`` (what workers serve from),
    ``registry`` (which workers are alive), ``reports`` (what they report, and asking for
    it), ``buckets`` (global rate limits); the rollouts it serves and judges are given."""

    shadow_log_dir: str | None = None
    workers_expected = 0

    def __init__(self, manager, registry, store, expose_versions: bool = False,
                 shadow_log_dir: str | None = None, workers_expected: int = 1, families=None,
                 rollouts: Rollouts | None = None):
        """``rollouts``: the control plane's one owner of routes, statistics and canaries
        (None: the hub builds its own on ``registry`` and ``store``, for a hub alone)."""
        self.manager = manager
        self.families = families  # families.FamilyCatalog: variants re-addressed to their family
        self.rollouts = rollouts or Rollouts(registry, store, expose_versions=expose_versions)
        self.stats = self.rollouts.stats
        self.shadow_log_dir = shadow_log_dir
        self.workers_expected = workers_expected
        self.registry = WorkerRegistry(workers_expected)
        self.workers = self.registry.workers
        self.reports = ReportGathering(
            self.registry, _no_use if manager is None else lambda model: manager.touch(model),
            self.stats.record_outcome, shadow_log_dir)
        self.buckets = GlobalBuckets()
        # Versions restart with each control-plane life (a new epoch).
        self.publisher = Publisher(uuid.uuid4().hex, manager, self.rollouts, families,
                                   workers=self._workers_to_expect, on_version=self._wake)
        self.publisher.failed = self._count_publish_failure
        self.rollouts.on_judged(self.publisher.routes_judged)
        self._tasks: list[asyncio.Task] = []
        self.closing = False  # set on stop: long-polls answer at once instead of holding it up
        self._settling = 0  # admin changes waiting for every worker to have their version

    # A hub assembled from its collaborators alone (``workers``, ``stats``, ``manager``; a
    # report handler tested by itself) builds these two from them on first use.
    @cached_property
    def registry(self) -> WorkerRegistry:
        return WorkerRegistry(self.workers_expected, self.workers)

    @cached_property
    def reports(self) -> ReportGathering:
        return ReportGathering(self.registry, self.manager.touch, self.stats.record_outcome,
                               self.shadow_log_dir)

    def _workers_to_expect(self) -> int:
        return max(self.workers_expected, len(self.registry.in_touch()))

    # The rollouts' and the publisher's state, under the names the admin routes read.
    @property
    def table(self):
        return self.rollouts.table

    @property
    def names(self):
        return self.rollouts.names

    @property
    def canaries(self):
        return self.rollouts.canaries

    @property
    def route_store(self):
        return self.rollouts.route_store

    @property
    def shadow(self) -> ShadowReports:
        return self.reports.shadow

    @property
    def published(self) -> PublishedState:
        return self.publisher.published

    @property
    def version(self) -> int:
        return self.published.version

    @property
    def epoch(self) -> str:
        return self.published.epoch

    @property
    def report_call(self) -> int:
        return self.reports.report_call

    def publish(self) -> int:
        """Publish what changed since the last publish; a new version when anything did."""
        return self.publisher.publish()

    def _wake(self) -> None:
        asyncio.get_running_loop().create_task(self.registry.notify())

    def _count_publish_failure(self) -> None:
        if self._loop_failures is not None:
            self._loop_failures.labels("publish").inc()

    async def settle(self, timeout_s: float = SETTLE_TIMEOUT_S) -> bool:
        """Publish now and wait until every worker in touch has this version: an admin change
        is served by every worker once the call that made it returns.  In touch, not only
        live: an idle worker waiting in its long-poll has not been seen for up to
        ``WATCH_WAIT_S`` and serves the next request all the same."""
        version = self.publish()

        def current() -> bool:
            return all(w.has(version, self.epoch) for w in self.registry.in_touch())

        self._settling += 1  # waited for: the workers' long-polls answer without lingering
        try:
            return await self.registry.wait_until(current, time.monotonic() + timeout_s)
        finally:
            self._settling -= 1

    async def gather_reports(self, timeout_s: float = GATHER_TIMEOUT_S) -> bool:
        """Every worker's report now (``ReportGathering.gather``)."""
        return await self.reports.gather(timeout_s)

    def worker_counts(self) -> tuple[int, int]:
        """(workers in touch now, workers expected): ``mms_router_workers_*``."""
        return self.registry.counts()

    # ------------------------------------------------------------------ loops
    async def start(self) -> None:
        """The publish loop, and the rollouts' judging: the hub is what judges the canaries
        when router workers serve."""
        self.publish()
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(run_periodically(
                           "publish", lambda: self.publish(), PUBLISH_INTERVAL_S,
                           self._loop_failures)),
                       self.rollouts.start_judging(CANARY_INTERVAL_S, self._loop_failures)]

    async def release_watchers(self) -> None:
        """Answer every long-poll now: a stopping control plane must not wait for them."""
        self.closing = True
        for task in self._tasks:
            task.cancel()
        await self.registry.notify()

    @property
    def _loop_failures(self):
        return None if self.manager is None else self.manager.metrics.loop_failures

    # ------------------------------------------------------------------ HTTP handlers
    async def snapshot(self, request: web.Request) -> web.Response:
        q = request.query
        try:
            since = int(q.get("since", "-1"))
            wait_s = min(max(float(q.get("wait", "0")), 0.0), MAX_WAIT_S)
            pid = int(q.get("pid", "0"))
            reported = int(q.get("reported", "0"))  # the latest ask for reports it answered
        except ValueError:
            raise InvalidInput("since, wait, pid and reported must be numbers") from None
        epoch = q.get("epoch", "")
        seen = self.registry.heard_from(q.get("worker", ""), pid)
        if epoch == self.epoch:
            if since > seen.version >= 0 and seen.epoch == epoch:
                # The worker applied the changes up to ``since``: how long they took to reach
                # it.  (Not its first version: that is the whole state, however old.)
                age_s = self.published.age_of(since)
                if age_s is not None and self.manager is not None:
                    self.manager.metrics.dataplane_propagation.observe(age_s)
            seen.version, seen.epoch = since, epoch
            await self.registry.notify()  # settle() waits for these acknowledgements
        current = epoch == self.epoch and since >= self.version
        if current and wait_s > 0 and not self.reports.asked_since(reported):
            await self._wait_for_news(seen, since, reported, wait_s)
        if epoch == self.epoch and since >= self.version:
            return web.json_response({"version": self.version, "epoch": self.epoch,
                                      "unchanged": True, "report_call": self.report_call})
        return web.Response(body=self.published.answer(since, epoch),
                            content_type="application/json")

    def _new_for(self, seen: WorkerSeen, since: int) -> bool:
        """Whether the published state has changes that the worker of ``seen`` lacks: past
        its long-poll's ``since``, and past what its ensures' answers brought it."""
        return self.version > max(since, seen.ensured_version)

    async def _wait_for_news(self, seen: WorkerSeen, since: int, reported: int, wait_s: float) -> None:
        """A long-poll's wait: until there is something new for the worker (``_new_for``), its
        reports are asked for, the hub closes, or ``wait_s`` passes.  A new version lingers
        ``SNAPSHOT_LINGER_S`` for what comes with it; when an ensure's answer brought the
        worker all of it meanwhile (a miss's changes come with its answer), the poll waits on
        instead of answering what the worker has: one HTTP answer less per miss for the
        worker and for this process."""
        def other_reason() -> bool:
            return self.closing or self.reports.asked_since(reported)

        deadline = time.monotonic() + wait_s
        while (left := deadline - time.monotonic()) > 0:
            await self.registry.watch(seen, lambda: self._new_for(seen, since) or other_reason(), left)
            if other_reason():
                return
            if not self._new_for(seen, since):
                continue  # brought by an ensure's answer meanwhile, or its time is up
            if self._settling:
                return  # waited for: answered at once
            await asyncio.sleep(SNAPSHOT_LINGER_S)
            if self._new_for(seen, since) or other_reason():
                return

    def _ensured(self, worker: str | None, since: int, epoch, state: dict | None) -> None:
        """What an ensure's answer brings its worker to (``WorkerSeen.ensured_version``): the
        version of the changes it carries; the worker's own ``since`` when it carries none
        (a worker behind the version an earlier answer brought it to did not apply it)."""
        seen = self.registry.workers.get(worker) if worker else None
        if seen is None:
            return
        if epoch != self.epoch:
            seen.ensured_version = -1
        elif state is not None:
            seen.ensured_version = state["version"]
        else:
            seen.ensured_version = min(seen.ensured_version, since)

    async def ensure(self, request: web.Request) -> web.Response:
        body = await json_body(request)
        owner = _worker_of(body)
        # Every field is checked before anything is applied: a malformed ensure ends no
        # hold and touches nothing.
        answered = body.get("answered")
        if answered is not None and (
                not isinstance(answered, dict) or len(answered) > MAX_ANSWERED_WITH_ENSURE
                or not all(isinstance(m, str) and m and type(c) is int and c >= 1
                           for m, c in answered.items())):
            raise InvalidInput(f"'answered' maps at most {MAX_ANSWERED_WITH_ENSURE} models "
                               "to the number of their ensures answered (whole numbers >= 1)")
        try:
            uses = parse_uses(body)
        except (TypeError, ValueError, AttributeError):
            raise InvalidInput("'uses' maps models to the requests served since the worker's "
                               "last report or ensure (whole numbers)") from None
        model = body.get("model")
        if not isinstance(model, str) or not model:
            raise InvalidInput("give the model to load as 'model'")
        unreachable = body.get("unreachable")
        if unreachable is not None and not isinstance(unreachable, str):
            raise InvalidInput("'unreachable' names the server a request could not reach")
        since = body.get("since")
        if since is not None and (type(since) is not int or since < 0):
            raise InvalidInput("'since' is the version of the state the worker serves from "
                               "(a whole number >= 0)")
        # Holds of this worker's earlier ensures whose requests have their answers
        # (router.serving.state_client), ended before this one is served.
        for name, count in (answered or {}).items():
            self.manager.requests_answered(name, count, owner=owner)
        # The worker's requests since its last report or ensure: the policy's order is
        # current when this miss picks its victim (a report comes every 0.25 s).
        self.reports.take_uses(uses)
        with tracing.span("ensure", tracing.SpanKind.SERVER, parent=request.headers, model=model):
            server = await self.manager.ensure_for_request(model, unreachable=unreachable, owner=owner)
        answer = {"model": model, "server": server.name, "grpc_url": server.spec.grpc_url,
                  "http_url": server.spec.http_url, "up": bool(server.up)}
        if since is not None:
            state = self._changes_for(since, body.get("epoch"))
            if state is not None:
                answer["state"] = state
            self._ensured(owner, since, body.get("epoch"), state)
        return web.json_response(answer)

    def _changes_for(self, since: int, epoch) -> dict | None:
        """What a worker at version ``since`` has not seen, published now, for an ensure's
        answer to carry: the models the load evicted are gone from the worker's placement
        before its next request.  Its long-poll brings them a few milliseconds later, and a
        request in between would go to a variant no longer in its slot, be refused, and be
        ensured and sent again."""
        if epoch != self.epoch:
            return None
        self.publish()
        changes = self.published.changes_since(since)
        if not changes or len(changes) > MAX_CHANGES_WITH_ENSURE:
            return None
        return {"version": self.version, "epoch": self.epoch, "changes": changes}

    async def answered(self, request: web.Request) -> web.Response:
        """A worker's requests that ensured a model have their answers: their holds end."""
        body = await json_body(request)
        model, count = body.get("model"), body.get("count", 1)
        if not isinstance(model, str) or not model:
            raise InvalidInput("give the model whose requests were answered as 'model'")
        if type(count) is not int or count < 1:
            raise InvalidInput("'count' is the number of ensures answered, a whole number >= 1")
        return web.json_response({"model": model, "ended": self.manager.requests_answered(
            model, count, owner=_worker_of(body))})

    async def report(self, request: web.Request) -> web.Response:
        report = parse_report(await json_body(request))  # all checked before anything is applied
        if self.reports.take(report):
            await self.registry.notify()  # gather_reports waits for these
        return web.json_response({"ok": True})

    async def tokens(self, request: web.Request) -> web.Response:
        body = await json_body(request)
        self.registry.heard_from(*worker_of(body))
        name = body.get("name")
        want = body.get("want")
        if not isinstance(name, str) or not isinstance(want, int) or want < 1:
            raise InvalidInput("give the limited name as 'name' and a token count >= 1 as 'want'")
        spec = self.table.limits.get(name)
        granted, retry_after_s = self.buckets.grant(name, spec, min(want, 1000))
        return web.json_response({"granted": granted, "retry_after_s": retry_after_s,
                                  "limit": spec})

    async def worker_list(self, request: web.Request) -> web.Response:
        return web.json_response(self.registry.listing(self.version, self.epoch))


def add_dataplane_routes(app: web.Application, hub: DataPlaneHub) -> None:
    """The workers' API, on the admin port behind its token; admin changes settle first."""

    @web.middleware
    async def settle_changes(request: web.Request, handler):
        response = await handler(request)
        if (request.method in ("POST", "PUT", "DELETE") and response.status < 400
                and not request.path.startswith("/v1/dataplane/")):
            await hub.settle()
        return response

    app.middlewares.append(settle_changes)
    app.add_routes([
        web.get("/v1/dataplane/snapshot", hub.snapshot),
        web.post("/v1/dataplane/ensure", hub.ensure),
        web.post("/v1/dataplane/answered", hub.answered),
        web.post("/v1/dataplane/report", hub.report),
        web.post("/v1/dataplane/tokens", hub.tokens),
        web.get("/v1/dataplane/workers", hub.worker_list),
    ])


def _worker_of(body: dict) -> str | None:
    """The router worker whose holds an ensure makes or an "answered" ends; None when the
    caller does not say (such holds are ended by answers that do not say either)."""
    worker = body.get("worker")
    if worker is not None and (not isinstance(worker, str) or not 0 < len(worker) <= 200):
        raise InvalidInput("'worker' names the router worker (a non-empty string)")
    return worker
