"""Recency: when each model was last used, which the eviction policy orders by."""

from __future__ import annotations

from collections.abc import Callable

from control_plane.manager.fleet_state import ModelBook
from control_plane.manager.records import TritonServer


class Recency:
    def __init__(self, book: ModelBook, servers: dict[str, TritonServer],
                 clock: Callable[[], float]):
        self.book = book
        self.servers = servers
        self.clock = clock

    def touch(self, name: str) -> None:
        """``name`` was used now (a request for it)."""
        rec = self.book.records.get(name)
        if rec is None:
            return
        rec.last_used = self.clock()
        if rec.server is not None and rec.server in self.servers:
            self.servers[rec.server].planner.touch(name, rec.last_used)
        for where, copy in rec.extra.items():  # as recent (the policy orders them too)
            if where in self.servers and copy.name in self.servers[where].planner.residents:
                self.servers[where].planner.touch(copy.name, rec.last_used)

    async def refresh_usage(self, server: TritonServer) -> None:
        """Refresh recency from Triton's statistics: inferences sent straight to Triton count."""
        stats = await server.admin.statistics()
        seen = []
        for name, s in stats.items():
            rec = self.book.records.get(name)
            last_ms = int(s.get("last_inference", 0) or 0)
            if rec is None or rec.server != server.name or last_ms <= rec.last_inference_ms:
                continue
            rec.last_inference_ms = last_ms
            seen.append((last_ms, name))
        for last_ms, name in sorted(seen):
            rec = self.book.records[name]
            when = last_ms / 1000.0
            if rec.last_used is None or when > rec.last_used:
                rec.last_used = when
            server.planner.touch(name, when)
