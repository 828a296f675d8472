"""What the manager knows: the models that exist, their records, the fleet."""

from __future__ import annotations

import time
from collections.abc import Callable

from control_plane.domain.errors import ModelNotFound, TritonUnavailable
from control_plane.domain.names import validate_model_name
from control_plane.manager.records import ModelRecord, ModelState, TritonServer
from control_plane.manager.state import ManagerState

UNKNOWN_NAME_TTL_S = 5.0
UNKNOWN_NAMES_MAX = 10_000


class Catalog:
    """Which models exist (some Triton's repository, or a tier) and what is known of them."""

    def __init__(self, state: ManagerState):
        self.state = state
        self._unknown: dict[str, float] = {}  # name -> when it was last found unknown

    def get(self, name: str) -> ModelRecord:
        validate_model_name(name)
        st = self.state
        if (name not in st.known_names and name not in st.records
                and not (st.stager is not None and name in st.stager.known())):
            # A registry version still in the cold tier is known too: it loads on demand.
            raise ModelNotFound(f"unknown model {name!r}; `mmctl status` lists the known models")
        return st.record(name)

    def status(self) -> list[dict]:
        st = self.state
        names = sorted(st.known_names | {n for n, r in st.records.items()
                                         if r.state != ModelState.WARM or r.pinned})
        return [st.record(n).to_dict() for n in names]

    def fleet(self) -> list[dict]:
        return [{**s.to_dict(), **self.state.memory.describe(s)} for s in self.state.servers.values()]

    def ready_server_of(self, name: str) -> TritonServer | None:
        """The server on which ``name`` is READY, or None.  No I/O: the router's hit path."""
        rec = self.state.records.get(name)
        if rec is None or rec.state != ModelState.READY or rec.server is None:
            return None
        return self.state.servers.get(rec.server)

    def on_loaded(self, listener: Callable[[str, ModelRecord], None]) -> None:
        self.state.load_listeners.append(listener)

    async def known(self, name: str) -> None:
        """Raise ModelNotFound unless some server's repository (or a tier) has ``name``.

        Unknown names are remembered for a few seconds: a client repeating a bad name must
        not turn each request into index RPCs and registry queries."""
        stager = self.state.stager
        if name in self.state.known_names:
            return
        refused_at = self._unknown.get(name)
        if refused_at is not None and time.monotonic() - refused_at < UNKNOWN_NAME_TTL_S:
            raise ModelNotFound(f"unknown model {name!r}: it is not in the model repository; "
                                "`mmctl status` lists the known models")
        if stager is not None and name in stager.known():
            return
        await self.refresh_catalog()
        if name not in self.state.known_names and not (stager is not None and name in stager.known()):
            if len(self._unknown) >= UNKNOWN_NAMES_MAX:
                self._unknown.clear()
            self._unknown[name] = time.monotonic()
            raise ModelNotFound(
                f"unknown model {name!r}: it is not in the model repository; "
                "`mmctl status` lists the known models"
            )
        self._unknown.pop(name, None)

    async def refresh_catalog(self) -> None:
        errors = []
        for server in self.state.servers.values():
            try:
                self.state.known_names.update((await server.admin.index()).keys())
                server.up = True
            except TritonUnavailable as exc:
                server.up = False
                errors.append(exc)
        if errors and len(errors) == len(self.state.servers):
            raise errors[0]

    def artifact_bytes(self, name: str) -> int:
        """Bytes of the model's files in the repository (CPU memory estimate)."""
        if self.state.repository is None:
            return 0
        root = self.state.repository / name
        if not root.is_dir():
            return 0
        return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())
