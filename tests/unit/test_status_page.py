"""The status page's parts without sockets: the session cookie's reach, the router traffic
window and its quantiles, the history's rates, the gauges read at scrape time, and the
overview document built from fakes."""

from __future__ import annotations

import asyncio
import json
import time
from types import SimpleNamespace

import pytest
from aiohttp import web
from aiohttp.test_utils import make_mocked_request
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from control_plane.admin.access import SESSION_COOKIE, SESSION_TTL_S, AdminAccess, access_middleware
from control_plane.admin.api import SIGN_IN_KEY, error_middleware
from control_plane.admin.status_page import static_files
from control_plane.admin.status_page.history import History
from control_plane.admin.status_page.overview import (
    Overview,
    StatusSources,
    control_plane_totals,
    encode,
)
from control_plane.admin.status_page.traffic import (
    Counts,
    RouterTraffic,
    Snapshot,
    parse,
    quantile,
    samples_from_families,
    samples_from_text,
)
from control_plane.dataplane.workers import WORKER_LIVE_S, WorkerSeen
from control_plane.metrics import ControlPlaneMetrics, StateCollector
from domain.routes import Canary, Experiment, Route, Shadow

TOKEN = "s3cret-token"
ACCESS = AdminAccess(token=TOKEN, bind_host="127.0.0.1")


async def _ok(request: web.Request) -> web.Response:
    return web.json_response({"ok": True})


def call(method: str, path: str, cookie: str | None = None, app=None, **headers) -> web.Response:
    sent = {"Host": "127.0.0.1:8090", **headers}
    if cookie is not None:
        sent["Cookie"] = f"{SESSION_COOKIE}={cookie}"
    request = make_mocked_request(method, path, headers=sent, app=app)
    check = access_middleware(ACCESS)

    async def inner(req):
        return await check(req, _ok)

    return asyncio.run(error_middleware(request, inner))


# ---------------------------------------------------------------------- access
def test_a_session_opens_the_page_and_its_data_and_nothing_else():
    session = ACCESS.session_value(time.time())
    assert TOKEN not in session
    assert call("GET", "/", cookie=session).status == 200
    assert call("GET", "/v1/overview", cookie=session).status == 200
    assert call("GET", "/v1/status", cookie=session).status == 401
    assert call("GET", "/v1/canaries/cust001", cookie=session).status == 401
    assert call("POST", "/v1/models/cust001/load", cookie=session,
                **{"Content-Type": "application/json"}).status == 401


@pytest.mark.parametrize("cookie", [
    "", "garbage", "12.34", f"{int(time.time()) - 5}.{'0' * 64}",
    AdminAccess(token="another-token").session_value(time.time()),  # rotated token
    ACCESS.session_value(time.time() - SESSION_TTL_S - 10),  # expired
], ids=["empty", "garbage", "no-mac", "zero-mac", "rotated-token", "expired"])  # ids without the clock: xdist's workers must collect alike
def test_a_session_that_is_not_ours_or_has_expired_is_refused(cookie):
    assert call("GET", "/v1/overview", cookie=cookie).status == 401
    mac_swapped = ACCESS.session_value(time.time()).split(".")[1]
    assert call("GET", "/", cookie=f"{int(time.time()) + 10 ** 6}.{mac_swapped}").status == 401


def test_sign_in_needs_json_but_no_bearer_and_static_files_are_public():
    assert call("POST", "/v1/session", **{"Content-Type": "application/json"}).status == 200
    assert call("POST", "/v1/session", **{"Content-Type": "text/plain"}).status == 415
    assert call("GET", "/static/app.js").status == 200
    assert call("POST", "/static/app.js", **{"Content-Type": "application/json"}).status == 401
    # Another origin is refused before any of that.
    assert call("POST", "/v1/session", Origin="http://evil.example",
                **{"Content-Type": "application/json"}).status == 403


