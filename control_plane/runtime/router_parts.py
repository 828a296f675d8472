"""What the control plane and a router in its own process give each other (``mmctl up
--router-workers 0``).  The control plane imports nothing of the router: ``mmctl`` (the
composition root, ``mmctl.in_process_router``) builds the router on ``RouterParts`` and hands
back what the service needs of it (``InProcessRouter``)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

from control_plane.admin.rollout_routes import ShadowFigures
from control_plane.manager.model_manager import ModelManager
from control_plane.runtime.config import ServiceConfig


@dataclass
class RouterParts:
    """What the control plane gives a router in its own process: the manager it serves
    from, the rollouts it routes by (and records outcomes in), the families, the settings."""

    manager: ModelManager
    rollouts: object  # control_plane.rollouts.owner.Rollouts
    families: object  # control_plane.families.FamilyCatalog
    cfg: ServiceConfig


class InProcessRouter(Protocol):
    """What the service needs of a router in its own process (``router.assembly.Router``
    behind its ports, as ``mmctl.in_process_router`` assembles it)."""

    @property
    def metrics(self): ...  # requests, cold_waits, latency: read by the status page

    @property
    def shadow(self) -> ShadowFigures: ...

    async def gather_reports(self) -> bool: ...

    def outstanding_by_model(self) -> dict[str, int]: ...  # requests on Triton, per model

    async def close(self) -> None: ...


# Builds and starts the in-process router, adding its ports to the endpoints it is given.
StartRouter = Callable[[RouterParts, dict], Awaitable[InProcessRouter]]
