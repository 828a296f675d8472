"""Durable control-plane state in an embedded SQLite file (pins, per-model history).

Small writes, one connection, WAL mode; called from the event-loop thread (each write is a
few hundred microseconds on local disk, far below a model load).  What Triton has loaded
is *not* trusted from here: on start the manager reconciles with each server's index.
"""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path

SCHEMA = """
CREATE TABLE IF NOT EXISTS pins (
    model TEXT PRIMARY KEY,
    pinned_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS models (
    model TEXT PRIMARY KEY,
    last_used REAL,
    load_time_s REAL,
    memory_bytes INTEGER,
    server TEXT,
    failure TEXT
);
CREATE TABLE IF NOT EXISTS kv (
    key TEXT PRIMARY KEY,
    value TEXT NOT NULL
);
"""


class StateStore:
    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.db = sqlite3.connect(str(path), isolation_level=None, check_same_thread=False)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=NORMAL")
        self.db.executescript(SCHEMA)

    def close(self) -> None:
        self.db.close()

    # pins
    def pins(self) -> set[str]:
        return {r[0] for r in self.db.execute("SELECT model FROM pins")}

    def set_pin(self, model: str, pinned: bool) -> None:
        if pinned:
            self.db.execute(
                "INSERT OR IGNORE INTO pins(model, pinned_at) VALUES (?, ?)", (model, time.time())
            )
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
        self.db.execute("INSERT OR IGNORE INTO models(model) VALUES (?)", (model,))
        if fields:
            assignments = ", ".join(f"{k} = ?" for k in fields)
            self.db.execute(
                f"UPDATE models SET {assignments} WHERE model = ?", (*fields.values(), model)
            )

    def get(self, key: str, default: str | None = None) -> str | None:
        row = self.db.execute("SELECT value FROM kv WHERE key = ?", (key,)).fetchone()
        return row[0] if row else default

    def put(self, key: str, value: str) -> None:
        self.db.execute("INSERT OR REPLACE INTO kv(key, value) VALUES (?, ?)", (key, value))