def test_a_browser_refused_on_the_page_gets_the_sign_in_form_with_its_401():
    app = web.Application()
    app[SIGN_IN_KEY] = b"<form id=signin></form>"
    resp = call("GET", "/", app=app, Accept="text/html,application/xhtml+xml")
    assert resp.status == 401 and resp.content_type == "text/html"
    assert resp.body == b"<form id=signin></form>"
    assert resp.headers["WWW-Authenticate"].startswith("Bearer")
    assert "frame-ancestors 'none'" in resp.headers["Content-Security-Policy"]
    # Other callers, and other paths, get the JSON error as before.
    assert json.loads(call("GET", "/", app=app).body)["error"] == "unauthorized"
    assert json.loads(call("GET", "/v1/overview", app=app, Accept="text/html").body)["error"] == "unauthorized"


def test_the_page_ships_its_files_and_only_relative_ones():
    files = static_files()
    assert {"index.html", "signin.html", "app.js", "charts.js", "signin.js", "style.css"} <= set(files)
    for name, (body, _) in files.items():
        text = body.decode()
        assert "http://" not in text.replace("http://www.w3.org/2000/svg", "") and "https://" not in text, name
        if name.endswith(".js"):
            assert "innerHTML" not in text and "insertAdjacentHTML" not in text, name


# ---------------------------------------------------------------------- router traffic
def router_metrics(requests: dict, waits: dict, latencies: dict) -> list:
    """The router's samples as its registry would hold them."""
    return list(samples_from_families(router_registry(requests, waits, latencies).collect()))


def router_registry(requests: dict, waits: dict, latencies: dict) -> CollectorRegistry:
    registry = CollectorRegistry()
    req = Counter("mmr_requests_total", "", ["route", "model", "variant", "code"], registry=registry)
    wait = Counter("mmr_cold_load_waits_total", "", ["model"], registry=registry)
    lat = Histogram("mmr_request_seconds", "", ["route", "variant"], registry=registry,
                    buckets=(0.001, 0.01, 0.1, 1))
    for labels, n in requests.items():
        req.labels(*labels).inc(n)
    for model, n in waits.items():
        wait.labels(model).inc(n)
    for labels, values in latencies.items():
        for v in values:
            lat.labels(*labels).observe(v)
    return registry


def test_quantiles_are_prometheus_histogram_quantiles():
    bounds = [0.001, 0.01, 0.1, float("inf")]
    assert quantile(0.5, bounds, [0, 10, 10, 10]) == pytest.approx(0.001 + 0.009 * 0.5)
    assert quantile(0.99, bounds, [0, 0, 0, 5]) == 0.1  # in +Inf: the highest finite bound
    assert quantile(0.5, bounds, [0, 0, 0, 0]) is None


def test_traffic_per_model_maps_routes_to_models_and_counts_hits():
    families = router_metrics(
        {("cust001", "cust001", "default", "OK"): 8, ("cust001", "cust001", "default", "UNAVAILABLE"): 2,
         ("ab", "cust002", "treatment", "OK"): 4, ("nosuch", "unknown", "default", "NOT_FOUND"): 3},
        {"cust001": 1},
        {("cust001", "default"): [0.005] * 9 + [0.5], ("ab", "treatment"): [0.05] * 4})
    traffic = RouterTraffic()
    traffic.observe(parse(families, at=100.0))
    per = traffic.per_model()
    assert set(per) == {"cust001", "cust002"}  # no series for unknown names
    assert (per["cust001"].requests, per["cust001"].errors, per["cust001"].hit_ratio) == (10, 2, 0.9)
    assert 1 < per["cust001"].p50_ms < 10 and per["cust001"].p99_ms > 100
    assert per["cust002"].hit_ratio == 1.0 and 10 < per["cust002"].p50_ms < 100
    assert traffic.since is None  # not watched for a window yet: since the router started


