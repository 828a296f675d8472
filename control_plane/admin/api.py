"""Admin HTTP API (JSON, loopback only): everything ``mmctl`` does, plus /metrics.

Handlers only translate between HTTP and the manager; errors map to statuses in one place
(``error_middleware``).  This API can load and unload models, so it must never be exposed on
the public port: it binds 127.0.0.1 unless the operator says otherwise.

Binding loopback does not keep a web browser out: any page an operator has open can send
requests to 127.0.0.1.  ``access_middleware`` closes that door, in this order:

* Host must name this server (loopback, the bound address or a configured name), so a page
  whose domain was re-pointed at 127.0.0.1 (DNS rebinding) is refused (403).
* A request a browser marks as coming from another origin (``Origin``, ``Sec-Fetch-Site``)
  is refused (403): the only pages it serves are its own, so no legitimate caller is
  cross-origin.
* A bearer token (``Authorization: Bearer <token>``, generated into the state directory by
  ``mmctl up``) is required, except for read-only /metrics and /health (401).  The status
  page (``control_plane.admin.status_page``) is for a browser, which cannot send that
  header: its sign-in (``POST /v1/session`` with the token) sets a session cookie
  (HttpOnly, SameSite=Strict, derived from the token, so rotating the token ends every
  session) that opens the page and its data (``SESSION_PATHS``, GET only) and nothing else.
  The page's static files (``/static/``: code and style, no data) need no token.
* Every request that may change state (any method but GET/HEAD) must say
  ``Content-Type: application/json``, body or not (415).  A browser cannot send that
  cross-origin without a CORS preflight, which this API never approves; the form posts and
  ``text/plain`` or body-less fetches it can send without one are refused.
"""

from __future__ import annotations

import fnmatch
import json
import logging
import os
from pathlib import Path

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from control_plane.admin.access import SAFE_METHODS, AdminAccess, Unauthorized, access_middleware
from control_plane.manager.model_manager import ModelManager
from control_plane.manager.records import ModelState
from domain.errors import ControlPlaneError, InvalidInput
from domain.routes import ADAPTER_SEPARATOR

log = logging.getLogger(__name__)

MANAGER_KEY = web.AppKey("manager", ModelManager)
EXTRA_KEY = web.AppKey("extra", dict)
ACCESS_KEY = web.AppKey("access", AdminAccess)
# The status page's sign-in form (bytes of HTML): a browser refused on the page gets it
# with its 401 instead of the JSON error.
SIGN_IN_KEY = web.AppKey("sign_in_page", bytes)
PAGE_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; "
                               "img-src 'self' data:; connect-src 'self'; base-uri 'none'; "
                               "form-action 'self'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}


def _wants_page(request: web.Request) -> bool:
    return (request.method in SAFE_METHODS and request.path == "/"
            and "text/html" in request.headers.get("Accept", ""))


@web.middleware
async def error_middleware(request: web.Request, handler):
    try:
        return await handler(request)
    except ControlPlaneError as exc:
        sign_in = request.app.get(SIGN_IN_KEY)
        if isinstance(exc, Unauthorized) and sign_in is not None and _wants_page(request):
            resp = web.Response(body=sign_in, status=401, content_type="text/html",
                                charset="utf-8", headers=PAGE_HEADERS)
        else:
            resp = web.json_response(exc.to_dict(), status=exc.http_status)
        if isinstance(exc, Unauthorized):
            resp.headers["WWW-Authenticate"] = 'Bearer realm="mmctl"'
        return resp
    except web.HTTPException:
        raise
    except Exception as exc:  # never crash the server on one bad request
        log.exception("admin API %s %s failed", request.method, request.path)
        return web.json_response({"error": "internal", "message": repr(exc)}, status=500)


async def json_body(request: web.Request) -> dict:
    """The request's JSON object ({} when there is no body); InvalidInput otherwise."""
    if not request.can_read_body:
        return {}
    try:
        body = await request.json()
    except ValueError:
        raise InvalidInput("the request body must be JSON") from None
    if not isinstance(body, dict):
        raise InvalidInput("the request body must be a JSON object")
    return body


def _manager(request: web.Request) -> ModelManager:
    return request.app[MANAGER_KEY]


def _model(request: web.Request) -> str:
    """The concrete model a request names: ``extra["resolve_name"]`` (the registry's) turns a
    logical name into its production version (``simple`` -> ``simple.v1``)."""
    name = request.match_info["model"]
    resolve = request.app[EXTRA_KEY].get("resolve_name")
    return resolve(name) if resolve is not None else name


