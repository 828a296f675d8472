"""The router inside the control plane's process (``mmctl up --router-workers 0``), assembled
here because it needs both processes' packages: the control plane imports nothing of the
router, and the router nothing of the control plane.

The control plane's service calls ``start_in_process_router`` with what it gives a router
(``RouterParts``: the manager, the rollouts, the families, the settings) and gets back what
it needs of one (``InProcessRouter``).  The router routes by the rollouts' table and names
and records outcomes in their statistics; the rollouts' own loop judges the canaries.
"""

from __future__ import annotations

import logging

from aiohttp import web

from control_plane.runtime.router_parts import RouterParts
from domain.settings import shared_values
from router.assembly import Router, RouterConfig
from router.frontends.grpc_frontend import start_grpc
from router.frontends.http_frontend import make_http_app
from router.frontends.http_site import STOP_GRACE_S, HalfCloseTCPSite

log = logging.getLogger(__name__)


class InProcessRouter:
    """A started ``Router`` behind its public gRPC and HTTP ports."""

    def __init__(self, router: Router, grpc_server, http_runner: web.AppRunner):
        self.router = router
        self.grpc_server = grpc_server
        self.http_runner = http_runner

    @property
    def metrics(self):
        return self.router.metrics

    @property
    def shadow(self):
        return self.router.shadow

    async def gather_reports(self) -> bool:
        return await self.router.gather_reports()

    def outstanding_by_model(self) -> dict[str, int]:
        return self.router.sender.queues.outstanding_by_model()

    async def close(self) -> None:
        await self.grpc_server.stop(grace=STOP_GRACE_S)
        await self.http_runner.cleanup()
        await self.router.stop()


async def start_in_process_router(parts: RouterParts, endpoints: dict) -> InProcessRouter:
    cfg, rollouts = parts.cfg, parts.rollouts
    router = Router(parts.manager, rollouts.table, RouterConfig(
        **shared_values(cfg, RouterConfig), shadow_log_dir=(cfg.state_dir / "shadow").resolve()),
        names=rollouts.names, families=parts.families, stats=rollouts.stats,
        share_weights=rollouts.shares.resolved)
    await router.start()
    grpc_server, grpc_port = await start_grpc(router, cfg.router_host, cfg.router_grpc_port,
                                              cfg.max_request_bytes)
    http_runner = web.AppRunner(make_http_app(router), access_log=None,
                                shutdown_timeout=STOP_GRACE_S)
    await http_runner.setup()
    await HalfCloseTCPSite(http_runner, cfg.router_host, cfg.router_http_port).start()
    http_port = http_runner.addresses[0][1]
    endpoints["router_grpc"] = f"{cfg.router_host}:{grpc_port}"
    endpoints["router_http"] = f"{cfg.router_host}:{http_port}"
    log.info("router: gRPC %s, HTTP %s", endpoints["router_grpc"], endpoints["router_http"])
    return InProcessRouter(router, grpc_server, http_runner)
