"""Admin HTTP API for LoRA adapters (JSON, loopback only).

Routes (added to the admin app by ``add_adapter_routes``; errors are mapped to statuses by
the app's error middleware like every other admin route):

    POST   /v1/adapters/{base}                          add: {"name", "path", "who", "replace"}
    GET    /v1/adapters/{base}[?refresh=0]              list (live status when the base is loaded)
    POST   /v1/adapters/{base}/{name}/pin|unpin|load|unload
    DELETE /v1/adapters/{base}/{name}

and the model routes' load, unload, pin and unpin of ``BASE:ADAPTER`` (``mmctl pin
tinylm:acme``): the same operations, answered with the entry's status row.

Handlers only convert JSON to calls on the ``AdapterManager`` and back.  The manager's
refresh loop (restore at start, then periodic status for metrics) runs for the app's life.
"""

from __future__ import annotations

import asyncio
import contextlib

from aiohttp import web

from control_plane.adapters import AdapterManager
from control_plane.admin.api import ADAPTER_ENTRIES_KEY
from control_plane.admin.api import json_body as _json

ADAPTERS_KEY = web.AppKey("adapters", AdapterManager)


def _adapters(request: web.Request) -> AdapterManager:
    return request.app[ADAPTERS_KEY]


async def add(request: web.Request) -> web.Response:
    body = await _json(request)
    row = await _adapters(request).add(
        request.match_info["base"], body.get("name"), body.get("path"),
        who=str(body.get("who") or request.headers.get("X-MMS-User") or "admin-api"),
        replace=bool(body.get("replace")))
    return web.json_response(row, status=201)


async def list_adapters(request: web.Request) -> web.Response:
    refresh = request.query.get("refresh", "1") not in ("0", "false", "no")
    return web.json_response(await _adapters(request).list(request.match_info["base"], refresh=refresh))


async def action(request: web.Request) -> web.Response:
    adapters = _adapters(request)
    op = {"pin": adapters.pin, "unpin": adapters.unpin, "load": adapters.load,
          "unload": adapters.unload}[request.match_info["action"]]
    return web.json_response(await op(request.match_info["base"], request.match_info["name"]))


async def remove(request: web.Request) -> web.Response:
    return web.json_response(await _adapters(request).remove(request.match_info["base"],
                                                             request.match_info["name"]))


def add_adapter_routes(app: web.Application, adapters: AdapterManager) -> None:
    app[ADAPTERS_KEY] = adapters
    app[ADAPTER_ENTRIES_KEY] = adapters.entry_action  # mmctl load/unload/pin/unpin BASE:ADAPTER

    async def refresh_loop(_app: web.Application):
        task = asyncio.get_running_loop().create_task(adapters.run_forever(adapters.manager.metrics.loop_failures))
        yield
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    app.cleanup_ctx.append(refresh_loop)
    app.add_routes([
        web.post("/v1/adapters/{base}", add),
        web.get("/v1/adapters/{base}", list_adapters),
        web.post("/v1/adapters/{base}/{name}/{action:pin|unpin|load|unload}", action),
        web.delete("/v1/adapters/{base}/{name}", remove),
    ])
