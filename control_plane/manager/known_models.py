"""What the manager knows: the models that exist, their records, the fleet."""

from __future__ import annotations

import fnmatch
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from control_plane.manager.fleet_state import ModelBook
from control_plane.manager.records import ModelRecord, ModelState, Stager, TritonServer
from domain.errors import ModelNotFound, TritonUnavailable
from domain.names import validate_model_name

GLOB_CHARS = frozenset("*?[")  # a status pattern with none of these is one model's name
UNKNOWN_NAME_TTL_S = 5.0
UNKNOWN_NAMES_MAX = 10_000


class Catalog:
    """Which models exist (some Triton's repository, or a tier) and what is known of them."""

    def __init__(self, book: ModelBook, servers: dict[str, TritonServer], stager: Stager | None,
                 repository: Path | None, memory):
        self.book = book
        self.servers = servers
        self.stager = stager  # the tiers: models known there load on demand
        self.repository = repository
        self.memory = memory  # describes each server's device memory (mmctl fleet)
        self._unknown: dict[str, float] = {}  # name -> when it was last found unknown

    def get(self, name: str) -> ModelRecord:
        validate_model_name(name)
        if (name not in self.book.known_names and name not in self.book.records
                and not (self.stager is not None and name in self.stager.known())):
            # A registry version still in the cold tier is known too: it loads on demand.
            raise ModelNotFound(f"unknown model {name!r}; `mmctl status` lists the known models")
        return self.book.record(name)

    def status(self) -> list[dict]:
        return [rec.to_dict() for rec in self.find()[0]]

    def find(self, pattern: str | None = None, state: ModelState | None = None,
             server: str | None = None, include_warm: bool = True) -> tuple[list[ModelRecord], int]:
        """The records ``mmctl status`` shows, by name: those whose name matches ``pattern``
        (a glob; a plain name is one lookup), in ``state``, on ``server``.  Without
        ``include_warm``, models that are only warm and not pinned are counted, not listed.
        Returns (records, warm models left out)."""
        if pattern is not None and not GLOB_CHARS & set(pattern):
            try:
                names: Iterable[str] = [self.get(pattern).name]
            except ModelNotFound:
                names = []
        elif (state is not None and state != ModelState.WARM) or server is not None:
            names = sorted(n for n, r in self.book.records.items()  # a model on a server has a record
                           if (state is None or r.state == state) and (server is None or r.server == server))
        else:
            names = sorted(self.book.known_names | {n for n, r in self.book.records.items()
                                             if r.state != ModelState.WARM or r.pinned})
        found, hidden = [], 0
        for name in names:
            if pattern is not None and not fnmatch.fnmatchcase(name, pattern):
                continue
            rec = self.book.record(name)
            if (state is not None and rec.state != state) or (server is not None and rec.server != server):
                continue
            if not include_warm and rec.state == ModelState.WARM and not rec.pinned:
                hidden += 1
                continue
            found.append(rec)
        return found, hidden

    def fleet(self) -> list[dict]:
        return [{**s.to_dict(), **self.memory.describe(s)} for s in self.servers.values()]

    def ready_server_of(self, name: str) -> TritonServer | None:
        """The server on which ``name`` is READY, or None.  No I/O: the router's hit path."""
        rec = self.book.records.get(name)
        if rec is None or rec.state != ModelState.READY or rec.server is None:
            return None
        return self.servers.get(rec.server)

    def on_loaded(self, listener: Callable[[str, ModelRecord], None]) -> None:
        self.book.load_listeners.append(listener)

    async def known(self, name: str) -> None:
        """Raise ModelNotFound unless some server's repository (or a tier) has ``name``.

        Unknown names are remembered for a few seconds: a client repeating a bad name must
        not turn each request into index RPCs and registry queries."""
        stager = self.stager
        if name in self.book.known_names:
            return
        refused_at = self._unknown.get(name)
        if refused_at is not None and time.monotonic() - refused_at < UNKNOWN_NAME_TTL_S:
            raise ModelNotFound(f"unknown model {name!r}: it is not in the model repository; "
                                "`mmctl status` lists the known models")
        if stager is not None and name in stager.known():
            return
        await self.refresh_catalog()
        if name not in self.book.known_names and not (stager is not None and name in stager.known()):
            if len(self._unknown) >= UNKNOWN_NAMES_MAX:
                self._unknown.clear()
            self._unknown[name] = time.monotonic()
            raise ModelNotFound(
                f"unknown model {name!r}: it is not in the model repository; "
                "`mmctl status` lists the known models"
            )
        self._unknown.pop(name, None)

    async def refresh_catalog(self) -> None:
        """Every model the servers that are up have in their repositories.  A server that
        does not answer is left to the reconcile pass and the probes (``health.Health``):
        raises the first error when none answered."""
        errors: list[TritonUnavailable] = []
        asked = [s for s in self.servers.values() if s.up]
        for server in asked:
            try:
                self.book.known_names.update((await server.admin.index()).keys())
            except TritonUnavailable as exc:
                errors.append(exc)
        if not asked:
            where = ", ".join(f"{s.name} at {s.spec.grpc_url}" for s in self.servers.values())
            raise TritonUnavailable(f"no Triton server is up ({where}: not reachable); check that "
                                    "tritonserver is running (mmctl fleet) and restart it with mmctl up")
        if len(errors) == len(asked):
            raise errors[0]

    def artifact_bytes(self, name: str) -> int:
        """Bytes of the model's files in the repository (CPU memory estimate)."""
        if self.repository is None:
            return 0
        root = self.repository / name
        if not root.is_dir():
            return 0
        return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())
