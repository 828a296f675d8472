"""The state stores on a real PostgreSQL (pgserver): the same registry, adapters, pins and
key-value table as on SQLite, migrations that two control planes can race, and the leader
lease with its fence."""

from __future__ import annotations

import threading

import pytest

from control_plane.adapters import AdapterStore
from control_plane.registry import Registry
from control_plane.state import Deposed, LeaderLease, PostgresDatabase, migrate, open_database
from control_plane.state.migrations import LATEST_VERSION, applied_versions
from control_plane.state.state_store import StateStore

pytestmark = pytest.mark.integration

SHA = "a" * 64


def test_two_control_planes_migrating_at_once_apply_each_version_once(postgres_url):
    dbs = [open_database(postgres_url) for _ in range(2)]
    applied: list[list[int]] = []
    threads = [threading.Thread(target=lambda d=d: applied.append(migrate(d))) for d in dbs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert sorted(applied, key=len) == [[], list(range(1, LATEST_VERSION + 1))]
    assert applied_versions(dbs[0]) == set(range(1, LATEST_VERSION + 1))
    for db in dbs:
        db.close()


def test_registry_pins_adapters_and_kv_survive_a_new_connection(postgres_url):
    store = StateStore(open_database(postgres_url))
    assert isinstance(store.db, PostgresDatabase)
    reg = Registry(store.db, clock=lambda: 1_700_000_000.123456)
    reg.add("cust017", 1, artifact_uri="s3://m/cust017/1/", sha256=SHA, size_bytes=10,
            who="alice", stage="production")
    reg.add("cust017", 2, artifact_uri="s3://m/cust017/2/", sha256=SHA, size_bytes=12,
            who="alice")
    reg.promote("cust017", 2, "production", who="bob", note="better")
    reg.record_memory("cust017.v2", 5 << 30)  # above 2**31: BIGINT
    store.set_pin("cust017.v2", True)
    store.set_pin("cust017.v2", True)  # twice: still one pin
    store.put("routes", '[{"name": "a"}]')
    store.put("routes", "[]")
    store.save_model("cust017.v2", last_used=1_700_000_000.5, server="node-a")
    adapters = AdapterStore(store.db)
    adapters.put("base", "tone", label="t", uri="s3://a/", sha256=SHA, rank=8, nbytes=1 << 20,
                 added_by="alice", added_at=5.0)
    adapters.touch("base", {"tone": 9.0})
    adapters.put("base", "tone", label="t2", uri="s3://a/", sha256=SHA, rank=8, nbytes=1 << 20,
                 added_by="alice", added_at=6.0)  # replacing keeps last_used
    store.close()

    again = StateStore(open_database(postgres_url))
    reg = Registry(again.db)
    assert reg.production("cust017").version == 2
    assert reg.get("cust017", 1).stage == "retired"
    assert reg.get("cust017", 2).memory_bytes == 5 << 30
    assert reg.get("cust017", 1).created_at == 1_700_000_000.123456  # double precision
    assert [h.to_stage for h in reg.history("cust017")][-2:] == ["retired", "production"]
    assert again.pins() == {"cust017.v2"} and again.get("routes") == "[]"
    assert again.model_rows()["cust017.v2"]["server"] == "node-a"
    row = AdapterStore(again.db).get("base", "tone")
    assert (row["label"], row["last_used"], row["pinned"]) == ("t2", 9.0, False)
    again.close()


def test_a_database_made_without_an_encoding_gives_text_back_as_text(postgres_server):
    """A database created as SQL_ASCII (initdb without a UTF-8 locale, as in a bare
    container) makes psycopg hand text columns back as bytes unless the connection names
    its encoding; bytes in a registry row broke every JSON answer of the admin API."""
    import psycopg

    with psycopg.connect(postgres_server.get_uri(), autocommit=True) as conn:
        conn.execute('DROP DATABASE IF EXISTS "ascii_state"')
        conn.execute("CREATE DATABASE ascii_state ENCODING 'SQL_ASCII' LC_COLLATE 'C' "
                     "LC_CTYPE 'C' TEMPLATE template0")
    store = StateStore(open_database(postgres_server.get_uri("ascii_state")))
    try:
        reg = Registry(store.db, clock=lambda: 1_700_000_000.0)
        reg.add("cust017", 1, artifact_uri="s3://m/cust017/1/", sha256=SHA, size_bytes=10,
                who="ops", stage="production")
        (version,) = reg.versions("cust017")
        assert (version.artifact_uri, version.created_by, version.stage) == (
            "s3://m/cust017/1/", "ops", "production")
        assert all(not isinstance(v, bytes) for v in vars(version).values())
    finally:
        store.db.close()


def test_a_failed_registry_change_leaves_nothing_half_done(postgres_url):
    store = StateStore(open_database(postgres_url))
    reg = Registry(store.db)
    reg.add("m", 1, artifact_uri="s3://m/1/", sha256=SHA, size_bytes=1, who="a", stage="production")
    with pytest.raises(Exception), store.db.transaction():  # noqa: B017
        store.db.execute("UPDATE registry_versions SET stage = 'retired' WHERE model = 'm'")
        store.db.execute("INSERT INTO no_such_table VALUES (1)")
    assert reg.production("m").version == 1
    store.close()


def test_lease_and_fence_on_postgres(postgres_url):
    a_store = StateStore(open_database(postgres_url))
    b_store = StateStore(open_database(postgres_url))
    a = LeaderLease(a_store.db, identity="a", address="http://a:8090", ttl_s=0.6)
    b = LeaderLease(b_store.db, identity="b", ttl_s=0.6)
    token = a.try_acquire()
    assert token is not None and b.try_acquire() is None
    assert b.current().holder == "a" and b.current().address == "http://a:8090"
    a_store.db.fence = a.fence()
    a_store.set_pin("kept", True)
    # a stops renewing (paused, partitioned): the database's clock runs its lease out
    import time

    time.sleep(0.8)
    assert b.try_acquire() == token + 1
    b_store.db.fence = b.fence()
    with pytest.raises(Deposed):
        a_store.set_pin("late", True)
    assert not a.renew()
    b_store.set_pin("new", True)
    assert b_store.pins() == {"kept", "new"}
    a_store.close()
    b_store.close()
