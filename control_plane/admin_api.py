"""Admin HTTP API (JSON, loopback only): everything ``mmctl`` does, plus /metrics.

Handlers only translate between HTTP and the manager; errors map to statuses in one place
(``error_middleware``).  This API can load and unload models, so it must never be exposed on
the public port: it binds 127.0.0.1 unless the operator says otherwise.
"""

from __future__ import annotations

import logging

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from .errors import ControlPlaneError, InvalidInput
from .manager import ModelManager

log = logging.getLogger(__name__)

MANAGER_KEY = web.AppKey("manager", ModelManager)
EXTRA_KEY = web.AppKey("extra", dict)


@web.middleware
async def error_middleware(request: web.Request, handler):
    try:
        return await handler(request)
    except ControlPlaneError as exc:
        return web.json_response(exc.to_dict(), status=exc.http_status)
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


async def status(request: web.Request) -> web.Response:
    models = _manager(request).status()
    locate = request.app[EXTRA_KEY].get("locate")
    if locate is not None:  # hot / warm / cold, from the warm tier
        for m in models:
            m["tier"] = locate(m["model"])["tier"]
    return web.json_response(models)


async def model_status(request: web.Request) -> web.Response:
    return web.json_response(_manager(request).get(_model(request)).to_dict())


async def load(request: web.Request) -> web.Response:
    rec = await _manager(request).ensure(_model(request), retry_failed=True)
    return web.json_response(rec.to_dict())


async def unload(request: web.Request) -> web.Response:
    force = request.query.get("force", "") in ("1", "true", "yes")
    rec = await _manager(request).unload(_model(request), force=force)
    return web.json_response(rec.to_dict())


async def pin(request: web.Request) -> web.Response:
    return web.json_response((await _manager(request).pin(_model(request))).to_dict())


async def unpin(request: web.Request) -> web.Response:
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
    body["triton"] = [
        {"server": s["server"], "grpc": s["grpc_url"], "http": s["http_url"],
         "metrics": s["metrics_url"], "device": s["device"]}
        for s in _manager(request).fleet()
    ]
    return web.json_response(body)


async def metrics(request: web.Request) -> web.Response:
    registry = _manager(request).metrics.registry
    resp = web.Response(body=generate_latest(registry))
    resp.content_type = CONTENT_TYPE_LATEST.split(";")[0]
    return resp


async def not_found(request: web.Request) -> web.Response:
    raise InvalidInput(f"no admin endpoint {request.method} {request.path}")


def make_app(manager: ModelManager, extra: dict | None = None) -> web.Application:
    app = web.Application(middlewares=[error_middleware], client_max_size=1 << 20)
    app[MANAGER_KEY] = manager
    app[EXTRA_KEY] = extra or {}
    app.add_routes([
        web.get("/v1/status", status),
        web.get("/v1/models/{model}", model_status),
        web.post("/v1/models/{model}/load", load),
        web.post("/v1/models/{model}/unload", unload),
        web.post("/v1/models/{model}/pin", pin),
        web.post("/v1/models/{model}/unpin", unpin),
        web.get("/health/{model}", health),
        web.get("/health", service_health),
        web.get("/v1/fleet", fleet),
        web.get("/v1/endpoints", endpoints),
        web.get("/metrics", metrics),
    ])
    return app
