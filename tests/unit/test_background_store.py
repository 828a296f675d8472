"""Route-table writes happen in their own thread: the serving loop never waits on SQLite."""

from __future__ import annotations

import json
import threading
import time

from control_plane.state.background import BackgroundStore
from control_plane.state.state_store import StateStore
from domain.routes import ROUTES_KEY, RouteTable


def test_route_table_writes_happen_in_the_writer_thread_even_while_the_db_is_locked(tmp_path):
    store = StateStore(tmp_path / "state.db")
    background = BackgroundStore(store)
    table = RouteTable(background)
    blocker = StateStore(tmp_path / "state.db")
    blocker.db.execute("BEGIN IMMEDIATE")  # another writer holds the database
    try:
        start = time.monotonic()
        table.set_shadow("m", "m2", 10)
        table.set_limit("m", 5)
        # Waiting on the lock would last until the COMMIT below (or SQLite's busy timeout):
        # a generous bound still tells the two apart on a busy machine.
        assert time.monotonic() - start < 2.0, "a save waited on SQLite on the calling thread"
        assert json.loads(background.get(ROUTES_KEY))[0]["shadow"]["model"] == "m2"
    finally:
        blocker.db.execute("COMMIT")
    assert background.flush(10)
    background.close()
    again = RouteTable(StateStore(tmp_path / "state.db"))
    assert again.routes["m"].shadow.model == "m2" and again.limits["m"]["qps"] == 5.0


def test_a_failed_write_is_retried_and_the_newest_value_wins(tmp_path, monkeypatch):
    from control_plane.state import background as state_writer

    monkeypatch.setattr(state_writer, "RETRY_PAUSE_S", 0.05)
    store = StateStore(tmp_path / "state.db")
    background = BackgroundStore(store)
    failures = [2]
    real_put = StateStore.put
    writers = set()

    def flaky_put(self, key, value):
        writers.add(threading.get_ident())
        if failures[0]:
            failures[0] -= 1
            raise OSError("disk full")
        real_put(self, key, value)

    monkeypatch.setattr(StateStore, "put", flaky_put)
    background.put("k", "v1")
    background.put("k", "v2")
    assert background.flush(10)
    background.put("k", "v3")
    assert background.flush(10)
    background.close()
    assert StateStore(tmp_path / "state.db").get("k") == "v3"
    assert failures == [0] and threading.get_ident() not in writers
