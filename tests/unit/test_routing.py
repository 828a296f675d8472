"""Route resolution, A/B stickiness, canary decisions, token buckets, shadow comparison."""

from __future__ import annotations

import asyncio
import random

import numpy as np
import pytest

from control_plane.rollouts.canary import CanaryController
from control_plane.rollouts.stats import StatsBook
from domain.errors import InvalidModelName
from domain.router_errors import InvalidRequest
from domain.routes import RouteTable, bucket
from domain.token_bucket import TokenBucket
from router.rollouts.shadow import ShadowItem, ShadowMirror, compare_outputs
from tests.conftest import run
from tests.unit.test_shadow import NEVER_SHED


class Clock:
    def __init__(self, now: float = 1000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_bucket_is_deterministic_and_per_experiment():
    assert bucket("exp", "alice") == bucket("exp", "alice")
    assert 0 <= bucket("exp", "alice") < 10_000
    assert len({bucket(f"exp{i}", "alice") for i in range(50)}) > 40


def test_sticky_ten_percent_split_over_ten_thousand_users():
    table = RouteTable(rng=random.Random(1))
    table.create_experiment("rec-ab", "cust017", "cust017-v2", 10, sticky=True)
    first = {u: table.resolve("cust017", f"user-{u}") for u in range(10_000)}
    treated = sum(d.variant == "treatment" for d in first.values())
    assert 900 <= treated <= 1100
    for u in range(0, 10_000, 97):  # the same user always lands on the same variant
        again = table.resolve("cust017", f"user-{u}")
        assert (again.variant, again.model) == (first[u].variant, first[u].model)
    assert all(not d.randomly_assigned for d in first.values())


def test_missing_user_id_is_random_and_counted_and_disabled_means_control():
    table = RouteTable(rng=random.Random(2))
    table.create_experiment("e", "a", "b", 50)
    decisions = [table.resolve("a", None) for _ in range(400)]
    assert all(d.randomly_assigned for d in decisions)
    assert 120 < sum(d.variant == "treatment" for d in decisions) < 280
    table.set_experiment_enabled("e", False)
    assert {table.resolve("a", "u").model for _ in range(20)} == {"a"}


def test_an_empty_user_id_is_anonymous_not_one_user():
    """An empty x-user-id header or user_id parameter hashed as the user "": every such
    request landed in the same arm, none counted as randomly assigned."""
    table = RouteTable(rng=random.Random(2))
    table.create_experiment("e", "a", "b", 50)
    decisions = [table.resolve("a", "") for _ in range(400)]
    assert all(d.randomly_assigned for d in decisions)
    assert 120 < sum(d.variant == "treatment" for d in decisions) < 280


@pytest.mark.parametrize(("gate", "value"), [
    ("min_requests", 0), ("min_requests", -5), ("max_failed_checks", 0),
    ("max_error_rate", float("nan")), ("max_error_rate", 1.5), ("max_p99_ms", float("nan")),
    ("max_p99_ms", 0.0), ("max_error_rate_ratio", float("inf")), ("stage_s", 0.0),
    ("check_interval_s", -1.0),
])
def test_a_canary_gate_that_could_never_fail_is_refused(gate, value):
    """min_requests 0 passed a stage with no canary traffic (the error rate of an empty
    window is 0), a NaN limit never failed: a candidate promoted on no evidence."""
    table = RouteTable()
    options = {"stages": [10, 100], "stage_s": 1, gate: value}
    with pytest.raises(InvalidRequest, match=f"canary {gate} is"):
        table.start_canary("a", "b", **options)
    assert "a" not in table.routes or table.routes["a"].canary is None


def test_non_sticky_experiment_varies_per_request():
    table = RouteTable(rng=random.Random(3))
    table.create_experiment("e", "a", "b", 50, sticky=False)
    assert {table.resolve("a", "same-user").variant for _ in range(50)} == {"control", "treatment"}


def test_route_validation_errors():
    table = RouteTable()
    with pytest.raises(InvalidModelName):
        table.resolve("../x", None)
    with pytest.raises(InvalidRequest, match="between 0 and 100"):
        table.create_experiment("e", "a", "b", 150)
    with pytest.raises(InvalidRequest, match="increasing"):
        table.start_canary("a", "b", stages=[50, 10], stage_s=1)
    table.create_experiment("e", "a", "b", 10)
    with pytest.raises(InvalidRequest, match="runs experiment"):
        table.start_canary("a", "b", stages=[10, 100], stage_s=1)


def test_routes_persist(tmp_path):
    from control_plane.state.state_store import StateStore

    store = StateStore(tmp_path / "s.db")
    table = RouteTable(store)
    table.create_experiment("e", "a", "b", 10)
    table.start_canary("c", "c2", stages=[5, 100], stage_s=60)
    table.set_limit("a", 5, 10)
    again = RouteTable(StateStore(tmp_path / "s.db"))
    assert again.routes["a"].experiment.treatment == "b"
    assert again.routes["c"].canary.stages == [5.0, 100.0]
    assert again.limits == {"a": {"qps": 5.0, "burst": 10.0}}


def _canary(clock, **options):
    table = RouteTable(clock=clock)
    stats = StatsBook(clock=clock)
    opts = {"stages": [10, 50, 100], "stage_s": 60, "check_interval_s": 10, "min_requests": 20,
            "max_failed_checks": 2, "max_error_rate": 0.05}
    opts.update(options)
    table.start_canary("m", "m2", **opts)
    return table, stats, CanaryController(table, stats, clock)


def _traffic(stats, variant, n, error_every=0, latency_ms=5.0):
    for i in range(n):
        ok = not (error_every and i % error_every == 0)
        stats.record("canary:m", variant, latency_ms, ok)


def test_idle_canary_holds_instead_of_rolling_back():
    clock = Clock()
    table, _stats, ctl = _canary(clock)
    for _ in range(20):
        clock.now += 11
        ctl.step()
    c = table.routes["m"].canary
    assert c.status == "running" and c.stage_index == 0
    assert {h["decision"] for h in c.history[1:]} == {"hold"}
    assert "inconclusive" in c.history[-1]["reason"]


def test_failing_canary_rolls_back_after_consecutive_failures():
    clock = Clock()
    table, stats, ctl = _canary(clock)
    clock.now += 11
    _traffic(stats, "canary", 40, error_every=2)
    _traffic(stats, "baseline", 200)
    ctl.step()
    assert table.routes["m"].canary.status == "running"
    assert table.routes["m"].canary.history[-1]["decision"] == "fail"
    clock.now += 11
    ctl.step()
    c = table.routes["m"].canary
    assert c.status == "rolled_back" and c.percent == 0
    assert "error rate 0.500 > 0.050" in c.history[-1]["reason"]
    assert c.history[-1]["canary"]["requests"] == 40
    assert table.resolve("m", None).model == "m"


def test_healthy_canary_advances_and_promotes():
    clock = Clock()
    table, stats, ctl = _canary(clock, stage_s=30)
    for _ in range(3):
        clock.now += 31
        _traffic(stats, "canary", 25)
        _traffic(stats, "baseline", 25)
        ctl.step()
    route = table.routes["m"]
    assert route.canary.status == "promoted" and route.target == "m2"
    assert [h["decision"] for h in route.canary.history] == ["start", "advance", "advance", "promote"]
    assert table.resolve("m", None).model == "m2"


def test_relative_latency_gate():
    clock = Clock()
    table, stats, ctl = _canary(clock, max_p99_ratio=1.5, max_failed_checks=1)
    clock.now += 11
    _traffic(stats, "canary", 30, latency_ms=50)
    _traffic(stats, "baseline", 30, latency_ms=10)
    ctl.step()
    assert table.routes["m"].canary.status == "rolled_back"
    assert "1.5x baseline" in table.routes["m"].canary.history[-1]["reason"]


def test_token_bucket_admits_burst_then_rate():
    clock = Clock(0.0)
    tb = TokenBucket(rate_per_s=2, burst=5, clock=clock)
    assert [tb.try_acquire()[0] for _ in range(7)] == [True] * 5 + [False] * 2
    ok, retry_after_s = tb.try_acquire()
    assert not ok and retry_after_s == pytest.approx(0.5)
    clock.now += 0.5
    assert tb.try_acquire()[0]
    with pytest.raises(ValueError):
        TokenBucket(rate_per_s=0, burst=1)


def test_compare_outputs():
    a = [("SCORES", "FP32", np.array([0.5, 0.25], np.float32).tobytes())]
    b = [("SCORES", "FP32", np.array([0.5, 0.25000001], np.float32).tobytes())]
    c = [("SCORES", "FP32", np.array([0.5, 0.75], np.float32).tobytes())]
    assert compare_outputs(a, b)[0] is False
    diverged, max_diff = compare_outputs(a, c)
    assert diverged and max_diff == pytest.approx(0.5)
    assert compare_outputs(a, [("OTHER", "FP32", a[0][2])])[0] is True


def test_shadow_queue_drops_when_full_and_never_blocks():
    async def go():
        gate = asyncio.Event()

        async def slow_send(model, request, timeout_s):
            await gate.wait()

        mirror = ShadowMirror(slow_send, None, queue_size=2, workers=1, shed_lag_ms=NEVER_SHED)
        mirror.start()
        item = ShadowItem("r", "s", object(), [], 1.0)
        results = [mirror.offer(item) for _ in range(10)]
        await asyncio.sleep(0.01)
        report = mirror.report("r")
        assert results.count(False) >= 7 and report["dropped"] == results.count(False)
        gate.set()
        await mirror.stop()

    run(go())


def test_name_serves_registry_production_version_unless_aliased():
    production = {"cust017": "cust017.v3"}
    table = RouteTable(rng=random.Random(4), default_target=production.get)
    assert table.resolve("cust017", None).model == "cust017.v3"
    assert table.resolve("cust001", None).model == "cust001"
    table.create_experiment("e", "cust017", "cust017-v2", 10)
    table.delete_experiment("e")  # the route that remains must not pin the old target
    assert table.resolve("cust017", None).model == "cust017.v3"
    table.start_canary("cust017", "cust017.v4", stages=[10, 100], stage_s=1)
    assert table.routes["cust017"].canary.baseline == "cust017.v3"
    table.set_alias("cust017", "cust017-v2")
    assert table.target_of("cust017") == "cust017-v2"


def test_public_requests_cannot_control_adapters_or_dodge_their_limits():
    from domain.router_errors import PermissionDenied
    from router.rollouts.routing_decisions import Decider

    with pytest.raises(PermissionDenied, match="ADAPTER_CONTROL"):
        Decider.public_name("tinylm", ["ADAPTER_CONTROL"], None)
    with pytest.raises(InvalidRequest, match="adapter=NAME"):
        Decider.public_name("tinylm", ["TEXT", "ADAPTER"], None)
    # An adapter chosen by parameter is routed (and rate-limited) as base:adapter.
    assert Decider.public_name("tinylm", ["TEXT"], "acme") == "tinylm:acme"
    assert Decider.public_name("tinylm:acme", ["TEXT"], "acme") == "tinylm:acme"
    assert Decider.public_name("cust001", ["FEATURES"], None) == "cust001"


def test_experiment_refused_on_a_route_with_a_running_canary():
    table = RouteTable()
    table.start_canary("a", "b", stages=[10, 100], stage_s=60)
    with pytest.raises(InvalidRequest, match="running canary"):
        table.create_experiment("e", "a", "c", 10)
    with pytest.raises(InvalidModelName):
        table.create_experiment("e2", "x", "y", 10, route_name="../r")