def test_the_window_subtracts_a_baseline_and_survives_a_router_restart():
    traffic = RouterTraffic(window_s=300, baseline_every_s=30)
    old = Snapshot(0.0, {"m": Counts(100, 10, 50, [50, 100]), "gone": Counts(5, 0, 5, [5, 5])},
                   [0.01, float("inf")])
    traffic.observe(old)
    traffic.observe(Snapshot(200.0, {"m": Counts(110, 10, 50, [60, 110])}, old.bounds))
    assert traffic.per_model()["m"].requests == 110  # under a window old: since start
    traffic.observe(Snapshot(301.0, {"m": Counts(120, 11, 51, [69, 120])}, old.bounds))
    assert traffic.since == 0.0
    m = traffic.per_model()["m"]
    assert (m.requests, m.errors, m.hit_ratio) == (20, 1, 0.95)
    traffic.observe(Snapshot(320.0, {"m": Counts(3, 0, 1, [3, 3])}, old.bounds))  # restarted
    assert traffic.per_model()["m"].requests == 3


# ---------------------------------------------------------------------- history
def test_history_rates_over_the_trailing_minute_with_gaps_for_what_was_not_read():
    h = History(span_s=1800, rate_over_s=60, slot_s=5)
    for i in range(0, 125, 5):  # a miss every 5 s, an eviction every 10 s
        totals = {"misses": i / 5, "evictions": i // 10, "loads": i / 5}
        if i >= 60:  # the router was read from then on: 2 requests/s, one wait in ten
            totals.update(requests=2.0 * i, cold_waits=0.2 * i, errors=0.0)
        h.sample(float(i), totals)
    s = h.series(120.0)
    assert s["misses_per_min"][-1] == pytest.approx(12.0)
    assert s["evictions_per_min"][-1] == pytest.approx(6.0)
    assert s["requests_per_s"][-1] == pytest.approx(2.0)
    assert s["hit_ratio"][-1] == pytest.approx(0.9)
    assert s["requests_per_s"][0] is None and s["misses_per_min"][0] is None
    h.sample(121.0, {"misses": 30.0})  # same slot: merged, the router's totals kept
    assert len(h.series(121.0)["t"]) == len(s["t"])
    assert h.series(121.0)["requests_per_s"][-1] is not None


# ---------------------------------------------------------------------- scrape-time gauges
def fake_manager():
    spec = lambda limit: SimpleNamespace(max_loaded=limit, memory_budget_bytes=1000)
    servers = {"t0": SimpleNamespace(name="t0", spec=spec(3)), "t1": SimpleNamespace(name="t1", spec=spec(None))}
    rec = lambda name, server, pinned, size: SimpleNamespace(
        name=name, server=server, pinned=pinned, memory_bytes=size)
    records = {"a": rec("a", "t0", True, 100), "b": rec("b", "t0", True, 50), "c": rec("c", "t0", False, 70),
               "d": rec("d", None, True, 0)}
    return SimpleNamespace(servers=servers, records=records, metrics=ControlPlaneMetrics())


def canary(status: str, **more) -> Canary:
    c = Canary(baseline="m", candidate="m.v2", stages=[10, 50, 100], stage_s=60, status=status,
               stage_index=1, **more)
    c.history = [{"at": 10.0, "decision": "start", "stage": 0, "percent": 10.0},
                 {"at": 20.0, "decision": "advance", "stage": 1, "percent": 50.0,
                  "canary": {"requests": 60, "error_rate": 0.0, "p99_ms": 4.2}}]
    if status == "rolled_back":
        c.history.append({"at": 30.0, "decision": "rollback", "stage": 1, "percent": 0.0,
                          "reason": "p99 900.0 ms > 500.0 ms"})
    return c


def fake_rollouts():
    routes = {"m": Route("m", None, canary=canary("rolled_back")),
              "n": Route("n", None, canary=canary("running"), shadow=Shadow("n.v2", 20.0)),
              "ab": Route("ab", None, experiment=Experiment("ab1", "x", "y", 30.0))}
    stats = SimpleNamespace(scope=lambda scope: {"canary": {"requests": 3}} if scope.startswith("canary:") else {})
    shadow = SimpleNamespace(report=lambda route: {"mirrored": 10, "dropped": 2, "compared": 8,
                                                   "diverged": 2, "divergence_rate": 0.25,
                                                   "log": "/x.jsonl"})
    return SimpleNamespace(table=SimpleNamespace(routes=routes), stats=stats, shadow=shadow)


def samples(collector) -> dict:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in collector.collect() for s in family.samples}