TIERS = ("hot", "staging", "warm", "cold")
STATUS_CHUNK = 500  # models serialized per write: a status of 10,000 models is streamed


async def status(request: web.Request) -> web.StreamResponse:
    """Models as ``mmctl status`` lists them, streamed.  Query: ``match`` (a name or a glob),
    ``state``, ``tier``, ``server``; ``warm=0`` counts the models that are only warm instead
    of listing them, and answers {"warm_hidden": N, "models": [...]} (else a list)."""
    q = request.query
    state = q.get("state") or None
    if state is not None and state not in {s.value for s in ModelState}:
        raise InvalidInput(f"unknown state {state!r}: one of "
                           f"{', '.join(s.value for s in ModelState)}")
    tier = q.get("tier") or None
    if tier is not None and tier not in TIERS:
        raise InvalidInput(f"unknown tier {tier!r}: one of {', '.join(TIERS)}")
    pattern = q.get("match") or None
    hide_warm = q.get("warm") == "0"
    records, hidden = _manager(request).catalog.find(
        pattern, ModelState(state) if state else None, q.get("server") or None,
        include_warm=not hide_warm)
    locate = request.app[EXTRA_KEY].get("locate")
    rows = []
    manager = _manager(request)
    for rec in records:
        row = manager.status_row(rec)
        if locate is not None:  # hot / warm / cold, from the warm tier
            row["tier"] = locate(rec.name)["tier"]
        if tier is None or row.get("tier", "hot" if rec.server else "warm") == tier:
            rows.append(row)
    if manager.adapters is not None:  # LoRA adapters: entries BASE:ADAPTER in their base's slots
        for row in manager.adapters.rows():
            if not _adapter_row_matches(row, pattern, state, tier, q.get("server") or None):
                continue
            if hide_warm and row["state"] != ModelState.READY.value:
                hidden += 1
            else:
                rows.append(row)
    response = web.StreamResponse(headers={"Content-Type": "application/json"})
    await response.prepare(request)
    await response.write(f'{{"warm_hidden":{hidden},"models":['.encode() if hide_warm else b"[")
    for i in range(0, len(rows), STATUS_CHUNK):
        chunk = json.dumps(rows[i:i + STATUS_CHUNK], separators=(",", ":"))[1:-1]
        await response.write((("," if i else "") + chunk).encode())
    await response.write(b"]}" if hide_warm else b"]")
    await response.write_eof()
    return response


def _adapter_row_matches(row: dict, pattern: str | None, state: str | None, tier: str | None,
                         server: str | None) -> bool:
    return ((pattern is None or fnmatch.fnmatchcase(row["model"], pattern)
             or fnmatch.fnmatchcase(row["base"], pattern))
            and (state is None or row["state"] == state) and (tier is None or row["tier"] == tier)
            and (server is None or row["server"] == server))


async def model_status(request: web.Request) -> web.Response:
    manager = _manager(request)
    return web.json_response(manager.status_row(manager.get(_model(request))))


async def scale(request: web.Request) -> web.Response:
    """``{"replicas": N}``: keep N copies of the model, each on its own server;
    ``{"replicas": "auto", "min": A, "max": B}``: as many as its traffic needs."""
    body = await json_body(request)
    if "replicas" not in body or not set(body) <= {"replicas", "min", "max"}:
        raise InvalidInput('the body must be {"replicas": N} (N >= 1) or {"replicas": "auto", '
                           '"min": A, "max": B}, nothing else')
    name = request.match_info["model"]
    concrete = _model(request)
    if concrete != name:
        raise InvalidInput(f"{name} is a logical name: its requests go to its production version "
                           f"{concrete}; copies belong to a version: mmctl scale {concrete} "
                           "--replicas N")
    manager = _manager(request)
    rec = await manager.scale(name, body["replicas"], body.get("min"), body.get("max"))
    return web.json_response(manager.status_row(rec))


# ``(action, "BASE:ADAPTER") -> its status row``: load, unload, pin and unpin of a LoRA
# adapter, an entry of the manager like a model (set by the adapter routes).
ADAPTER_ENTRIES_KEY = web.AppKey("adapter_entries", object)


async def _adapter_entry(request: web.Request, action: str) -> web.Response | None:
    """The answer to ``action`` on ``BASE:ADAPTER`` (the adapter manager's), or None for a
    model."""
    name = request.match_info["model"]
    entries = request.app.get(ADAPTER_ENTRIES_KEY)
    if ADAPTER_SEPARATOR not in name or entries is None:
        return None
    return web.json_response(await entries(action, name))


