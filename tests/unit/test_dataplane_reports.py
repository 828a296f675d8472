"""Router workers' reports to the control plane: a malformed one is refused whole with a
400 that says what a report holds, and nothing of it is applied."""

from __future__ import annotations

import asyncio
import json
import time
from types import SimpleNamespace

import pytest
from aiohttp import web
from aiohttp.test_utils import make_mocked_request

from control_plane.admin import dataplane
from control_plane.admin.api import error_middleware
from control_plane.admin.dataplane import DataPlaneHub
from control_plane.dataplane import workers as worker_reports
from control_plane.rollouts.stats import StatsBook


class Touches:
    def __init__(self):
        self.touched: list[str] = []

    def touch(self, name):
        self.touched.append(name)


def hub() -> DataPlaneHub:
    """The hub's report handler needs its workers, stats and manager only."""
    h = DataPlaneHub.__new__(DataPlaneHub)
    h.workers, h.stats, h.manager = {}, StatsBook(), Touches()
    return h


def post_report(monkeypatch, h: DataPlaneHub, body: dict) -> tuple[int, dict]:
    async def parsed(_request):
        return body

    monkeypatch.setattr(dataplane, "json_body", parsed)
    request = make_mocked_request("POST", "/v1/dataplane/report", app=web.Application())
    resp = asyncio.run(error_middleware(request, h.report))
    return resp.status, json.loads(resp.body)


GOOD = {"worker": "w0", "pid": 7, "uses": {"cust001": 3}, "requests": 3,
        "samples": [["canary:m", "canary", "OK", 4.5, False], ["canary:m", "baseline", "INTERNAL", None, True]],
        "shadow": {"m": {"mirrored": 2, "latency_delta_ms_sum": 1.5}}}


def test_a_report_is_applied(monkeypatch):
    h = hub()
    status, _ = post_report(monkeypatch, h, GOOD)
    assert status == 200
    assert h.manager.touched == ["cust001"] * 3
    assert h.workers["w0"].requests == 3 and h.workers["w0"].samples == 2
    assert h.stats.scope("canary:m")["canary"]["requests"] == 1
    assert h.workers["w0"].shadow["m"]["mirrored"] == 2 and isinstance(h.workers["w0"].shadow["m"]["mirrored"], int)


def test_a_restarted_workers_shadow_counts_add_to_those_of_its_earlier_process(monkeypatch):
    """A supervised worker keeps its name across a restart and counts from 0 again: its
    first report replaced the earlier process's counts, and the route's figures went back."""
    h = hub()
    first = {"worker": "w0", "pid": 7, "shadow": {"m": {"mirrored": 5, "diverged": 2}}}
    assert post_report(monkeypatch, h, first)[0] == 200
    assert post_report(monkeypatch, h, dict(first, pid=8, shadow={"m": {"mirrored": 1}}))[0] == 200
    assert post_report(monkeypatch, h, dict(first, pid=8, shadow={"m": {"mirrored": 3}}))[0] == 200
    report = h.reports.shadow.report("m")
    assert (report["mirrored"], report["diverged"]) == (8, 2), report


@pytest.mark.parametrize("bad", [
    {"samples": [1]},
    {"samples": [["canary:m", "canary", "OK", "fast", False]]},
    {"uses": {"cust001": "abc"}},
    {"uses": ["cust001"]},
    {"requests": "many"},
    {"pid": "z"},
    {"shadow": {"m": {"mirrored": "two"}}},
    {"outstanding": {"cust001": "lots"}},
    {"outstanding": ["cust001"]},
])
def test_a_malformed_report_is_refused_whole(monkeypatch, bad):
    h = hub()
    status, body = post_report(monkeypatch, h, dict(GOOD, **bad))
    assert status == 400 and body["error"] == "invalid_input", body
    assert "report" in body["message"] or "pid" in body["message"]
    assert h.manager.touched == [] and h.workers == {} and h.stats.scope("canary:m") == {}


def test_outstanding_requests_are_summed_over_the_workers_as_last_reported(monkeypatch):
    """What ``mmctl scale --replicas auto`` scales by: each worker's count as it last said,
    summed; a worker that reports none (an earlier version too) counts nothing."""
    h = hub()
    for worker, outstanding in (("w0", {"cust001": 3}), ("w1", {"cust001": 4, "cust002": 1}),
                                ("w2", None)):
        body = dict(GOOD, worker=worker, uses={})
        if outstanding is not None:
            body["outstanding"] = outstanding
        assert post_report(monkeypatch, h, body)[0] == 200
    assert h.reports.outstanding() == {"cust001": 7, "cust002": 1}
    assert post_report(monkeypatch, h, dict(GOOD, worker="w1", uses={}, outstanding={}))[0] == 200
    assert h.reports.outstanding() == {"cust001": 3}