def test_state_gauges_count_pins_slots_canaries_and_workers():
    hub = SimpleNamespace(worker_counts=lambda: (1, 2))
    got = samples(StateCollector(fake_manager(), rollouts=fake_rollouts(), workers=hub))
    assert got[("mms_pinned_models", (("server", "t0"),))] == 2
    assert got[("mms_pinned_bytes", (("server", "t0"),))] == 150
    assert got[("mms_pinned_models", (("server", "t1"),))] == 0
    assert got[("mms_max_loaded_models", (("server", "t0"),))] == 3
    assert got[("mms_max_loaded_models", (("server", "t1"),))] == float("inf")
    assert got[("mms_canaries", (("state", "rolled_back"),))] == 1
    assert got[("mms_canaries", (("state", "running"),))] == 1
    assert got[("mms_canaries", (("state", "aborted"),))] == 0
    assert got[("mms_canary_percent", (("route", "n"),))] == 50.0
    assert got[("mms_canary_rollback_time_seconds", (("route", "m"),))] == 30.0
    assert ("mms_canary_rollback_time_seconds", (("route", "n"),)) not in got
    assert got[("mms_router_workers_live", ())] == 1 and got[("mms_router_workers_expected", ())] == 2


def test_a_worker_waiting_in_its_watch_is_in_touch():
    w = WorkerSeen("w0", last_seen=time.time() - WORKER_LIVE_S - 5)
    assert not w.in_touch(time.time())
    w.watching = 1
    assert w.in_touch(time.time()) and not w.live(time.time())


def test_every_server_has_its_counters_from_the_start():
    m = ControlPlaneMetrics()
    m.declare_servers(["t0"])
    text = "\n".join(f"{s.name} {s.labels}" for f in m.registry.collect() for s in f.samples)
    assert "mms_evictions_total {'server': 't0'}" in text
    assert "control_plane_leader {}" in text


