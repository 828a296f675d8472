"""Registry: versions, rollout stages with who/when, production per logical name."""

from __future__ import annotations

import pytest

from control_plane.eviction import DEFAULT_PRIORITY, STAGE_PRIORITY
from control_plane.registry import (
    Registry,
    concrete_name,
    parse_concrete,
    parse_metrics,
    register_repository,
)
from control_plane.registry.repository import WARM_MANIFEST as _WARM_MANIFEST
from control_plane.state.state_store import StateStore
from control_plane.tiers.cold import folder_sha256
from control_plane.tiers.warm import WARM_MANIFEST
from domain.errors import InvalidInput, InvalidModelName, ModelNotFound
from domain.names import validate_model_name

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

        def transaction(self):
            return real.transaction()

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


def test_metrics_are_parsed_as_name_equals_number_and_anything_else_refused():
    assert parse_metrics(["auc=0.781", " ndcg = 0.5"]) == {"auc": 0.781, "ndcg": 0.5}
    with pytest.raises(InvalidInput, match="name=number"):
        parse_metrics(["auc"])
    with pytest.raises(InvalidInput, match="name=number"):
        parse_metrics(["auc=high"])


# -- one catalogue: concrete names of their own, the repository's folders, logical names ------
# The registry's tables as releases before versioned migrations created them (with both
# columns that later releases added; each migration test removes the one it is about).
RELEASE_1_SCHEMA = """
CREATE TABLE IF NOT EXISTS registry_versions (
    model TEXT NOT NULL,
    version INTEGER NOT NULL,
    artifact_uri TEXT NOT NULL,
    sha256 TEXT NOT NULL,
    size_bytes INTEGER NOT NULL,
    memory_bytes INTEGER,
    data_fingerprint TEXT,
    metrics TEXT NOT NULL DEFAULT '{}',
    sla TEXT NOT NULL,
    tenant TEXT,
    stage TEXT NOT NULL,
    created_at REAL NOT NULL,
    created_by TEXT NOT NULL,
    stage_changed_at REAL NOT NULL,
    stage_changed_by TEXT NOT NULL,
    triton_name TEXT,
    synthetic_warmup INTEGER NOT NULL DEFAULT 1,
    PRIMARY KEY (model, version)
);
CREATE TABLE IF NOT EXISTS registry_history (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    model TEXT NOT NULL,
    version INTEGER NOT NULL,
    from_stage TEXT,
    to_stage TEXT NOT NULL,
    who TEXT NOT NULL,
    at REAL NOT NULL,
    note TEXT
);
"""


def make_model_folder(repo, name, text="w"):
    folder = repo / name
    (folder / "1").mkdir(parents=True)
    (folder / "config.pbtxt").write_text(f'name: "{name}"\nbackend: "python"\n')
    (folder / "1" / "model.py").write_text(text)
    return folder


def test_a_state_file_from_before_concrete_names_is_migrated(tmp_path):
    import sqlite3

    db = sqlite3.connect(tmp_path / "state.db", isolation_level=None)
    old_schema = RELEASE_1_SCHEMA.replace("    triton_name TEXT,\n", "")
    assert "triton_name" not in old_schema
    db.executescript(old_schema)
    db.execute("INSERT INTO registry_versions (model, version, artifact_uri, sha256, size_bytes, sla, "
               "stage, created_at, created_by, stage_changed_at, stage_changed_by) VALUES "
               "('cust017', 3, 's3://m/cust017/3/', ?, 10, 'silver', 'production', 1, 'a', 1, 'a')", (SHA,))
    db.close()
    for _ in range(2):  # and opening it again changes nothing
        store = StateStore(tmp_path / "state.db")
        reg = Registry(store.db)
        mv = reg.get("cust017", 3)
        assert mv.name == mv.triton_name == "cust017.v3"
        assert reg.by_name("cust017.v3") == mv and reg.resolve_name("cust017") == "cust017.v3"
        store.close()


def test_a_version_keeps_its_own_concrete_name(reg):
    heard = []
    reg.on_stage_change(lambda name, stage: heard.append((name, stage)))
    add(reg, version=1, stage="production", triton_name="cust017")
    add(reg, version=2, triton_name="cust017-v2")
    add(reg, version=3)
    assert [v.name for v in reg.versions("cust017")] == ["cust017", "cust017-v2", "cust017.v3"]
    assert reg.by_name("cust017-v2").version == 2 and reg.by_name("cust017.v2") is None
    assert reg.concrete_names() == {"cust017", "cust017-v2", "cust017.v3"}
    reg.record_memory("cust017-v2", 42)
    assert reg.get("cust017", 2).memory_bytes == 42
    reg.promote("cust017", 2, "canary", who="a")
    assert reg.stage_priority("cust017-v2") == STAGE_PRIORITY["canary"]
    assert heard[-1] == ("cust017-v2", "canary")
    assert reg.get("cust017", 2).to_dict()["name"] == "cust017-v2"