async def load(request: web.Request) -> web.Response:
    if (entry := await _adapter_entry(request, "load")) is not None:
        return entry
    rec = await _manager(request).ensure(_model(request), retry_failed=True)
    return web.json_response(rec.to_dict())


async def unload(request: web.Request) -> web.Response:
    if (entry := await _adapter_entry(request, "unload")) is not None:
        return entry
    force = request.query.get("force", "") in ("1", "true", "yes")
    rec = await _manager(request).unload(_model(request), force=force)
    return web.json_response(rec.to_dict())


async def pin(request: web.Request) -> web.Response:
    if (entry := await _adapter_entry(request, "pin")) is not None:
        return entry
    return web.json_response((await _manager(request).pin(_model(request))).to_dict())


async def unpin(request: web.Request) -> web.Response:
    if (entry := await _adapter_entry(request, "unpin")) is not None:
        return entry
    return web.json_response((await _manager(request).unpin(_model(request))).to_dict())


async def health(request: web.Request) -> web.Response:
    probe = request.query.get("probe", "") in ("1", "true", "yes")
    body = await _manager(request).health(_model(request), probe=probe)
    return web.json_response(body, status=200 if body["healthy"] else 503)


async def service_health(request: web.Request) -> web.Response:
    servers = _manager(request).fleet()
    ok = all(s["up"] for s in servers)
    return web.json_response({"ok": ok, "servers": servers}, status=200 if ok else 503)


async def fleet(request: web.Request) -> web.Response:
    return web.json_response(_manager(request).fleet())


async def endpoints(request: web.Request) -> web.Response:
    body = dict(request.app[EXTRA_KEY].get("endpoints", {}))
    manager = _manager(request)
    body["triton"] = [
        {"server": s["server"], "grpc": s["grpc_url"], "http": s["http_url"],
         "metrics": s["metrics_url"], "device": s["device"]}
        for s in manager.fleet()
    ]
    body["processes"] = processes(body.pop("processes_file", None), manager)
    return web.json_response(body)


def processes(processes_file: str | None, manager: ModelManager) -> list[dict]:
    """Every process of the product with its role and pid: the supervisor's list (itself,
    the control plane, the router workers) when mmctl up supervises, else this process;
    then each Triton launched here."""
    found: list[dict] = []
    if processes_file:
        try:
            found = json.loads(Path(processes_file).read_text())["processes"]
        except (OSError, ValueError, KeyError, TypeError):
            found = []
    if not any(p.get("role") == "control-plane" for p in found):
        found.append({"role": "control-plane", "pid": os.getpid()})
    for server in manager.servers.values():
        pid = server.process.pid if server.process is not None else None
        if pid is not None:
            found.append({"role": "triton", "name": server.name, "pid": pid, "grpc": server.spec.grpc_url})
    return found


async def metrics(request: web.Request) -> web.Response:
    registry = _manager(request).metrics.registry
    resp = web.Response(body=generate_latest(registry))
    resp.content_type = CONTENT_TYPE_LATEST.split(";")[0]
    return resp


async def livez(request: web.Request) -> web.Response:
    return web.json_response({"alive": True, "role": "leader"})


async def readyz(request: web.Request) -> web.Response:
    """Ready = serving as the control plane (a standby answers 503 on this port), so a
    Kubernetes Service sends admin calls and router workers to the leader only."""
    return web.json_response({"ready": True, "role": "leader"})


async def not_found(request: web.Request) -> web.Response:
    raise InvalidInput(f"no admin endpoint {request.method} {request.path}")


def make_app(manager: ModelManager, extra: dict | None = None,
             access: AdminAccess | None = None) -> web.Application:
    """The admin app.  ``access`` None: loopback Host/Origin/Content-Type checks, no token."""
    access = access or AdminAccess()
    app = web.Application(middlewares=[error_middleware, access_middleware(access)],
                          client_max_size=1 << 20)
    app[MANAGER_KEY] = manager
    app[EXTRA_KEY] = extra or {}
    app[ACCESS_KEY] = access
    app.add_routes([
        web.get("/v1/status", status),
        web.get("/v1/models/{model}", model_status),
        web.post("/v1/models/{model}/load", load),
        web.post("/v1/models/{model}/unload", unload),
        web.post("/v1/models/{model}/pin", pin),
        web.post("/v1/models/{model}/unpin", unpin),
        web.post("/v1/models/{model}/scale", scale),
        web.get("/health/{model}", health),
        web.get("/health", service_health),
        web.get("/v1/fleet", fleet),
        web.get("/v1/endpoints", endpoints),
        web.get("/metrics", metrics),
        web.get("/livez", livez),
        web.get("/readyz", readyz),
    ])
    return app
