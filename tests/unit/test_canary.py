"""Canary verdicts judge the candidate, not its load or its clients; promotion goes through
the registry; checks stay cheap on the serving loop (no write unless something changed,
bounded statistics windows)."""

from __future__ import annotations

import asyncio
import json
import time
from types import SimpleNamespace

import numpy as np
import pytest
from aiohttp import web
from aiohttp.test_utils import make_mocked_request

from control_plane.admin import rollout_routes
from control_plane.admin.rollout_routes import ROUTER_ADMIN_KEY, canary_action, router_errors
from control_plane.registry import Registry
from control_plane.rollouts.canary import WINDOW_KEY_PREFIX, CanaryController, registry_promoter
from control_plane.rollouts.stats import StatsBook, VariantStats
from control_plane.state.state_store import StateStore
from domain.errors import ModelNotFound as CpModelNotFound
from domain.router_errors import BackendUnavailable, InvalidRequest, ModelNotFound, RouterError
from domain.routes import ROUTES_KEY, RouteTable
from router.assembly import Router
from tests.conftest import run

LOAD_S = 0.3  # a cold load, in real time: the router measures with perf_counter


class Clock:
    def __init__(self, now: float = 1000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


class FakeManager:
    """What Sender.serving needs: a ready lookup and loads that take LOAD_S."""

    def __init__(self, ready=(), known=("m", "m2")):
        self.records: dict[str, SimpleNamespace] = {}
        self.ready = set(ready)
        self.known = set(known)
        self.servers = {}
        self.server = SimpleNamespace(name="t0", up=True, spec=SimpleNamespace(grpc_url="x", http_url="y"))

    def ready_server_of(self, name):
        return self.server if name in self.ready else None

    def copy_servers_of(self, name):
        return []

    async def ensure(self, name):
        if name not in self.known:
            raise CpModelNotFound(f"unknown model {name!r}")
        await asyncio.sleep(LOAD_S)
        self.ready.add(name)

    async def ensure_for_request(self, name):
        await self.ensure(name)
        return self.server

    def requests_answered(self, name, count):
        pass

    def touch(self, name):
        pass


def canary_router(clock, manager=None, **options):
    table = RouteTable(clock=clock)
    opts = {"stages": [50, 100], "stage_s": 30, "check_interval_s": 10, "min_requests": 5,
            "max_failed_checks": 1, "max_error_rate": 0.05, "max_p99_ms": 100}
    opts.update(options)
    table.start_canary("m", "m2", **opts)
    stats = StatsBook(clock=clock)
    return Router(manager or FakeManager(ready={"m"}), table, stats=stats,
                  canaries=CanaryController(table, stats, clock))


async def serve(router, variant_model, body=None):
    """One request through Sender.serving; ``body(call)`` plays the forward to Triton."""
    # Pick the variant: a user id lands on the same side of the split every time.
    user = next(f"u{i}" for i in range(10_000)
                if router.table.resolve("m", f"u{i}").model == variant_model)
    async with router.sender.serving("m", user) as call:
        if body is not None:
            await body(call)


def window(router, variant):
    return router.stats.get("canary:m", variant).window(0.0)


def test_latency_counts_from_when_the_candidate_was_ready():
    async def go():
        router = canary_router(Clock())
        await asyncio.gather(*[serve(router, "m2") for _ in range(5)])  # all wait for the load
        return window(router, "canary")

    w = run(go())
    assert w.requests == 5 and w.errors == 0
    assert w.p99_ms < LOAD_S * 1000 / 3, f"p99 {w.p99_ms} ms includes the {LOAD_S}s cold load"


def test_client_errors_and_cancellations_do_not_count_against_the_candidate():
    async def bad_input(call):
        raise InvalidRequest("FEATURES has shape [1, 3], the model expects [-1, 64]")

    async def unknown_adapter(call):
        raise ModelNotFound("adapter 'nosuch' is not loaded")

    async def backend_down(call):
        raise BackendUnavailable("Triton is down")

    async def go():
        router = canary_router(Clock(), FakeManager(ready={"m", "m2"}))
        for body in (bad_input, unknown_adapter, backend_down):
            with pytest.raises(RouterError):
                await serve(router, "m2", body)
        hung = asyncio.create_task(serve(router, "m2", lambda call: asyncio.sleep(60)))
        await asyncio.sleep(0.01)
        hung.cancel()  # the client went away
        with pytest.raises(asyncio.CancelledError):
            await hung
        await serve(router, "m2")
        return window(router, "canary"), router.stats.scope("canary:m")["canary"]

    w, totals = run(go())
    assert (w.requests, w.errors) == (2, 1), "only the backend failure is the candidate's"
    assert totals["client_errors"] == 3


def test_a_request_the_candidate_had_past_the_clients_deadline_counts_against_it():
    """gRPC cancels a call at the client's deadline, a moment before the router's own timer:
    counted as the client going away, a candidate that never answered in time was never
    rolled back, and one answering some requests in time was judged on those alone."""
    async def go():
        router = canary_router(Clock(), FakeManager(ready={"m", "m2"}))
        user = next(f"u{i}" for i in range(10_000) if router.table.resolve("m", f"u{i}").model == "m2")

        async def request(timeout_s):
            async with router.sender.serving("m", user, timeout_s=timeout_s):
                await asyncio.sleep(60)  # the candidate does not answer

        at_deadline = asyncio.create_task(request(0.15))  # one any model could meet
        await asyncio.sleep(0.16)
        at_deadline.cancel()  # what gRPC does at the client's deadline
        gone_early = asyncio.create_task(request(5.0))
        await asyncio.sleep(0.01)
        gone_early.cancel()  # the client went away long before its deadline
        for task in (at_deadline, gone_early):
            with pytest.raises(asyncio.CancelledError):
                await task
        return window(router, "canary"), router.stats.scope("canary:m")["canary"]

    w, totals = run(go())
    assert (w.requests, w.errors) == (1, 1)
    assert totals["client_errors"] == 1


@pytest.mark.parametrize("code, reached, served_ms, meetable_ms, expected", [
    ("OK", True, 3.0, 100.0, "ok"),
    ("DEADLINE_EXCEEDED", False, None, 100.0, "short_deadline"),  # refused before the model
    ("DEADLINE_EXCEEDED", True, 0.001, 100.0, "short_deadline"),  # a 1 us deadline
    ("DEADLINE_EXCEEDED", True, 150.0, 300.0, "short_deadline"),  # under 2x the model's p99
    ("DEADLINE_EXCEEDED", True, 150.0, 100.0, "error"),  # one the model could meet
    ("RESOURCE_EXHAUSTED", False, None, 100.0, "refused"),  # the miss budget, a rate limit
    ("RESOURCE_EXHAUSTED", True, 2.0, 100.0, "refused"),
    ("CANCELLED", True, 2.0, 100.0, "client"),
    ("INVALID_ARGUMENT", True, 2.0, 100.0, "client"),
    ("NOT_FOUND", False, None, 100.0, "error"),  # a candidate that cannot be found
    ("UNAVAILABLE", True, 2.0, 100.0, "error"),
])
def test_what_the_client_or_the_product_caused_is_never_the_models(code, reached, served_ms,
                                                                   meetable_ms, expected):
    from control_plane.rollouts.stats import classify

    assert classify(code, reached, served_ms, meetable_ms).value == expected


def test_tiny_deadlines_and_refusals_aimed_at_both_arms_neither_roll_back_nor_promote():
    """An anonymous client finds user ids of each arm offline (the split is a public hash)
    and sends them 1 us deadlines and requests its miss budget refuses: none of it is the
    candidate's or the baseline's doing, so the canary holds (too few judged requests), and
    ``canary status`` counts them apart."""
    from domain.router_errors import RateLimited

    clock = Clock()

    async def refused(call):
        raise RateLimited("client 203.0.113.9 has caused more misses than its budget", 1.0)

    async def go():
        router = canary_router(clock, FakeManager(ready={"m", "m2"}), min_requests=5,
                               stage_s=30, check_interval_s=10)
        for arm in ("m", "m2"):
            user = next(f"u{i}" for i in range(10_000)
                        if router.table.resolve("m", f"u{i}").model == arm)
            for _ in range(40):
                with pytest.raises((RouterError, asyncio.CancelledError)):
                    async with router.sender.serving("m", user, timeout_s=1e-6):
                        await asyncio.sleep(0.001)  # the deadline passes at once
                        raise asyncio.CancelledError  # what gRPC does at the deadline
                with pytest.raises(RouterError):
                    await serve(router, arm, refused)
        for _ in range(4):
            clock.now += 11
            router.canaries.step()
        return router.table.routes["m"].canary, router.stats.scope("canary:m")

    canary, totals = run(go())
    assert canary.status == "running", canary.history
    assert {h["decision"] for h in canary.history} == {"start", "hold"}, canary.history
    for variant in ("baseline", "canary"):
        t = totals[variant]
        assert (t["requests"], t["errors"]) == (0, 0), t
        assert t["short_deadlines"] == 40 and t["refused"] == 40, t


def test_a_candidate_that_cannot_be_found_counts_as_its_error():
    async def go():
        router = canary_router(Clock(), FakeManager(ready={"m"}, known={"m"}))
        with pytest.raises(ModelNotFound):
            await serve(router, "m2")
        return window(router, "canary")

    w = run(go())
    assert (w.requests, w.errors) == (1, 1)
    assert w.p99_ms is None  # it never reached a model: no latency


def test_a_healthy_candidate_that_starts_cold_is_promoted_not_rolled_back():
    clock = Clock()

    async def go():
        router = canary_router(clock, max_failed_checks=1, max_p99_ms=100, stage_s=30)
        clock.now += 1  # stage 1 (50%): the candidate is cold, its first requests wait
        await asyncio.gather(*[serve(router, "m2") for _ in range(6)],
                             *[serve(router, "m") for _ in range(6)])
        clock.now += 31
        router.canaries.step()
        clock.now += 1  # stage 2 (100%)
        await asyncio.gather(*[serve(router, "m2") for _ in range(6)])
        clock.now += 31
        router.canaries.step()
        return router.table.routes["m"]

    route = run(go())
    c = route.canary
    assert c.status == "promoted", c.history
    assert [h["decision"] for h in c.history] == ["start", "advance", "promote"]
    assert route.target == "m2"


# --------------------------------------------------------------------------- promotion
def _registry(tmp_path):
    registry = Registry(StateStore(tmp_path / "state.db").db)
    for version, stage in ((1, "production"), (2, "registered")):
        registry.add("m", version, f"file:///cold/m/{version}/", "0" * 64, 1, who="test", stage=stage)
    registry.add("other", 1, "file:///cold/other/1/", "0" * 64, 1, who="test", stage="production")
    production: dict[str, str] = {}

    def refresh(*_args):  # what service.py wires: the table reads production versions
        production.clear()
        production.update({v.model: v.name for v in registry.versions() if v.stage == "production"})

    refresh()
    registry.on_stage_change(refresh)
    return registry, production


def _promote_through(registry, production, candidate):
    clock = Clock()
    table = RouteTable(clock=clock, default_target=production.get)
    stats = StatsBook(clock=clock)
    ctl = CanaryController(table, stats, clock, on_promote=registry_promoter(registry))
    table.start_canary("m", candidate, stages=[100], stage_s=10, check_interval_s=1, min_requests=5)
    assert table.routes["m"].canary.baseline == "m.v1"
    clock.now += 11
    for variant in ("canary", "baseline"):
        for _ in range(10):
            stats.record("canary:m", variant, 5.0, True)
    ctl.step()
    return table


def test_promotion_makes_the_candidate_the_registry_production_version(tmp_path):
    registry, production = _registry(tmp_path)
    table = _promote_through(registry, production, "m.v2")
    route = table.routes["m"]
    assert route.canary.status == "promoted"
    assert registry.production("m").name == "m.v2"  # one source of truth
    assert route.target is None, "the route must not keep an alias of its own"
    assert table.resolve("m", None).model == "m.v2"
    assert route.canary.history[-1]["via"] == "registry"
    assert registry.history("m", 2)[-1].who == "canary"


def test_promoting_another_models_version_aliases_the_route_and_leaves_the_registry(tmp_path):
    registry, production = _registry(tmp_path)
    table = _promote_through(registry, production, "other.v1")
    assert table.routes["m"].target == "other.v1" and table.resolve("m", None).model == "other.v1"
    assert registry.production("m").name == "m.v1" and registry.production("other").name == "other.v1"


def test_promotion_by_hand_goes_through_the_registry(tmp_path):
    registry, production = _registry(tmp_path)
    clock = Clock()
    table = RouteTable(clock=clock, default_target=production.get)
    router = SimpleNamespace(table=table, canaries=CanaryController(
        table, StatsBook(clock), clock, on_promote=registry_promoter(registry)))
    table.start_canary("m", "m.v2", stages=[10, 100], stage_s=60)
    app = web.Application()
    app[ROUTER_ADMIN_KEY] = router
    request = make_mocked_request("POST", "/v1/canaries/m/promote", app=app,
                                  match_info={"name": "m", "action": "promote"})
    resp = asyncio.run(router_errors(request, canary_action))
    assert resp.status == 200 and json.loads(resp.body)["status"] == "promoted"
    assert registry.production("m").name == "m.v2" and table.routes["m"].target is None


def test_a_start_refused_keeps_the_running_canarys_observations(monkeypatch):
    """`mmctl canary start` again (a retry, a typo in a gate) reset the statistics before
    the start was refused: the failures seen so far were lost and the rollback delayed."""
    clock = Clock()
    table = RouteTable(clock=clock)
    stats = StatsBook(clock)
    router = SimpleNamespace(table=table, stats=stats)
    app = web.Application()
    app[ROUTER_ADMIN_KEY] = router

    def start(body):
        async def given(_request):
            return body

        monkeypatch.setattr(rollout_routes, "_json", given)
        request = make_mocked_request("POST", "/v1/canaries/m", app=app, match_info={"name": "m"})
        return asyncio.run(router_errors(request, rollout_routes.canary_start))

    assert start({"to": "m2", "stages": [50, 100], "stage_s": 60}).status == 200
    for _ in range(4):
        stats.record("canary:m", "canary", 5.0, False)
    for body in ({"to": "m2", "stage_s": 60}, {"to": "m3", "stage_s": 60, "min_requests": 0}):
        assert start(body).status == 400
        assert stats.get("canary:m", "canary").window(0.0).errors == 4
    table.canary("m").status = "rolled_back"
    assert start({"to": "m2", "stages": [50, 100], "stage_s": 60}).status == 200
    assert stats.get("canary:m", "canary").window(0.0).errors == 0  # a new canary starts afresh


# --------------------------------------------------------------------------- loop cost
class CountingStore:
    def __init__(self):
        self.data: dict[str, str] = {}
        self.puts = 0  # of the route table
        self.window_puts = 0  # of the canaries' statistics windows

    def get(self, key, default=None):
        return self.data.get(key, default)

    def put(self, key, value):
        if key.startswith(WINDOW_KEY_PREFIX):
            self.window_puts += 1
        else:
            self.puts += 1
        self.data[key] = value


def test_canary_checks_write_the_route_table_only_when_progress_changes():
    clock = Clock()
    store = CountingStore()
    table = RouteTable(store, clock=clock)
    stats = StatsBook(clock=clock)
    ctl = CanaryController(table, stats, clock)
    table.start_canary("m", "m2", stages=[50, 100], stage_s=60, check_interval_s=1,
                       min_requests=5, max_failed_checks=3)
    written = store.puts
    for _ in range(20):  # idle: every check holds
        clock.now += 1
        ctl.step()
    assert store.puts == written, "a 'hold' changes nothing worth a write"
    assert [h["decision"] for h in table.routes["m"].canary.history[1:]] == ["hold"] * 20
    for _ in range(10):
        stats.record("canary:m", "canary", 5.0, True)
        stats.record("canary:m", "baseline", 5.0, True)
    for _ in range(5):  # passing, stage not over yet
        clock.now += 1
        ctl.step()
    assert store.puts == written
    assert store.window_puts == 1, "the window is written once: nothing new came after"
    clock.now += 60
    ctl.step()  # advance: progress changed
    assert store.puts > written
    saved = json.loads(store.data[ROUTES_KEY])[0]["canary"]
    assert saved["stage_index"] == 1


def test_window_summary_of_a_full_window_is_cheap_and_right():
    rng = np.random.default_rng(0)
    latencies = rng.exponential(5.0, 60_000)
    stats = VariantStats()
    for i, lat in enumerate(latencies):
        stats.record(1000.0 + i * 0.01, float(lat), i % 50 != 0)
    since = 1000.0 + 20_000 * 0.01  # the window: the last 40,000 requests
    stats.window(since)

    def cpu_ms_per_call(work) -> float:
        cpu_start = time.thread_time()
        for _ in range(10):
            work()
        return (time.thread_time() - cpu_start) * 100

    w_ms = cpu_ms_per_call(lambda: stats.window(since))
    # Cheap means vectorised: measured against one pure-Python pass that sorts the window's
    # latencies, on the same CPU at the same moment (a busy machine slows both alike); the
    # summary costs about a tenth of it here, a per-sample Python summary costs more.
    in_window = latencies[20_000:].tolist()
    python_ms = cpu_ms_per_call(lambda: sorted(in_window))
    assert w_ms < python_ms / 3, (f"one window summary took {w_ms:.2f} ms of CPU on the serving "
                                  f"loop, a Python sort of its latencies {python_ms:.2f} ms")
    w = stats.window(since)
    kept = latencies[20_000:]
    assert w.requests == 40_000 and w.errors == sum(1 for i in range(20_000, 60_000) if i % 50 == 0)
    assert w.p99_ms == pytest.approx(np.percentile(kept, 99), rel=0.05)
    assert w.p50_ms == pytest.approx(np.percentile(kept, 50), rel=0.05)


def test_a_saved_window_restores_to_the_same_judgement():
    stats = VariantStats(max_samples=8)
    for i in range(12):  # the ring wraps: the 8 newest are kept
        stats.record(1000.0 + i, None if i == 9 else float(i), i % 3 != 0)
    stats.record_client_error()
    again = VariantStats.restored(json.loads(json.dumps(stats.saved(1005.0))), max_samples=8)
    assert again.window(1005.0) == stats.window(1005.0)
    assert again.window(-1.0).requests == 7, "only the samples at or after 'since' are saved"
    assert (again.requests, again.errors, again.client_errors) == (12, 4, 1)
    again.record(2000.0, 1.0, True)  # goes on recording after the restored samples
    assert again.window(1005.0).requests == 8