def test_logical_names_resolve_to_production_like_the_router(reg):
    add(reg, version=1, stage="production", triton_name="cust017")
    add(reg, version=2, triton_name="cust017-v2")
    add(reg, model="simple", version=1, stage="production")
    assert reg.resolve_name("simple") == "simple.v1"
    assert reg.resolve_name("simple.v1") == "simple.v1"  # a concrete name stays
    assert reg.resolve_name("cust017-v2") == "cust017-v2"
    assert reg.resolve_name("not-registered") == "not-registered"  # the manager decides
    reg.promote("cust017", 2, "production", who="a")
    # Logical first: "cust017" now means version 2, though version 1's folder is "cust017".
    assert reg.resolve_name("cust017") == "cust017-v2"
    reg.promote("simple", 1, "retired", who="a")
    with pytest.raises(ModelNotFound, match=r"simple has no production version.*simple.v1 \(retired\)"
                                            r".*mmctl registry promote simple --version 1"):
        reg.resolve_name("simple")


def test_next_version_counts_retired_ones(reg):
    assert reg.next_version("cust017") == 1
    add(reg, version=1)
    add(reg, version=4)
    reg.promote("cust017", 4, "retired", who="a")
    assert reg.next_version("cust017") == 5


@pytest.mark.parametrize("first, second, message", [
    # a concrete name means one version
    ({"model": "a", "triton_name": "shared"}, {"model": "b", "triton_name": "shared"},
     "shared is already the name of a version 1"),
    # a model's version's name cannot be a model of its own, nor the other way round
    ({"model": "cust017", "triton_name": "cust017-v2"}, {"model": "cust017-v2"},
     "cust017-v2 is already the name of cust017 version 1"),
    ({"model": "cust018"}, {"model": "cust017", "version": 2, "triton_name": "cust018"},
     "cust018 is already a model of its own"),
])
def test_names_mean_one_thing(reg, first, second, message):
    add(reg, **first)
    with pytest.raises(InvalidInput, match=message):
        add(reg, **second)


def test_register_repository_registers_every_folder_once(tmp_path, reg):
    repo = tmp_path / "repo"
    for name in ("cust001", "cust017", "cust017-v2", "cust017-faulty", "identity", "foo.v2"):
        make_model_folder(repo, name)
    (repo / ".cust002.tmp").mkdir()  # half-written: skipped
    (repo / "notes").mkdir()  # no config.pbtxt: skipped
    make_model_folder(repo, "staged.v1")
    (repo / "staged.v1" / WARM_MANIFEST).write_text("{}")  # the warm tier's copy: skipped
    versions = {"cust017-v2": ("cust017", 2), "cust017-faulty": ("cust017", 4)}

    added = register_repository(reg, repo, versions=versions)
    rows = {v.name: (v.model, v.version, v.stage) for v in reg.versions()}
    assert rows == {
        "cust001": ("cust001", 1, "production"),
        "cust017": ("cust017", 1, "production"),
        "cust017-v2": ("cust017", 2, "registered"),
        "cust017-faulty": ("cust017", 4, "registered"),
        "identity": ("identity", 1, "production"),
        "foo.v2": ("foo", 2, "registered"),
    }
    assert {mv.name for mv in added} == set(rows)
    mv = reg.by_name("cust017-v2")
    assert mv.in_repository and mv.artifact_uri == "repository://cust017-v2/"
    assert mv.sha256 == folder_sha256(repo / "cust017-v2") and mv.created_by == "mmctl up"
    assert reg.resolve_name("cust017") == "cust017"

    # Restart: nothing new, nothing changed; a folder added meanwhile is picked up.
    assert register_repository(reg, repo, versions=versions) == []
    make_model_folder(repo, "cust017-v3")
    [mv] = register_repository(reg, repo, versions={**versions, "cust017-v3": ("cust017", 3)})
    assert (mv.name, mv.model, mv.version, mv.stage) == ("cust017-v3", "cust017", 3, "registered")


