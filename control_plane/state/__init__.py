"""Durable state behind one interface (``database``), its versioned schema
(``migrations``) and leader election with fencing through it (``leader``)."""

from control_plane.state.database import (
    Database,
    Deposed,
    Fence,
    PostgresDatabase,
    SqliteDatabase,
    as_database,
    open_database,
    redact,
)
from control_plane.state.leader import LeaderLease
from control_plane.state.migrations import migrate

__all__ = ["Database", "Deposed", "Fence", "LeaderLease", "PostgresDatabase", "SqliteDatabase",
           "as_database", "migrate", "open_database", "redact"]
