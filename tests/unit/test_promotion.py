"""Promotion by traffic (fake clock, fake counters) and stage-aware eviction in the manager."""

from __future__ import annotations

import asyncio
import json

import pytest

from control_plane.manager.manager_config import ManagerConfig
from control_plane.manager.model_manager import ModelManager
from control_plane.manager.records import ServerSpec
from control_plane.registry import Registry, resident_priority_updater
from control_plane.runtime.promotion import (
    AUTO_PINS_KEY,
    Promoter,
    TrafficTracker,
    counter_by_label,
)
from control_plane.state.state_store import StateStore
from domain.errors import CapacityExhausted
from tests.conftest import run
from tests.unit.test_manager_unit import FakeAdmin


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_tracker_rates_decay_and_survive_counter_resets():
    clock = Clock()
    t = TrafficTracker(half_life_s=10.0, clock=clock)
    t.observe({"a": 0, "b": 0})
    clock.now = 10.0
    t.observe({"a": 1000, "b": 10})
    assert t.top(2) == ["a", "b"] and t.rates["a"] == pytest.approx(50.0)  # (1 - 1/2) * 100/s
    clock.now = 20.0
    t.observe({"a": 1000, "b": 20})  # a stopped
    assert t.rates["a"] == pytest.approx(25.0)
    clock.now = 30.0
    t.observe({"a": 5, "b": 30})  # a's counter restarted (reload): 5 new requests
    assert t.rates["a"] == pytest.approx(12.5 + 0.25)
    assert (t.rank("a"), t.rank("b"), t.rank("zzz")) == (0, 1, None)


class FakeManager:
    def __init__(self, store):
        self.store = store
        self.records = {}
        self.pinned = set()
        self.refuse = set()

    async def pin(self, name):
        if name in self.refuse:
            raise CapacityExhausted(f"no room for {name}")
        self.pinned.add(name)
        self.records[name] = type("R", (), {"pinned": True})()

    async def unpin(self, name):
        self.pinned.discard(name)
        self.records[name].pinned = False


class FakeWarm:
    def __init__(self, known):
        self._known = set(known)
        self.warm = set()

    def is_warm(self, name):
        return name in self.warm

    def known(self):
        return self._known

    async def prefetch(self, name):
        self.warm.add(name)
        return 1


def test_auto_pins_top_k_unpins_with_slack_and_leaves_operator_pins(tmp_path):
    store = StateStore(tmp_path / "s.db")
    mgr = FakeManager(store)
    mgr.records["op"] = type("R", (), {"pinned": True})()  # pinned by an operator
    counts = {}
    clock = Clock()

    async def requests():
        return dict(counts)

    p = Promoter(mgr, top_k_pin=2, unpin_slack=1, half_life_s=5.0, clock=clock,
                 request_counts=requests, miss_counts=dict)

    async def go():
        await p.step()  # baseline
        counts.update({"a": 100, "b": 80, "c": 10, "op": 500})
        clock.now += 5
        report = await p.step()
        assert sorted(report.pinned) == ["a"]  # op is top but already pinned by a person
        assert p.auto_pins == {"a"}
        counts.update({"a": 100, "b": 300, "c": 900, "op": 500})
        clock.now += 5
        report = await p.step()  # rates: c 89.5, b 26, op 25, a 5 -> top 2 = c, b; keep top 3
        assert report.pinned == ["c", "b"] and report.unpinned == ["a"]
        assert mgr.records["op"].pinned  # an operator's pin is never touched
        mgr.refuse.add("d")
        counts.update({"d": 5000})
        clock.now += 5
        report = await p.step()
        assert report.errors and "no room for d" in report.errors[0]
        assert report.unpinned == []  # b is still within top_k + slack

    run(go())
    assert set(json.loads(store.get(AUTO_PINS_KEY))) == {"b", "c"}
    # Auto pins persist across restarts, so they can be undone later.
    assert Promoter(mgr, top_k_pin=2, request_counts=requests, miss_counts=dict).auto_pins == {"b", "c"}


def test_prefetch_models_with_frequent_misses(tmp_path):
    store = StateStore(tmp_path / "s.db")
    warm = FakeWarm({"x.v1", "y.v1", "z.v1", "w.v1"})
    warm.warm.add("w.v1")
    misses = {"x.v1": 0, "y.v1": 0, "z.v1": 0, "w.v1": 0, "unknown": 0}
    clock = Clock()

    async def requests():
        return {}

    p = Promoter(FakeManager(store), warm, prefetch_min_miss_rate=0.5, max_prefetch_per_step=2,
                 half_life_s=1.0, clock=clock, request_counts=requests, miss_counts=lambda: dict(misses))

    async def go():
        await p.step()
        misses.update({"x.v1": 30, "y.v1": 20, "z.v1": 10, "w.v1": 50, "unknown": 90})
        clock.now += 10
        report = await p.step()
        assert report.prefetched == ["x.v1", "y.v1"]  # limit per pass; w is warm; unknown can't be
        misses.update({"z.v1": 20})  # z keeps missing; x and y stopped (they are warm now)
        clock.now += 10
        report = await p.step()
        assert report.prefetched == ["z.v1"]
        clock.now += 10
        assert (await p.step()).prefetched == []  # no misses any more: below the threshold

    run(go())


