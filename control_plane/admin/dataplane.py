"""The control plane's side of the router workers: what they serve from, and what they report.

Router workers are separate processes.  From here they get what they serve from (routes,
limits, experiments, canaries, public names, which server holds which model) as versioned
per-key changes through a long-poll watch (``control_plane.admin.published``), send misses as one ``ensure`` call, take rate-limit tokens from global
buckets in small batches, and report per-model use and per-variant outcomes in batches.
Canary and experiment decisions are made here, on the outcomes of every worker.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import asdict

from aiohttp import web

from control_plane.admin.api import json_body
from control_plane.admin.global_limits import GlobalBuckets
from control_plane.admin.published import PublishedState
from control_plane.admin.worker_reports import ShadowReports, WorkerSeen, parse_report, worker_of
from control_plane.rollouts.canary import CanaryController, registry_promoter
from control_plane.rollouts.stats import StatsBook
from control_plane.state.background import BackgroundStore
from domain.errors import InvalidInput
from domain.periodic import run_periodically
from domain.public_names import PublicNames
from domain.routes import RouteTable

log = logging.getLogger(__name__)

# How often the servers, the worker count and the tables' generations are looked at (a
# model's placement is published as soon as its state changes).
PUBLISH_INTERVAL_S = 0.1
CANARY_INTERVAL_S = 1.0  # how often running canaries are judged
SETTLE_TIMEOUT_S = 2.0  # an admin change waits this long at most for workers to have it
GATHER_TIMEOUT_S = 2.0  # a read of experiment / canary / shadow figures waits this long for reports
MAX_WAIT_S = 30.0


class DataPlaneHub:
    def __init__(self, manager, registry, store, expose_versions: bool = False,
                 shadow_log_dir: str | None = None, workers_expected: int = 1, families=None):
        self.manager = manager
        self.families = families  # families.FamilyCatalog: variants re-addressed to their family
        self.names = PublicNames(registry.versions, expose_concrete=expose_versions)
        registry.on_stage_change(self.names.refresh)
        self.route_store = BackgroundStore(store)  # route-table writes off the loop
        self.table = RouteTable(self.route_store, default_target=self.names.production.get,
                                unrouted=self.names.unrouted)
        self.stats = StatsBook(clock=time.time)
        self.canaries = CanaryController(self.table, self.stats)
        self.canaries.on_promote = registry_promoter(registry)  # one source of truth
        self.shadow = ShadowReports(lambda: self.workers.values(), shadow_log_dir)
        self.buckets = GlobalBuckets()
        self.workers: dict[str, WorkerSeen] = {}
        self.workers_expected = workers_expected
        # Versions restart with each control-plane life (a new epoch).
        self.published = PublishedState(uuid.uuid4().hex)
        self._published_generation = {"table": -1, "names": -1, "families": -1}
        self._routes_judged = False  # a canary step may have changed a route's stage
        self._moved: set[str] = set()  # models whose state changed since the last publish
        self._publish_soon = False
        if manager is not None:
            self._moved.update(manager.records)
            manager.on_state_change(self._model_moved)
        self._changed = asyncio.Condition()
        self._tasks: list[asyncio.Task] = []
        self.closing = False  # set on stop: long-polls answer at once instead of holding it up
        # Asks for reports now (gather_reports): answered through the workers' long-polls,
        # so that statistics read after a client's answers count those answers.
        self.report_call = 0

    # ------------------------------------------------------------------ what workers serve from
    def _model_moved(self, name: str) -> None:
        """A model's state changed: publish where it is READY now, once the change that
        moved it is complete (the same event-loop turn may set its server too)."""
        self._moved.add(name)
        if not self._publish_soon:
            self._publish_soon = True
            asyncio.get_running_loop().call_soon(self._publish_moved)

    def _publish_moved(self) -> None:
        self._publish_soon = False
        try:
            self.publish()
        except Exception:  # counted like a failed pass of the publish loop; the next pass retries
            log.exception("publishing a model's placement failed")
            if self._loop_failures is not None:
                self._loop_failures.labels("publish").inc()

    def _changes(self) -> list:
        """What changed since the last publish, found where it is cheap: the models whose
        state changed, the few servers, and the tables whose generation moved.  Nothing
        here walks every model unless the registry or the families changed."""
        manager, published = self.manager, self.published
        moved, self._moved = self._moved, set()
        changes = []
        for name in moved:
            server = manager.ready_server_of(name)
            changes.append(("placement", name, None if server is None else server.name))
        changes += [("servers", s.name, [s.spec.grpc_url, s.spec.http_url, bool(s.up)])
                    for s in manager.servers.values()]
        changes += [("meta", "repository", str(manager.repository) if manager.repository is not None else None),
                    ("meta", "workers", max(self.workers_expected, self.workers_in_touch())),
                    ("meta", "expose_concrete", self.names.expose_concrete)]
        table = self.table
        if table.version != self._published_generation["table"] or self._routes_judged:
            self._routes_judged = False
            self._published_generation["table"] = table.version
            changes += published.diff("routes", {n: asdict(r) for n, r in table.routes.items()})
            changes += published.diff("limits", {k: dict(v) for k, v in table.limits.items()})
        names = self.names
        if names.generation != self._published_generation["names"]:
            self._published_generation["names"] = names.generation
            versions: dict[str, dict[str, str]] = {}
            for (model, number), concrete in names.by_version.items():
                versions.setdefault(model, {})[number] = concrete
            changes += published.diff("production", dict(names.production))
            changes += published.diff("versions", versions)
            changes += published.diff("public", {c: list(v) for c, v in names.public.items()})
            changes += published.diff("models", dict.fromkeys(names.models, True))
        families = self.families
        if families is not None and families.generation != self._published_generation["families"]:
            self._published_generation["families"] = families.generation
            changes += published.diff("carriers", families.carriers())
        return changes

    def publish(self) -> int:
        """Publish what changed since the last publish; a new version when anything did."""
        if self.published.apply(self._changes()):
            self._notify()
        return self.published.version

    @property
    def version(self) -> int:
        return self.published.version

    @property
    def epoch(self) -> str:
        return self.published.epoch

    def _notify(self) -> None:
        async def wake():
            async with self._changed:
                self._changed.notify_all()
        asyncio.get_running_loop().create_task(wake())

    async def settle(self, timeout_s: float = SETTLE_TIMEOUT_S) -> bool:
        """Publish now and wait until every worker in touch has this version: an admin change
        is served by every worker once the call that made it returns.  In touch, not only
        live: an idle worker waiting in its long-poll has not been seen for up to
        ``WATCH_WAIT_S`` and serves the next request all the same."""
        version = self.publish()
        deadline = time.monotonic() + timeout_s

        def current() -> bool:
            now = time.time()
            return all(w.version >= version and w.epoch == self.epoch
                       for w in self.workers.values() if w.in_touch(now))

        return await self._wait_until(current, deadline)

    async def _wait_until(self, condition, deadline: float, notify: bool = False) -> bool:
        """Wait for ``condition()`` on each change until ``deadline`` (monotonic); whether it
        holds.  ``notify``: wake the waiters first (the long-polls)."""
        async with self._changed:
            if notify:
                self._changed.notify_all()
            while not condition():
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                try:
                    await asyncio.wait_for(self._changed.wait(), left)
                except TimeoutError:
                    return condition()
        return True

    async def gather_reports(self, timeout_s: float = GATHER_TIMEOUT_S) -> bool:
        """Ask every worker in touch for its report now and wait until each has answered:
        experiment, canary and shadow figures read next count every request answered before
        this call (workers otherwise report every 0.25 s, later on a busy machine).  False
        when a worker did not answer in ``timeout_s``: the figures may then lag."""
        now = time.time()
        asked = [w for w in self.workers.values() if w.in_touch(now)]
        if not asked:
            return True
        self.report_call += 1
        call = self.report_call
        # The long-polls carry the ask: woken, each answers at once.
        return await self._wait_until(lambda: all(w.report_call >= call for w in asked),
                                      time.monotonic() + timeout_s, notify=True)

    def workers_in_touch(self) -> int:
        now = time.time()
        return sum(1 for w in self.workers.values() if w.in_touch(now))

    def worker_counts(self) -> tuple[int, int]:
        """(workers in touch now, workers expected): ``mms_router_workers_*``."""
        return self.workers_in_touch(), self.workers_expected

    def _seen(self, worker: str, pid: int) -> WorkerSeen:
        if not worker:
            raise InvalidInput("a data-plane call must name its worker (worker=...)")
        seen = self.workers.get(worker)
        if seen is None:
            seen = self.workers[worker] = WorkerSeen(worker)
            log.info("router worker %s (pid %s) connected", worker, pid)
        seen.pid = pid or seen.pid
        seen.last_seen = time.time()
        return seen

    # ------------------------------------------------------------------ loops
    async def start(self) -> None:
        self.publish()
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._publish_loop()), loop.create_task(self._canary_loop())]

    async def release_watchers(self) -> None:
        """Answer every long-poll now: a stopping control plane must not wait for them."""
        self.closing = True
        for task in self._tasks:
            task.cancel()
        async with self._changed:
            self._changed.notify_all()

    @property
    def _loop_failures(self):
        return None if self.manager is None else self.manager.metrics.loop_failures

    async def _publish_loop(self) -> None:
        await run_periodically("publish", lambda: self.publish(), PUBLISH_INTERVAL_S,
                               self._loop_failures)

    async def _canary_loop(self) -> None:
        await run_periodically("canary", self._judge_canaries, CANARY_INTERVAL_S,
                               self._loop_failures)

    def _judge_canaries(self) -> None:
        self.canaries.step()
        self._routes_judged = True  # published by the next pass

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
        seen = self._seen(q.get("worker", ""), pid)
        if epoch == self.epoch:
            if since > seen.version >= 0 and seen.epoch == epoch:
                # The worker applied the changes up to ``since``: how long they took to reach
                # it.  (Not its first version: that is the whole state, however old.)
                age_s = self.published.age_of(since)
                if age_s is not None and self.manager is not None:
                    self.manager.metrics.dataplane_propagation.observe(age_s)
            seen.version, seen.epoch = since, epoch
            async with self._changed:
                self._changed.notify_all()  # settle() waits for these acknowledgements
        def asked() -> bool:
            return self.report_call > reported

        if epoch == self.epoch and since >= self.version and wait_s > 0 and not asked():
            seen.watching += 1
            try:
                async with self._changed:
                    try:
                        await asyncio.wait_for(
                            self._changed.wait_for(lambda: self.version > since or self.closing or asked()),
                            wait_s)
                    except TimeoutError:
                        pass
            finally:
                seen.watching -= 1
        if epoch == self.epoch and since >= self.version:
            return web.json_response({"version": self.version, "epoch": self.epoch, "unchanged": True,
                                      "report_call": self.report_call})
        return web.Response(body=self.published.answer(since, epoch), content_type="application/json")

    async def ensure(self, request: web.Request) -> web.Response:
        body = await json_body(request)
        model = body.get("model")
        if not isinstance(model, str) or not model:
            raise InvalidInput("give the model to load as 'model'")
        unreachable = body.get("unreachable")
        if unreachable is not None and not isinstance(unreachable, str):
            raise InvalidInput("'unreachable' names the server a request could not reach")
        server = await self.manager.ensure_for_request(model, unreachable=unreachable)
        return web.json_response({"model": model, "server": server.name, "grpc_url": server.spec.grpc_url,
                                  "http_url": server.spec.http_url, "up": bool(server.up)})

    async def answered(self, request: web.Request) -> web.Response:
        """A worker's requests that ensured a model have their answers: their holds end."""
        body = await json_body(request)
        model, count = body.get("model"), body.get("count", 1)
        if not isinstance(model, str) or not model:
            raise InvalidInput("give the model whose requests were answered as 'model'")
        if type(count) is not int or count < 1:
            raise InvalidInput("'count' is the number of ensures answered, a whole number >= 1")
        return web.json_response({"model": model, "ended": self.manager.requests_answered(model, count)})

    async def report(self, request: web.Request) -> web.Response:
        report = parse_report(await json_body(request))  # all checked before anything is applied
        seen = self._seen(report.worker, report.pid)
        for model, count in report.uses.items():
            for _ in range(min(count, 32)):  # frequency-aware policies count uses
                self.manager.touch(model)
        seen.requests += report.requests
        for scope, variant, code, served_ms, randomly in report.samples:
            self.stats.record_outcome(scope, variant, code, served_ms, randomly)
        seen.samples += len(report.samples)
        if report.shadow is not None:
            seen.shadow = report.shadow
        if report.report_call > seen.report_call:
            seen.report_call = report.report_call
            async with self._changed:
                self._changed.notify_all()  # gather_reports waits for these
        return web.json_response({"ok": True})

    async def tokens(self, request: web.Request) -> web.Response:
        body = await json_body(request)
        self._seen(*worker_of(body))
        name = body.get("name")
        want = body.get("want")
        if not isinstance(name, str) or not isinstance(want, int) or want < 1:
            raise InvalidInput("give the limited name as 'name' and a token count >= 1 as 'want'")
        spec = self.table.limits.get(name)
        granted, retry_after_s = self.buckets.grant(name, spec, min(want, 1000))
        return web.json_response({"granted": granted, "retry_after_s": retry_after_s, "limit": spec})

    async def worker_list(self, request: web.Request) -> web.Response:
        now = time.time()
        return web.json_response([w.to_dict(now) for w in self.workers.values()])


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