# ---------------------------------------------------------------------- the document
def test_the_overview_puts_the_fleet_traffic_and_rollouts_together():
    manager = fake_manager()
    manager.status = lambda: [
        {"model": "a", "state": "ready", "server": "t0", "pinned": True, "last_used": 5.0,
         "load_time_s": 1.5, "memory_bytes": 100, "failure": None, "loads": 1,
         "copies": [{"server": "t0", "state": "ready"}, {"server": "t1", "state": "ready"},
                    {"server": "t2", "state": "loading"}]},
        {"model": "z", "state": "failed", "server": None, "pinned": False, "last_used": None,
         "load_time_s": None, "memory_bytes": 0, "failure": "<b>boom</b>", "loads": 1}]
    manager.fleet = lambda: [{"server": "t0", "device": "cpu", "up": True, "lost": False,
                              "memory_budget_bytes": 1000, "used_bytes": 170, "max_loaded": 3,
                              "loaded": ["a", "c"]}]
    manager.metrics.misses.labels("a").inc(3)

    async def read():
        return router_metrics({("a", "a", "default", "OK"): 4}, {}, {("a", "default"): [0.002] * 4})

    clock = iter(range(1000, 2000)).__next__
    hub = SimpleNamespace(worker_counts=lambda: (2, 2), version=7, epoch="e1", workers={
        "w0": WorkerSeen("w0", last_seen=1000.0, version=7, epoch="e1"),
        "w1": WorkerSeen("w1", last_seen=1000.0, version=6, epoch="e1")})
    overview = Overview(StatusSources(manager, locate=lambda n: {"tier": "hot" if n == "a" else "warm"},
                                      rollouts=fake_rollouts(), router_metrics=read, workers=hub,
                                      clock=lambda: float(clock())))

    async def built() -> dict:
        await overview.read_router()  # a page's poll only starts it, in the background
        return await overview.build()

    doc = json.loads(encode(asyncio.run(built())))
    cols = doc["models"]["columns"]
    rows = {r[0]: dict(zip(cols, r)) for r in doc["models"]["rows"]}
    assert rows["a"]["tier"] == "hot" and rows["a"]["requests"] == 4 and rows["a"]["hit_ratio"] == 1.0
    assert rows["z"]["failure"] == "<b>boom</b>"  # data, as it is: the page writes it as text
    assert rows["a"]["copies"] == ["t1"] and rows["z"]["copies"] == []  # its other ready copies
    [server] = doc["servers"]
    assert server["pinned"] == ["a"] and server["pinned_bytes"] == 100
    assert doc["summary"]["tiers"] == {"hot": 1, "warm": 1}
    by_route = {c["route"]: c for c in doc["canaries"]}
    assert by_route["m"]["verdict"] == "rolled back" and by_route["m"]["why"] == "p99 900.0 ms > 500.0 ms"
    assert by_route["n"]["why"].startswith("gates passed: 60 canary requests")
    assert [s["decision"] for s in by_route["m"]["steps"]] == ["start", "advance", "rollback"]
    [shadow] = doc["shadows"]
    assert (shadow["route"], shadow["dropped"], shadow["divergence_rate"]) == ("n", 2, 0.25)
    assert "log" not in shadow
    assert doc["experiments"][0]["id"] == "ab1" and doc["traffic"]["available"]
    # Which workers serve every change published (w1 is a version behind).
    assert {w["worker"]: w["current"] for w in doc["workers"]["list"]} == {"w0": True, "w1": False}


def test_a_router_that_cannot_be_read_leaves_the_rest_of_the_page():
    manager = fake_manager()
    manager.status = list
    manager.fleet = list

    async def unreachable():
        raise OSError("connection refused")

    overview = Overview(StatusSources(manager, router_metrics=unreachable))

    async def built() -> dict:
        await overview.read_router()
        return await overview.build()

    doc = asyncio.run(built())
    assert "connection refused" in doc["traffic"]["error"] and not doc["traffic"]["available"]
    assert doc["canaries"] == [] and doc["router"] is False


def test_text_and_registry_samples_parse_the_same():
    """In process the router's registry is read; router workers' /metrics text is parsed."""
    registry = router_registry({("r", "m", "default", "OK"): 2, ("r", "m", "default", "UNAVAILABLE"): 1},
                               {"m": 1}, {("r", "default"): [0.5, 0.5]})
    text = generate_latest(registry).decode()
    a = parse(samples_from_families(registry.collect()), 1.0).models["m"]
    b = parse(samples_from_text(text), 1.0).models["m"]
    full = parse(samples_from_families(text_string_to_metric_families(text)), 1.0).models["m"]
    assert (a.requests, a.errors, a.cold_waits, a.buckets) == (b.requests, b.errors, b.cold_waits, b.buckets)
    assert (b.requests, b.errors, b.buckets) == (full.requests, full.errors, full.buckets)


def test_evictions_are_every_unload_that_made_room():
    m = ControlPlaneMetrics()
    m.declare_servers(["t0"])
    m.unloads.labels("t0", "evicted").inc(2)
    m.unloads.labels("t0", "headroom").inc(3)  # ahead of the next miss (a family's slots)
    m.unloads.labels("t0", "requested").inc(5)  # mmctl unload: not an eviction
    m.misses.labels("a").inc(4)
    assert control_plane_totals(m) == {"misses": 4, "evictions": 5, "loads": 0}