def test_counter_by_label_reads_prometheus_counters(tmp_path):
    mgr = ModelManager([ModelManager.make_server(ServerSpec("s", "f:1", "f:2"), "lru", admin=FakeAdmin([]))],
                       StateStore(tmp_path / "s.db"))
    mgr.metrics.misses.labels("a").inc(3)
    mgr.metrics.misses.labels("b").inc()
    assert counter_by_label(mgr.metrics.misses) == {"a": 3, "b": 1}


# --------------------------------------------------------------------------- stage-aware eviction
def staged_manager(tmp_path, slots):
    models = ["prod.v1", "canary.v1", "shadow.v1", "pinned.v1", "new.v1", "new.v2", "new.v3"]
    admin = FakeAdmin(models)
    store = StateStore(tmp_path / "s.db")
    reg = Registry(store.db)
    for name, stage in [("prod", "production"), ("canary", "canary"), ("shadow", "shadow"),
                        ("pinned", "shadow"), ("new", "production")]:
        reg.add(name, 1, f"file:///x/{name}/1/", "a" * 64, 1, who="t", stage=stage)
    server = ModelManager.make_server(ServerSpec("s0", "f:1", "f:2", max_loaded=slots), "lru", admin=admin)
    mgr = ModelManager([server], store, config=ManagerConfig(policy="lru", unload_timeout_s=0.3),
                       priority_of=reg.stage_priority)
    return mgr, reg


def test_shadow_before_canary_before_production_and_pinned_never(tmp_path):
    async def go():
        mgr, _ = staged_manager(tmp_path, slots=4)
        await mgr.start()

        def loaded():
            return {m["model"] for m in mgr.status() if m["state"] == "ready"}

        await mgr.pin("pinned.v1")  # a pinned shadow: the lowest stage, still never evicted
        for name in ("shadow.v1", "canary.v1", "prod.v1"):
            await mgr.ensure(name)
        await mgr.ensure("shadow.v1")  # the most recently used now: stage still comes first
        await mgr.ensure("new.v1")
        assert loaded() == {"pinned.v1", "canary.v1", "prod.v1", "new.v1"}
        await mgr.ensure("new.v2")  # unregistered: default priority; canary goes next
        assert loaded() == {"pinned.v1", "prod.v1", "new.v1", "new.v2"}
        await mgr.ensure("new.v3")  # then production/default by LRU: prod.v1 is the oldest
        assert loaded() == {"pinned.v1", "new.v1", "new.v2", "new.v3"}
        assert mgr.get("pinned.v1").pinned

    run(go())


def test_canary_goes_before_production_and_promotion_updates_loaded_models(tmp_path):
    async def go():
        mgr, reg = staged_manager(tmp_path, slots=2)
        reg.on_stage_change(resident_priority_updater(mgr))
        await mgr.start()
        await mgr.ensure("canary.v1")
        await mgr.ensure("prod.v1")
        await mgr.ensure("canary.v1")  # canary most recently used
        await mgr.ensure("new.v1")
        ready = {m["model"] for m in mgr.status() if m["state"] == "ready"}
        assert ready == {"prod.v1", "new.v1"}  # canary went first despite recency
        # Promote the loaded prod to... retired (priority of shadow): it goes before new.v1.
        reg.promote("prod", 1, "retired", who="t")
        assert mgr.servers["s0"].planner.residents["prod.v1"].priority == 0
        await mgr.ensure("canary.v1")
        ready = {m["model"] for m in mgr.status() if m["state"] == "ready"}
        assert ready == {"new.v1", "canary.v1"}
        await asyncio.sleep(0)

    run(go())


def test_adopted_models_get_their_stage_priority(tmp_path):
    from control_plane.manager.records import ModelState
    from control_plane.registry import apply_stage_priorities

    mgr, reg = staged_manager(tmp_path, slots=4)
    planner = mgr.servers["s0"].planner
    for name in ("shadow.v1", "canary.v1", "prod.v1", "unregistered"):
        # As the reconcile adopts them, before their stage is known: the default priority.
        mgr.state.book.record(name).move(ModelState.READY, server="s0", memory_bytes=1)
    apply_stage_priorities(mgr, reg)
    assert {n: r.priority for n, r in planner.residents.items()} == {
        "shadow.v1": 0, "canary.v1": 1, "prod.v1": 2, "unregistered": 2}
