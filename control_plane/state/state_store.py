"""Durable control-plane state: pins, per-model history and a key-value table, in the
state store (an embedded SQLite file by default, a shared PostgreSQL with --state-url).

Small writes (a few hundred microseconds on local disk, about a millisecond to a
PostgreSQL on the network), but one that waits in the database (a lock, a slow disk) must
not stall the event loop: the manager and the admin API write through
``Database.off_loop``, in order, in the store's own thread.  What Triton has loaded is
*not* trusted from here: on start the manager reconciles with each server's index.
"""

from __future__ import annotations

import time
from pathlib import Path

from control_plane.state import Database, SqliteDatabase, migrate, open_database


class StateStore:
    """``StateStore(path)`` opens (and migrates) a SQLite file; ``StateStore(database)``
    uses an open ``Database`` (``control_plane.state.open_database``)."""

    def __init__(self, where: Path | Database):
        self.db = where if isinstance(where, Database) else open_database(Path(where))
        self.path = getattr(self.db, "path", None)
        migrate(self.db)

    def clone(self) -> StateStore:
        """The same store through another connection (for another thread)."""
        return StateStore(self.db.clone())

    def close(self) -> None:
        self.db.close()

    # pins
    def pins(self) -> set[str]:
        return {r[0] for r in self.db.execute("SELECT model FROM pins")}

    def set_pin(self, model: str, pinned: bool) -> None:
        if pinned:
            self.db.execute("INSERT INTO pins(model, pinned_at) VALUES (?, ?) "
                            "ON CONFLICT (model) DO NOTHING", (model, time.time()))
        else:
            self.db.execute("DELETE FROM pins WHERE model = ?", (model,))

    # per-model history shown by status (survives restarts)
    def model_rows(self) -> dict[str, dict]:
        cur = self.db.execute(
            "SELECT model, last_used, load_time_s, memory_bytes, server, failure FROM models"
        )
        cols = [c[0] for c in cur.description]
        return {row[0]: dict(zip(cols, row)) for row in cur}

    def save_model(self, model: str, **fields) -> None:
        allowed = {"last_used", "load_time_s", "memory_bytes", "server", "failure"}
        bad = set(fields) - allowed
        if bad:
            raise ValueError(f"unknown model fields: {sorted(bad)}")
        if not fields:
            self.db.execute("INSERT INTO models(model) VALUES (?) ON CONFLICT (model) DO NOTHING",
                            (model,))
            return
        names = ", ".join(fields)
        marks = ", ".join("?" for _ in fields)
        updates = ", ".join(f"{k} = excluded.{k}" for k in fields)
        self.db.execute(f"INSERT INTO models(model, {names}) VALUES (?, {marks}) "
                        f"ON CONFLICT (model) DO UPDATE SET {updates}", (model, *fields.values()))

    def save_models(self, rows: dict[str, dict]) -> None:
        """``save_model`` for each model of ``rows`` (model -> fields), in one transaction."""
        with self.db.transaction():
            for model, fields in rows.items():
                self.save_model(model, **fields)

    def get(self, key: str, default: str | None = None) -> str | None:
        row = self.db.execute("SELECT value FROM kv WHERE key = ?", (key,)).fetchone()
        return row[0] if row else default

    def put(self, key: str, value: str) -> None:
        self.db.execute("INSERT INTO kv(key, value) VALUES (?, ?) "
                        "ON CONFLICT (key) DO UPDATE SET value = excluded.value", (key, value))


__all__ = ["SqliteDatabase", "StateStore"]
