"""Admin HTTP API for model families (JSON, same auth and bind rules as every admin route).

    GET  /v1/families              every family: slot size, variants, slots and residents per server
    POST /v1/families/{name}       add: {"source_dir", "weights", "who"}

Handlers convert JSON to calls on ``control_plane.families`` and back.
"""

from __future__ import annotations

from aiohttp import web

from control_plane.admin.api import json_body as _json
from control_plane.families.added_families import add_family

FAMILY_CONTEXT_KEY = web.AppKey("family_context", dict)


async def list_families(request: web.Request) -> web.Response:
    ctx = request.app[FAMILY_CONTEXT_KEY]
    catalog, manager = ctx["catalog"], ctx["manager"]
    out = []
    for name, family in sorted(catalog.families.items()):
        servers = {}
        for server in manager.servers.values():
            held = server.admin.family_slots(name)
            if held is not None:
                servers[server.name] = held
        out.append({"family": name, "slot_bytes": family.slot_bytes,
                    "tensors": [t.describe() for t in family.layout.tensors],
                    "variants": catalog.variants(name), "servers": servers})
    return web.json_response({"families": out})


async def add(request: web.Request) -> web.Response:
    ctx = request.app[FAMILY_CONTEXT_KEY]
    body = await _json(request)
    row = await add_family(request.match_info["name"], body.get("source_dir"), body.get("weights"),
                           who=str(body.get("who") or request.headers.get("X-MMS-User") or "admin-api"),
                           state=ctx["state"], stores=ctx["stores"], catalog=ctx["catalog"],
                           registry=ctx["registry"])
    return web.json_response(row, status=201)


def add_family_routes(app: web.Application, *, catalog, manager, state, stores, registry) -> None:
    app[FAMILY_CONTEXT_KEY] = {"catalog": catalog, "manager": manager, "state": state,
                               "stores": stores, "registry": registry}
    app.add_routes([web.get("/v1/families", list_families), web.post("/v1/families/{name}", add)])
