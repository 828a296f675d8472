"""Durable state behind one interface (``database``), its versioned schema
(``migrations``), leader election with fencing through it (``leader``), and what is kept
there: pins, history and keys (``state_store``), written off the loop (``background``)."""

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
