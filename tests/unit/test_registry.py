"""Registry: versions, rollout stages with who/when, production per logical name."""

from __future__ import annotations

import pytest

from control_plane.errors import InvalidInput, InvalidModelName, ModelNotFound
from control_plane.eviction import DEFAULT_PRIORITY, STAGE_PRIORITY
from control_plane.names import validate_model_name
from control_plane.registry import Registry, concrete_name, parse_concrete, parse_metrics
from control_plane.state_store import StateStore

SHA = "ab" * 32


class Clock:
    def __init__(self, now: float = 1000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def reg(tmp_path):
    store = StateStore(tmp_path / "state.db")
    clock = Clock()
    registry = Registry(store.db, clock=clock)
    registry.test_clock = clock
    yield registry
    store.close()


def add(reg, model="cust017", version=1, **kw):
    kw.setdefault("who", "alice")
    return reg.add(model, version, f"s3://models/{model}/{version}/", SHA, 1234, **kw)


def test_concrete_names_round_trip_and_pass_name_validation():
    assert concrete_name("cust017", 3) == "cust017.v3"
    assert validate_model_name("cust017.v3") == "cust017.v3"
    assert parse_concrete("cust017.v3") == ("cust017", 3)
    assert parse_concrete("a.v1.v2") == ("a.v1", 2)
    assert parse_concrete("cust017") is None
    with pytest.raises(InvalidModelName):
        concrete_name("../x", 1)


def test_add_records_everything_and_history(reg):
    mv = add(reg, metrics={"auc": 0.781}, data_fingerprint="sha256:" + "c" * 64, sla="gold",
             tenant="acme")
    assert (mv.name, mv.stage, mv.sla, mv.tenant, mv.size_bytes) == ("cust017.v1", "registered", "gold", "acme", 1234)
    assert mv.metrics == {"auc": 0.781} and mv.data_fingerprint.startswith("sha256:")
    assert (mv.created_by, mv.created_at) == ("alice", 1000.0)
    [h] = reg.history("cust017")
    assert (h.from_stage, h.to_stage, h.who, h.at) == (None, "registered", "alice", 1000.0)


def test_stage_changes_are_recorded_with_who_and_when(reg):
    add(reg)
    reg.test_clock.now = 2000.0
    reg.promote("cust017", 1, "shadow", who="bob")
    reg.test_clock.now = 3000.0
    mv = reg.promote("cust017", 1, "canary", who="carol", note="shadow looked fine")
    assert (mv.stage, mv.stage_changed_by, mv.stage_changed_at) == ("canary", "carol", 3000.0)
    steps = [(h.from_stage, h.to_stage, h.who, h.at, h.note) for h in reg.history("cust017", 1)]
    assert steps == [
        (None, "registered", "alice", 1000.0, "registered"),
        ("registered", "shadow", "bob", 2000.0, None),
        ("shadow", "canary", "carol", 3000.0, "shadow looked fine"),
    ]
    # Promoting to the stage it is in changes nothing.
    reg.promote("cust017", 1, "canary", who="dave")
    assert len(reg.history("cust017")) == 3


def test_one_production_version_per_model(reg):
    add(reg, version=1)
    add(reg, version=2)
    add(reg, model="cust018", version=1, stage="production")
    reg.promote("cust017", 1, "production", who="alice")
    assert reg.production("cust017").version == 1
    assert reg.resolve("cust017").name == "cust017.v1"
    reg.promote("cust017", 2, "production", who="bob")
    assert reg.production("cust017").version == 2
    assert reg.get("cust017", 1).stage == "retired"
    retire = next(h for h in reg.history("cust017", 1) if h.to_stage == "retired")
    assert (retire.who, retire.note) == ("bob", "replaced by v2")
    assert reg.production("cust018").version == 1  # other models untouched
    assert "cust017.v1" not in reg.concrete_names()
    assert "cust017.v1" in reg.concrete_names(include_retired=True)


def test_stage_priority_feeds_eviction(reg):
    add(reg, version=1)
    add(reg, version=2)
    add(reg, version=3)
    reg.promote("cust017", 1, "shadow", who="a")
    reg.promote("cust017", 2, "canary", who="a")
    reg.promote("cust017", 3, "production", who="a")
    prio = [reg.stage_priority(f"cust017.v{v}") for v in (1, 2, 3)]
    assert prio == [STAGE_PRIORITY["shadow"], STAGE_PRIORITY["canary"], STAGE_PRIORITY["production"]]
    assert prio[0] < prio[1] < prio[2]
    assert reg.stage_priority("unregistered") == DEFAULT_PRIORITY


def test_listeners_hear_each_change_including_the_retired_one(reg):
    heard = []
    reg.on_stage_change(lambda name, stage: heard.append((name, stage)))
    add(reg, version=1, stage="production")
    add(reg, version=2)
    reg.promote("cust017", 2, "production", who="a")
    assert heard == [("cust017.v1", "production"), ("cust017.v2", "registered"),
                     ("cust017.v1", "retired"), ("cust017.v2", "production")]


@pytest.mark.parametrize("kwargs, message", [
    ({"version": 0}, "must be >= 1"),
    ({"sla": "platinum"}, "SLA class 'platinum' is unknown"),
    ({"stage": "retired"}, "initial stage"),
    ({"who": " "}, "say who made the change"),
    ({"model": "cust017.v2"}, "reserved for versions"),
])
def test_bad_registrations_say_what_to_do(reg, kwargs, message):
    with pytest.raises(InvalidInput, match=message):
        add(reg, **kwargs)


def test_versions_are_immutable_and_unknown_ones_not_found(reg):
    add(reg)
    with pytest.raises(InvalidInput, match="already registered"):
        add(reg)
    with pytest.raises(ModelNotFound, match=r"known versions: \[1\]"):
        reg.promote("cust017", 9, "canary", who="a")
    with pytest.raises(InvalidInput, match="stage 'gold' is unknown"):
        reg.promote("cust017", 1, "gold", who="a")


def test_a_failed_change_leaves_nothing_half_done(reg):
    add(reg, version=1, stage="production")
    add(reg, version=2)

    def boom(*_a):
        raise RuntimeError("disk full")

    real = reg.db
    calls = []

    class Db:  # fail the UPDATE of the new version, after the old one was retired
        def execute(self, sql, *args):
            if sql.startswith("UPDATE registry_versions SET stage = ?"):
                calls.append(sql)
                boom()
            return real.execute(sql, *args)

    reg.db = Db()
    with pytest.raises(RuntimeError):
        reg.promote("cust017", 2, "production", who="a")
    reg.db = real
    assert calls and reg.production("cust017").version == 1
    assert [h.to_stage for h in reg.history("cust017")] == ["production", "registered"]


def test_memory_and_state_survive_a_restart(tmp_path):
    store = StateStore(tmp_path / "state.db")
    reg = Registry(store.db)
    add(reg, stage="canary")
    reg.record_memory("cust017.v1", 5_000_000)
    store.close()
    store = StateStore(tmp_path / "state.db")
    mv = Registry(store.db).get("cust017", 1)
    assert (mv.stage, mv.memory_bytes) == ("canary", 5_000_000)
    store.close()


def test_parse_metrics():
    assert parse_metrics(["auc=0.781", " ndcg = 0.5"]) == {"auc": 0.781, "ndcg": 0.5}
    with pytest.raises(InvalidInput, match="name=number"):
        parse_metrics(["auc"])
    with pytest.raises(InvalidInput, match="name=number"):
        parse_metrics(["auc=high"])