def test_the_router_is_read_in_the_background_paced_by_what_a_read_costs():
    manager = fake_manager()
    manager.status = list
    manager.fleet = list
    reads = []

    async def read():
        reads.append(time.monotonic())
        return router_metrics({("a", "a", "default", "OK"): 1}, {}, {})

    overview = Overview(StatusSources(manager, router_metrics=read))

    async def polls() -> list[dict]:
        docs = []
        for _ in range(3):  # pages polling: one read starts, none waits for it
            docs.append(await overview.build())
            await asyncio.sleep(0.01)
        overview.sample_control_plane()  # the sampler's idle read is not due either
        await asyncio.sleep(0.01)
        return docs

    docs = asyncio.run(polls())
    assert len(reads) == 1
    assert not docs[0]["traffic"]["available"] and docs[-1]["traffic"]["available"]


# ---------------------------------------------------------------------- sign-out
def revocable_access(kv: dict, clock=time.monotonic) -> AdminAccess:
    """An AdminAccess whose sign-outs go to ``kv`` (the state store both control planes read)."""
    from control_plane.admin.access import SessionRevocations

    return AdminAccess(token=TOKEN, revocations=SessionRevocations(kv.get, kv.__setitem__, clock=clock))


def test_sign_out_ends_the_session_on_the_leader_and_on_every_other_control_plane():
    kv: dict = {}
    leader, standby = revocable_access(kv), revocable_access(kv)
    session = leader.session_value(time.time())
    other = leader.session_value(time.time())
    assert standby.session_ok(session, time.time())  # seen, and remembered for a moment
    leader.end_session(session, time.time())
    assert not leader.session_ok(session, time.time())
    assert leader.session_ok(other, time.time())  # another browser stays signed in
    later = revocable_access(kv)  # a standby that takes over, or the next life
    assert not later.session_ok(session, time.time())
    assert TOKEN not in json.dumps(kv) and session not in json.dumps(kv)


def test_a_standby_sees_a_sign_out_within_its_cache_time():
    kv: dict = {}
    now = [100.0]
    leader, standby = revocable_access(kv), revocable_access(kv, clock=lambda: now[0])
    session = leader.session_value(time.time())
    assert standby.session_ok(session, time.time())
    leader.end_session(session, time.time())
    now[0] += 2.5
    assert not standby.session_ok(session, time.time())


def test_sign_out_through_the_api_revokes_the_cookie():
    from control_plane.admin.access import SESSION_ENDPOINT
    from control_plane.admin.status_page import sign_out

    kv: dict = {}
    access = revocable_access(kv)
    session = access.session_value(time.time())
    app = web.Application()
    from control_plane.admin.api import ACCESS_KEY

    app[ACCESS_KEY] = access
    request = make_mocked_request("DELETE", SESSION_ENDPOINT, app=app,
                                  headers={"Cookie": f"{SESSION_COOKIE}={session}"})
    resp = asyncio.run(sign_out(request))
    assert resp.status == 200 and not access.session_ok(session, time.time())


@pytest.mark.parametrize("cookie", ["²²²²²²²²²²", "1" * 40, "٣٣٣." + "a" * 32 + "." + "0" * 64, "..", "\x00"])
def test_a_malformed_cookie_is_a_401_not_a_500(cookie):
    assert call("GET", "/v1/overview", cookie=cookie).status == 401


def test_the_cookie_is_secure_behind_a_proxy_that_terminated_tls():
    from control_plane.admin.status_page import served_over_tls

    assert served_over_tls(make_mocked_request("POST", "/v1/session", headers={"X-Forwarded-Proto": "https"}))
    assert served_over_tls(make_mocked_request("POST", "/v1/session", headers={"Forwarded": "for=1.2.3.4; proto=https"}))
    assert not served_over_tls(make_mocked_request("POST", "/v1/session", headers={}))