# ---------------------------------------------------------------------- reports on demand
class NoModels(Touches):
    """The manager as the hub reads it, with no server and no model."""

    def __init__(self):
        super().__init__()
        self.records, self.servers, self.repository = {}, {}, None
        self.metrics = SimpleNamespace(loop_failures=None,
                                       dataplane_propagation=SimpleNamespace(observe=lambda _s: None))

    def on_state_change(self, _listener):
        pass

    def ready_server_of(self, _name):
        return None

    def copy_servers_of(self, name):
        return []


async def serving_hub(tmp_path, monkeypatch, workers: int = 1):
    """A real hub on a loopback port and ``workers`` RemoteState workers watching it, whose
    periodic reports never come on their own within a test."""
    from aiohttp.test_utils import TestServer

    from control_plane.registry import Registry
    from control_plane.state.state_store import StateStore
    from router.serving import state_client

    monkeypatch.setattr(state_client, "REPORT_INTERVAL_S", 3600.0)
    store = StateStore(tmp_path / "state.db")
    h = DataPlaneHub(NoModels(), Registry(store.db), store)
    app = web.Application(middlewares=[error_middleware])  # as the admin API's
    dataplane.add_dataplane_routes(app, h)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    await h.start()
    clients = []
    for i in range(workers):
        client = state_client.RemoteState(str(server.make_url("")), "token", f"w{i}")
        await client.start(first_snapshot_timeout_s=5)
        clients.append(client)
    for _ in range(100):  # every worker waiting in its long-poll
        if all(w.watching for w in h.workers.values()) and len(h.workers) == workers:
            break
        await asyncio.sleep(0.01)
    return h, server, clients


def test_figures_read_after_the_answers_count_every_answer(tmp_path, monkeypatch):
    async def go():
        h, server, (w0, w1) = await serving_hub(tmp_path, monkeypatch, workers=2)
        try:
            for _ in range(5):
                w0.record_outcome("exp:rec-ab", "control", "OK", 3.0)
            w1.record_outcome("exp:rec-ab", "treatment", "OK", 4.0)
            assert h.stats.scope("exp:rec-ab") == {}  # nothing reported yet
            assert await h.gather_reports(timeout_s=5)
            scope = h.stats.scope("exp:rec-ab")
            assert scope["control"]["requests"] == 5 and scope["treatment"]["requests"] == 1
            # A second read asks again; workers with nothing new answer all the same.
            assert await h.gather_reports(timeout_s=5)
            assert h.stats.scope("exp:rec-ab")["control"]["requests"] == 5  # never twice
        finally:
            for w in (w0, w1):
                await w.stop()
            await h.release_watchers()
            await server.close()

    asyncio.run(go())


def test_a_worker_that_does_not_answer_delays_the_read_by_the_timeout_only(tmp_path, monkeypatch):
    async def go():
        h, server, (w0,) = await serving_hub(tmp_path, monkeypatch)
        try:
            for task in w0._tasks:  # its watch is stuck: the ask never reaches it
                task.cancel()
            loop = asyncio.get_running_loop()
            started = loop.time()
            assert not await h.gather_reports(timeout_s=0.3)
            # Not held until the stuck worker's long-poll would end (tens of seconds): a
            # bound of a few seconds tells the two apart on a busy machine too.
            assert loop.time() - started < 5
        finally:
            await w0.stop()
            await h.release_watchers()
            await server.close()

    asyncio.run(go())


def test_an_admin_change_waits_for_an_idle_worker_in_its_long_poll(tmp_path, monkeypatch):
    async def go():
        # A worker idle for longer than it takes to stop counting as live: it sits in its
        # long-poll, unseen, and still serves the next request.
        monkeypatch.setattr(worker_reports, "WORKER_LIVE_S", 0.05)
        h, server, (w0,) = await serving_hub(tmp_path, monkeypatch)
        try:
            await asyncio.sleep(0.1)
            assert h.workers["w0"].watching and not h.workers["w0"].live(time.time())
            h.table.set_limit("m1", 5.0, 5.0)
            assert await h.settle(timeout_s=5)
            assert w0.table.limits == {"m1": {"qps": 5.0, "burst": 5.0}}  # served from now on
        finally:
            await w0.stop()
            await h.release_watchers()
            await server.close()

    asyncio.run(go())