def test_register_repository_takes_the_next_version_when_one_is_taken(tmp_path, reg):
    add(reg, model="cust017", version=1, stage="production")  # registered earlier from the cold store
    make_model_folder(tmp_path / "repo", "cust017")
    [mv] = register_repository(reg, tmp_path / "repo")
    assert (mv.name, mv.version, mv.stage) == ("cust017", 2, "registered")
    assert reg.resolve_name("cust017") == "cust017.v1"


def test_demo_versions_name_the_demo_variants():
    from control_plane.demo.fleet import DEMO_VARIANTS, DEMO_VERSIONS

    assert {name for name, _params in DEMO_VARIANTS} == set(DEMO_VERSIONS)
    assert _WARM_MANIFEST == WARM_MANIFEST


def test_synthetic_warmup_is_a_per_version_switch(reg):
    add(reg, version=1)
    add(reg, version=2, synthetic_warmup=False)
    assert reg.warmup_enabled("cust017.v1") is True
    assert reg.warmup_enabled("cust017.v2") is False
    assert reg.warmup_enabled("not-registered") is True  # the manager's default
    assert reg.set_synthetic_warmup("cust017", 1, False).synthetic_warmup is False
    assert reg.warmup_enabled("cust017.v1") is False
    reg.set_synthetic_warmup("cust017", 2, True)
    assert reg.warmup_enabled("cust017.v2") is True
    with pytest.raises(ModelNotFound):
        reg.set_synthetic_warmup("cust017", 9, False)


def test_a_state_file_from_before_the_warmup_switch_is_migrated(tmp_path):
    import sqlite3

    db = sqlite3.connect(tmp_path / "state.db", isolation_level=None)
    old_schema = RELEASE_1_SCHEMA.replace("    synthetic_warmup INTEGER NOT NULL DEFAULT 1,\n", "")
    assert "synthetic_warmup" not in old_schema
    db.executescript(old_schema)
    db.execute("INSERT INTO registry_versions (model, version, artifact_uri, sha256, size_bytes, sla, "
               "stage, created_at, created_by, stage_changed_at, stage_changed_by, triton_name) VALUES "
               "('cust017', 3, 's3://m/cust017/3/', ?, 10, 'silver', 'production', 1, 'a', 1, 'a', "
               "'cust017.v3')", (SHA,))
    db.close()
    store = StateStore(tmp_path / "state.db")
    reg = Registry(store.db)
    assert reg.get("cust017", 3).synthetic_warmup is True and reg.warmup_enabled("cust017.v3")
    store.close()


def test_by_name_answers_from_memory_and_every_change_is_seen(reg):
    """A miss asks for its version several times (warm tier, eviction priority, placement):
    from memory after the first, and never stale after a change, failed ones included."""
    add(reg, version=1)
    add(reg, version=2)
    real, reads = reg.db, []

    class Counting:
        def execute(self, sql, *args):
            if sql.startswith("SELECT") and "triton_name = ?" in sql:
                reads.append(args)
            return real.execute(sql, *args)

        def transaction(self):
            return real.transaction()

    reg.db = Counting()
    for _ in range(5):
        assert reg.by_name("cust017.v2").stage == "registered"
        assert reg.stage_priority("cust017.v2") == STAGE_PRIORITY["registered"]
        assert reg.by_name("unregistered") is None
    assert len(reads) == 2  # once for each name
    reg.promote("cust017", 2, "production", who="a")
    assert reg.by_name("cust017.v2").stage == "production"
    assert reg.stage_priority("cust017.v2") == STAGE_PRIORITY["production"]
    reg.set_synthetic_warmup("cust017", 2, False)
    assert reg.warmup_enabled("cust017.v2") is False and reg.warmup_enabled("cust017.v1") is True
    add(reg, model="unregistered", version=1, triton_name="unregistered")
    assert reg.by_name("unregistered").model == "unregistered"
    reg.db = real


def test_a_read_that_raced_a_write_is_not_remembered(reg):
    add(reg, version=1)
    real = reg.db

    class WriteDuringRead:  # the state store's thread commits a change while this reads
        def execute(self, sql, *args):
            rows = real.execute(sql, *args)
            if sql.startswith("SELECT") and "triton_name = ?" in sql:
                reg.db = real
                reg.promote("cust017", 1, "canary", who="a")
            return rows

        def transaction(self):
            return real.transaction()

    reg.db = WriteDuringRead()
    assert reg.by_name("cust017.v1").stage == "registered"  # read before the change
    assert reg.by_name("cust017.v1").stage == "canary"  # not the answer read before it
