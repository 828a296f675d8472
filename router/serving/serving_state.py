"""Where the data plane learns which Triton holds a model, and asks for one that none holds.

A router never calls Triton's model-control API and never holds the control plane's
records.  It reads placement through a *state source*:

* ``LocalState``: the control plane's manager in this process (``--router-workers 0`` and
  unit tests);
* ``router.serving.state_client.RemoteState``: a router worker's last snapshot of the control
  plane, kept current by a watch, with misses sent to the control plane as one RPC.

Both answer with ``ServerAddress`` (where to send a request), never with a manager record.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

# Triton's answer to an infer for a model it does not hold (now): gRPC NOT_FOUND, HTTP 404.
UNLOADED_PREFIX = "Request for unknown model"


@dataclass(frozen=True)
class ServerAddress:
    name: str
    grpc_url: str
    http_url: str
    up: bool = True


class ServingState(Protocol):
    repository: Path | None

    def ready_server(self, model: str) -> ServerAddress | None:
        """The server that has ``model`` READY now, from what this process knows."""

    def copy_servers(self, model: str) -> list[ServerAddress]:
        """The servers of ``model``'s other READY copies (``mmctl scale``), besides
        ``ready_server``'s; empty for a model with one copy."""

    async def ensure(self, model: str, unreachable: str | None = None) -> ServerAddress:
        """Have ``model`` loaded (ControlPlaneError subclasses when it cannot be).
        ``unreachable``: the server a request for it could not reach; the control plane
        places the model on another server when that one is down."""

    def touch(self, model: str) -> None:
        """``model`` served a request (drives the eviction policy)."""

    def requests_answered(self, model: str, ensures: int) -> None:
        """A request that made ``ensures`` ensures of ``model`` has its answer: the control
        plane need not hold the model for it any longer."""

    def carrier_of(self, model: str) -> str | None:
        """The Triton model that serves ``model`` when it is a model family's variant (the
        request goes there with the parameter ``mms_variant``), else None."""

    def expected_miss_s(self, model: str) -> float | None:
        """How long a miss of ``model`` takes, from its last load (None: not known yet)."""

    def servers(self) -> list[ServerAddress]: ...

    def concurrency(self, server: str) -> int | None:
        """This process's part of ``server``'s concurrency (its requests at once from the
        router, over the router workers, at least 1): the fair-share gate
        (``router.serving.fair_shares``); None: not set, no gate."""

    def share_weight(self, model: str) -> float:
        """``model``'s weight in a saturated server's fair share (``mmctl share``; 1 unset)."""

    async def health(self, model: str) -> dict: ...


class LocalState:
    """The manager of this process as a state source."""

    def __init__(self, manager, families=None, weights=None):
        self.manager = manager
        self.families = families  # control_plane.families.FamilyCatalog, or None
        # () -> model -> weight (control_plane.rollouts.shares.ShareWeights.resolved)
        self.weights = weights or dict
        self._addresses: dict[str, ServerAddress] = {}

    @property
    def repository(self) -> Path | None:
        return self.manager.repository

    def _address(self, server) -> ServerAddress:
        found = self._addresses.get(server.name)
        if found is None or found.up != server.up:
            found = self._addresses[server.name] = ServerAddress(
                server.name, server.spec.grpc_url, server.spec.http_url, server.up)
        return found

    def ready_server(self, model: str) -> ServerAddress | None:
        server = self.manager.ready_server_of(model)
        return None if server is None else self._address(server)

    def copy_servers(self, model: str) -> list[ServerAddress]:
        servers = self.manager.servers
        return [self._address(servers[name]) for name in self.manager.copy_servers_of(model)[1:]]

    async def ensure(self, model: str, unreachable: str | None = None) -> ServerAddress:
        # Shielded: a client that gives up does not cancel a load others may wait for.
        ensuring = (self.manager.ensure_for_request(model) if unreachable is None
                    else self.manager.ensure_for_request(model, unreachable=unreachable))
        server = await asyncio.shield(ensuring)
        return self._address(server)

    def touch(self, model: str) -> None:
        self.manager.touch(model)

    def requests_answered(self, model: str, ensures: int) -> None:
        self.manager.requests_answered(model, ensures)

    def carrier_of(self, model: str) -> str | None:
        return None if self.families is None else self.families.carrier_of(model)

    def expected_miss_s(self, model: str) -> float | None:
        rec = self.manager.records.get(model)
        return None if rec is None else rec.load_time_s

    def servers(self) -> list[ServerAddress]:
        return [self._address(s) for s in list(self.manager.servers.values())]

    def concurrency(self, server: str) -> int | None:
        found = self.manager.servers.get(server)
        return None if found is None else found.spec.concurrency  # the only router process

    def share_weight(self, model: str) -> float:
        return self.weights().get(model, 1.0)

    async def health(self, model: str) -> dict:
        return await self.manager.health(model)