def test_a_judged_canary_pass_is_published_at_once_and_the_listing_says_who_has_it(
        tmp_path, monkeypatch):
    async def go():
        h, server, (w0,) = await serving_hub(tmp_path, monkeypatch)
        try:
            assert await h.settle(timeout_s=5)
            (listed,) = h.registry.listing(h.version, h.epoch)
            assert listed["current"]
            before = h.version
            h.table.set_limit("m1", 5.0, 5.0)  # a table changed, as a rollback changes it
            h.rollouts.judge()
            await asyncio.sleep(0)  # the rest of this event-loop turn, not a publish pass
            assert h.version > before
            (listed,) = h.registry.listing(h.version, h.epoch)
            assert not listed["current"]  # w0 has not fetched it yet
            for _ in range(500):
                if h.registry.listing(h.version, h.epoch)[0]["current"]:
                    break
                await asyncio.sleep(0.01)
            assert w0.table.limits == {"m1": {"qps": 5.0, "burst": 5.0}}
            assert h.registry.listing(h.version, h.epoch)[0]["current"]
        finally:
            await w0.stop()
            await h.release_watchers()
            await server.close()

    asyncio.run(go())


def test_versions_published_close_together_reach_a_worker_in_one_answer(tmp_path, monkeypatch):
    """A worker's long-poll woken by a version waits SNAPSHOT_LINGER_S (made 0.5 s here) and
    answers with what came meanwhile: two versions 50 ms apart, as a miss publishes its
    victim leaving and then its newcomer ready, are one answer (one HTTP round trip), not
    two.  An admin change waiting for the workers to have it is answered without the wait."""
    monkeypatch.setattr(dataplane, "SNAPSHOT_LINGER_S", 0.5)
    answers = []
    snapshot = DataPlaneHub.snapshot

    async def counted(self, request):
        response = await snapshot(self, request)
        answers.append(request.query.get("since"))
        return response
    monkeypatch.setattr(DataPlaneHub, "snapshot", counted)

    async def go():
        h, server, (w0,) = await serving_hub(tmp_path, monkeypatch)
        try:
            answered = len(answers)
            h.table.set_limit("m1", 5.0, 5.0)
            h.publish()
            await asyncio.sleep(0.05)
            h.table.set_limit("m2", 6.0, 6.0)
            h.publish()
            for _ in range(300):
                if len(w0.table.limits) == 2:
                    break
                await asyncio.sleep(0.01)
            assert w0.table.limits == {"m1": {"qps": 5.0, "burst": 5.0}, "m2": {"qps": 6.0, "burst": 6.0}}
            assert len(answers) == answered + 1  # both in one answer
            # Not after the linger: made longer than the settle's own timeout, a long-poll
            # that lingered would leave the settle unanswered (False) at its 5 s.
            monkeypatch.setattr(dataplane, "SNAPSHOT_LINGER_S", 30.0)
            h.table.set_limit("m3", 7.0, 7.0)
            assert await h.settle(timeout_s=5)
            assert w0.table.limits["m3"] == {"qps": 7.0, "burst": 7.0}
        finally:
            await w0.stop()
            await h.release_watchers()
            await server.close()

    asyncio.run(go())


class LruTouches:
    """The manager's ``touch`` over a real LRU policy (the default), three models resident."""

    def __init__(self):
        from control_plane.eviction.policy import LRUPolicy

        self.policy = LRUPolicy()
        for name in ("a", "b", "c"):
            self.policy.admit(name, 0.0)

    def touch(self, name):
        self.policy.touch(name, 1.0)  # one report: its touches come at one instant


def test_a_reports_uses_reach_the_lru_order_in_the_order_of_their_last_use(monkeypatch):
    """A worker uses a, b, then a again: a is the most recently used, b the least of the two.
    The report lists its models by last use (not first), and the hub touches them in that
    order; a report that failed to send keeps its uses before the ones counted since."""
    from router.serving.state_client import ControlPlaneAway, RemoteState

    async def report_twice() -> list[dict]:
        state = RemoteState("http://127.0.0.1:1", "tok", "w0")
        sent: list[dict] = []
        calls = iter([ControlPlaneAway("restarting"), None])

        async def call(method, path, body=None, **_):
            failure = next(calls)
            if failure is not None:
                raise failure
            sent.append(body)
            return {}
        state._call = call
        for model in ("a", "b", "a"):
            state.touch(model)
        with pytest.raises(ControlPlaneAway):
            await state._send_report()
        for model in ("c", "b"):  # counted while the control plane was away
            state.touch(model)
        await state._send_report()
        return sent

    (body,) = asyncio.run(report_twice())
    assert list(body["uses"].items()) == [("a", 2), ("c", 1), ("b", 2)]
    h = hub()
    h.manager = LruTouches()
    status, _ = post_report(monkeypatch, h, json.loads(json.dumps(dict(GOOD, uses=body["uses"]))))
    assert status == 200
    assert list(h.manager.policy.victim_order()) == ["a", "c", "b"]  # least recent first
