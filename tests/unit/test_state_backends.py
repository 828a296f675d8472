"""The state interface on SQLite: versioned migrations, the leader lease and its fence.
(The same code on a real PostgreSQL: tests/integration/test_state_postgres.py.)"""

from __future__ import annotations

import pytest

from control_plane.state import Deposed, LeaderLease, SqliteDatabase, migrate, open_database
from control_plane.state.migrations import LATEST_VERSION, applied_versions
from control_plane.state.state_store import StateStore
from domain.errors import InvalidInput


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def expire(db, name: str = "control-plane") -> None:
    """The lease runs out (as if its holder had stopped renewing long ago)."""
    db.execute("UPDATE leader_lease SET expires_at = 0 WHERE name = ?", (name,))


def test_migrations_are_recorded_once_and_a_newer_schema_is_refused(tmp_path):
    db = open_database(f"sqlite:///{tmp_path / 'state.db'}")
    assert migrate(db) == list(range(1, LATEST_VERSION + 1))
    assert applied_versions(db) == set(range(1, LATEST_VERSION + 1))
    assert migrate(db) == []
    assert migrate(open_database(f"sqlite:///{tmp_path / 'state.db'}")) == []  # recorded
    db.execute("INSERT INTO schema_migrations(version, name, applied_at) VALUES (?, 'x', 0)",
               (LATEST_VERSION + 1,))
    with pytest.raises(InvalidInput, match="newer than this release"):  # as an older release opens it
        migrate(open_database(f"sqlite:///{tmp_path / 'state.db'}"))


def test_open_database_explains_a_bad_url(tmp_path):
    with pytest.raises(InvalidInput, match="unknown scheme 'mysql'"):
        open_database("mysql://u:secret@h/db")
    with pytest.raises(InvalidInput) as err:
        open_database("postgresql://user:hunter2@127.0.0.1:1/none", connect_timeout_s=0.5)
    assert "hunter2" not in err.value.message and "***" in err.value.message


def test_one_leader_at_a_time_and_the_next_gets_a_higher_token(tmp_path):
    db = SqliteDatabase(tmp_path / "state.db")
    migrate(db)
    clock = Clock()
    a = LeaderLease(db, identity="a", ttl_s=5, clock=clock)
    b = LeaderLease(db.clone(), identity="b", ttl_s=5, clock=clock)
    first = a.try_acquire()
    assert first is not None and a.holds()
    assert b.try_acquire() is None  # a's lease runs
    assert a.renew()
    assert b.current().holder == "a"
    expire(db)
    second = b.try_acquire()
    assert second == first + 1
    assert not a.renew()  # a is deposed: it learns so at its next renewal
    clock.now += 5.1
    assert not a.holds()  # and stops acting when its lease could have run out


def test_a_deposed_leaders_writes_change_nothing(tmp_path):
    store = StateStore(tmp_path / "state.db")
    lease_a = LeaderLease(store.db, identity="a", ttl_s=5)
    lease_a.try_acquire()
    store.db.fence = lease_a.fence()
    store.set_pin("cust001", True)  # the leader writes
    other = StateStore(store.db.clone())
    other.db.fence = None
    expire(other.db)
    lease_b = LeaderLease(other.db, identity="b", ttl_s=5)
    assert lease_b.try_acquire() is not None
    other.db.fence = lease_b.fence()
    with pytest.raises(Deposed, match="taken over"):
        store.set_pin("cust002", True)
    with pytest.raises(Deposed):
        store.put("routes", "[]")
    with pytest.raises(Deposed), store.db.transaction():
        store.db.execute("DELETE FROM pins")
    assert other.pins() == {"cust001"} and other.get("routes") is None
    other.set_pin("cust003", True)  # the new leader writes
    assert other.pins() == {"cust001", "cust003"}


def test_release_lets_a_standby_take_over_at_once(tmp_path):
    db = SqliteDatabase(tmp_path / "state.db")
    migrate(db)
    a = LeaderLease(db, identity="a", ttl_s=60)
    b = LeaderLease(db, identity="b", ttl_s=60)
    assert a.try_acquire() is not None and b.try_acquire() is None
    a.release()
    assert b.current() is None
    assert b.try_acquire() is not None and b.current().holder == "b"


def test_upserts_keep_other_columns(tmp_path):
    store = StateStore(tmp_path / "state.db")
    store.save_model("m", last_used=1.0, server="s0")
    store.save_model("m", load_time_s=2.5)
    assert store.model_rows()["m"] == {"model": "m", "last_used": 1.0, "load_time_s": 2.5,
                                            "memory_bytes": None, "server": "s0", "failure": None}
    store.put("k", "1")
    store.put("k", "2")
    assert store.get("k") == "2"


def test_a_write_from_another_thread_never_lands_inside_a_transaction(tmp_path):
    """The loop's thread and the state store's thread (Database.off_loop) share SQLite's one
    connection: a statement of one waits for the other's transaction instead of joining it
    (and being rolled back with it)."""
    import threading

    store = StateStore(tmp_path / "state.db")
    inside = threading.Event()
    wrote = threading.Event()

    def failing_transaction():
        with pytest.raises(RuntimeError), store.db.transaction():
            store.set_pin("in-the-transaction", True)
            inside.set()
            wrote.wait(0.5)  # the other thread's write, had it not waited, would be in here
            raise RuntimeError("rolled back")

    thread = threading.Thread(target=failing_transaction)
    thread.start()
    assert inside.wait(10)
    writer = threading.Thread(target=lambda: (store.set_pin("on-its-own", True), wrote.set()))
    writer.start()
    thread.join(10)
    writer.join(10)
    assert store.pins() == {"on-its-own"}
    store.close()
