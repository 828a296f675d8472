"""One active control plane, standbys ready (``--state-url postgresql://...``).

Every control plane pointed at one shared state store runs for the lease
(``control_plane.state.leader``).  Until it wins, it is a standby: its admin port answers
``/livez`` (alive) and ``/readyz`` 503, and every other request 503 with the leader's name
and address, so a load balancer or a router worker moves on to the leader.  Once it wins it
starts as the control plane always has (adopting what each Triton has loaded) with the
lease's token as the fence on every write.  When its leadership ends without a clean stop
(another holder, or no renewal before the lease could run out) it exits at once, before
acting again: the supervisor or Kubernetes starts it anew, as a standby.
"""

from __future__ import annotations

import asyncio
import html
import logging
import os
import socket

from aiohttp import web
from prometheus_client import CollectorRegistry, Gauge, generate_latest

from control_plane.state import Database, Deposed, LeaderLease, redact
from control_plane.state.database import STORE_ERRORS

log = logging.getLogger(__name__)

EXIT_DEPOSED = 75  # EX_TEMPFAIL: restart me (as a standby)
RETRY_S = 1.0


def advertised_url(host: str, port: int) -> str:
    """How others reach this admin API when no --advertise-url says: the bound address, or
    the host name where it binds every interface."""
    if host in ("0.0.0.0", "::", ""):
        host = socket.gethostname()
    return f"http://{host}:{port}"


def standby_metrics() -> bytes:
    """A standby's /metrics: alive, not leading (so a scrape target is up, not an error)."""
    registry = CollectorRegistry()
    Gauge("control_plane_leader", "1 on the leading control plane, 0 on a standby",
          registry=registry).set(0)
    return generate_latest(registry)


def standby_page(found: dict, where: str) -> web.Response:
    """The status page's address on a standby: a page that says so, links to the leader
    and looks again every few seconds (this one may lead by then)."""
    address = found.get("leader_address") or ""
    link = (f'<p><a href="{html.escape(address)}/">Open the leader\'s status page</a></p>'
            if address.startswith(("http://", "https://")) else "")
    body = (f'<!doctype html><html><head><meta charset="utf-8"><meta http-equiv="refresh" content="5">'
            f"<title>Standby control plane</title></head><body><h1>A standby control plane</h1>"
            f"<p>This control plane is a standby: {html.escape(where)}.</p>{link}"
            f"<p>This page looks again every 5 seconds.</p></body></html>")
    return web.Response(text=body, content_type="text/html", status=503, headers={"Retry-After": "5"})


def standby_app(lease: LeaderLease) -> web.Application:
    def leader_text() -> dict:
        try:
            holder = lease.current()
        except STORE_ERRORS as exc:  # the store is away
            return {"leader": None, "leader_address": None, "store_error": str(exc)}
        return {"leader": holder.holder if holder else None,
                "leader_address": holder.address if holder else None}

    async def livez(request: web.Request) -> web.Response:
        return web.json_response({"alive": True, "role": "standby"})

    async def standby(request: web.Request) -> web.Response:
        found = await asyncio.to_thread(leader_text)
        where = (f"the leader is {found['leader']} at {found['leader_address']}"
                 if found.get("leader") else "no control plane leads right now (an election "
                 "is under way; retry in a few seconds)")
        if request.method == "GET" and request.path == "/" and "text/html" in request.headers.get("Accept", ""):
            return standby_page(found, where)  # a person opened the status page here
        return web.json_response(
            {"error": "standby", "message": f"this control plane is a standby; {where}",
             "role": "standby", **found}, status=503, headers={"Retry-After": "1"})

    app = web.Application()
    async def metrics(request: web.Request) -> web.Response:
        return web.Response(body=standby_metrics(), content_type="text/plain")

    app.add_routes([web.get("/livez", livez), web.get("/metrics", metrics),
                    web.route("*", "/{tail:.*}", standby)])
    return app


class Leadership:
    """Wait for the lease while serving the standby port, then keep it."""

    def __init__(self, db: Database, *, host: str, port: int, identity: str | None,
                 ttl_s: float, advertise_url: str | None = None):
        self.db = db
        self.host, self.port = host, port
        self.lease = LeaderLease(db, identity=identity,
                                 address=advertise_url or advertised_url(host, port), ttl_s=ttl_s)

    async def acquire(self, stop: asyncio.Event) -> bool:
        """Standby until the lease is ours (True) or ``stop`` is set (False)."""
        runner = web.AppRunner(standby_app(self.lease), access_log=None)
        await runner.setup()
        await web.TCPSite(runner, self.host, self.port).start()
        log.info("standby: admin port %s:%d answers 503 until this control plane leads "
                 "(state store %s)", self.host, self.port, redact(self.db.url))
        stopper = asyncio.ensure_future(stop.wait())
        try:
            won = asyncio.ensure_future(asyncio.to_thread(self.lease.wait_until_leader, RETRY_S))
            await asyncio.wait({won, stopper}, return_when=asyncio.FIRST_COMPLETED)
            if not won.done():
                self.lease.stop()
                await won
            if not won.result():
                return False
        finally:
            stopper.cancel()
            await runner.cleanup()
        self.db.fence = self.lease.fence()
        self.lease.keep(self._lost)
        return True

    def _lost(self, reason: str) -> None:
        log.critical("leadership lost: %s; exiting now so that nothing more is done as the "
                     "leader (restarted, this control plane becomes a standby)", reason)
        logging.shutdown()
        os._exit(EXIT_DEPOSED)

    def check(self) -> None:
        """Before a load or an unload: refuse unless the lease is certainly still ours."""
        if not self.lease.holds():
            raise Deposed("this control plane's leader lease may have run out; it calls no "
                          "load or unload until it has renewed it")

    def release(self) -> None:
        self.lease.stop()
        self.lease.release()
        self.lease.close()
