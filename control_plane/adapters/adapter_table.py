"""The durable record of adapters: the ``adapters`` table in the control plane's state store."""

from __future__ import annotations

import sqlite3
from collections.abc import Mapping

from control_plane.state import Database, as_database, migrate


class AdapterStore:
    """The ``adapters`` table in the control plane's state store (event-loop thread)."""

    COLUMNS = ("base", "name", "label", "uri", "sha256", "rank", "bytes", "pinned", "added_at",
               "added_by", "last_used")

    def __init__(self, db: Database | sqlite3.Connection):
        self.db = as_database(db)
        migrate(self.db)  # a no-op where the state store already migrated it

    def rows(self, base: str | None = None) -> list[dict]:
        sql = f"SELECT {', '.join(self.COLUMNS)} FROM adapters"
        cur = self.db.execute(sql + (" WHERE base = ? ORDER BY name" if base else " ORDER BY base, name"),
                              (base,) if base else ())
        return [self._row(r) for r in cur]

    def get(self, base: str, name: str) -> dict | None:
        cur = self.db.execute(f"SELECT {', '.join(self.COLUMNS)} FROM adapters WHERE base = ? AND name = ?",
                              (base, name))
        row = cur.fetchone()
        return self._row(row) if row else None

    def _row(self, values) -> dict:
        row = dict(zip(self.COLUMNS, values))
        row["pinned"] = bool(row["pinned"])
        return row

    def put(self, base: str, name: str, *, label: str | None, uri: str | None, sha256: str | None,
            rank: int | None, nbytes: int | None, added_by: str | None, added_at: float,
            pinned: bool = False) -> None:
        self.db.execute(
            "INSERT INTO adapters(base, name, label, uri, sha256, rank, bytes, pinned, added_at, "
            "added_by) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT (base, name) DO UPDATE "
            "SET label = excluded.label, uri = excluded.uri, sha256 = excluded.sha256, "
            "rank = excluded.rank, bytes = excluded.bytes, pinned = excluded.pinned, "
            "added_at = excluded.added_at, added_by = excluded.added_by",
            (base, name, label, uri, sha256, rank, nbytes, int(pinned), added_at, added_by))

    def set_pinned(self, base: str, name: str, pinned: bool, now: float) -> None:
        if self.get(base, name) is None:  # an adapter found in the directory: registered now
            self.put(base, name, label=None, uri=None, sha256=None, rank=None, nbytes=None,
                     added_by=None, added_at=now, pinned=pinned)
        else:
            self.db.execute("UPDATE adapters SET pinned = ? WHERE base = ? AND name = ?",
                            (int(pinned), base, name))

    def touch(self, base: str, used: Mapping[str, float]) -> None:
        for name, when in used.items():
            self.db.execute("UPDATE adapters SET last_used = ? WHERE base = ? AND name = ? "
                            "AND (last_used IS NULL OR last_used < ?)", (when, base, name, when))

    def delete(self, base: str, name: str) -> None:
        self.db.execute("DELETE FROM adapters WHERE base = ? AND name = ?", (base, name))

