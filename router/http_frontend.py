"""KServe v2 HTTP/REST on the public port, plus /health/{model} and /metrics.

Inference bodies (JSON, or JSON header + binary tensors) are forwarded to the chosen
Triton's HTTP endpoint unchanged, except that a ``base:adapter`` name adds
``parameters.adapter`` to the request's JSON header; the response's JSON header gains the
routing parameters (``model``, ``variant``, ``experiment``, ``adapter``).  Repository, shared-memory, logging
and trace endpoints answer 403.
"""

from __future__ import annotations

import json
import logging

import aiohttp
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from control_plane.errors import ControlPlaneError

from .core import Router
from .errors import (
    BackendUnavailable,
    InvalidRequest,
    PayloadTooLarge,
    PermissionDenied,
    RateLimited,
    RouterError,
    from_control_plane,
)
from .grpc_frontend import EXTENSIONS, SERVER_NAME, SERVER_VERSION

log = logging.getLogger(__name__)

ROUTER_KEY = web.AppKey("router", Router)
SESSION_KEY = web.AppKey("session", aiohttp.ClientSession)
HEADER_LENGTH = "Inference-Header-Content-Length"


def _error(exc: RouterError) -> web.Response:
    headers = {}
    if isinstance(exc, RateLimited):
        headers["Retry-After"] = str(max(1, round(exc.retry_after_s + 0.499)))
    return web.json_response({"error": exc.message}, status=exc.http_status, headers=headers)


@web.middleware
async def error_middleware(request: web.Request, handler):
    try:
        return await handler(request)
    except RouterError as exc:
        return _error(exc)
    except ControlPlaneError as exc:
        return _error(from_control_plane(exc))
    except web.HTTPRequestEntityTooLarge as exc:
        return _error(PayloadTooLarge(f"request body is larger than the router's limit: {exc.text}"))
    except web.HTTPException:
        raise
    except aiohttp.ClientError as exc:
        return web.json_response({"error": f"Triton is unavailable: {exc}"}, status=503)
    except Exception as exc:
        log.exception("HTTP %s %s failed", request.method, request.path)
        return web.json_response({"error": f"internal error: {exc!r}"}, status=500)


def _router(request: web.Request) -> Router:
    return request.app[ROUTER_KEY]


def _version(request: web.Request) -> str | None:
    """The URL's model version: digits only (it is spliced into the URL sent to Triton)."""
    version = request.match_info.get("version")
    if version is not None and not version.isdigit():
        raise InvalidRequest(f"model version must be a number, got {version!r}")
    return version


async def live(request):
    return web.json_response({"live": True})


async def ready(request):
    ok = _router(request).any_server_up()
    return web.Response(status=200 if ok else 503)


async def server_metadata(request):
    return web.json_response({"name": SERVER_NAME, "version": SERVER_VERSION, "extensions": EXTENSIONS})


async def model_ready(request):
    ok = _router(request).model_ready(request.match_info["model"])
    return web.Response(status=200 if ok else 400)


async def _forward_get(request: web.Request, suffix: str) -> web.Response:
    router = _router(request)
    logical = request.match_info["model"]
    decision = router.decide_without_limits(logical)
    server = await router.server_for(decision.model)
    version = _version(request)
    path = f"/v2/models/{decision.model}" + (f"/versions/{version}" if version else "") + suffix
    async with request.app[SESSION_KEY].get(f"http://{server.spec.http_url}{path}") as resp:
        body = await resp.read()
        if resp.status == 200 and resp.content_type == "application/json":
            doc = json.loads(body)
            if suffix == "" and "name" in doc:
                doc["name"] = logical
            return web.json_response(doc)
        return web.Response(body=body, status=resp.status, content_type=resp.content_type)


async def model_metadata(request):
    return await _forward_get(request, "")


async def model_config(request):
    return await _forward_get(request, "/config")


async def model_stats(request):
    return await _forward_get(request, "/stats")


def _with_adapter(doc: dict, body: bytes, header_len: str | None, headers: dict,
                  decision) -> tuple[bytes, dict]:
    """The body with ``parameters.adapter`` set for a ``base:adapter`` name: the JSON header
    is re-serialized, binary tensors after it are passed through untouched."""
    params = doc.get("parameters")
    if params is None:
        params = doc["parameters"] = {}
    if not isinstance(params, dict):
        raise InvalidRequest("'parameters' must be a JSON object")
    given = params.get("adapter")
    if given not in (None, "", decision.adapter):
        raise InvalidRequest(
            f"model name {decision.logical!r} selects adapter {decision.adapter!r} but the request "
            f"parameter adapter is {given!r}; send one of them")
    params["adapter"] = decision.adapter
    header = json.dumps(doc, separators=(",", ":")).encode()
    if not header_len:
        return header, headers
    headers = {k: v for k, v in headers.items() if k.lower() != HEADER_LENGTH.lower()}
    headers[HEADER_LENGTH] = str(len(header))
    return header + body[int(header_len):], headers


async def infer(request: web.Request) -> web.Response:
    router = _router(request)
    limit = router.config.max_request_bytes
    if request.content_length is not None and request.content_length > limit:
        # Refused from the header, before the body is read into memory.
        raise PayloadTooLarge(f"request body of {request.content_length} bytes is over the router's "
                              f"limit of {limit} bytes; send smaller batches")
    body = await request.read()
    header_len = request.headers.get(HEADER_LENGTH)
    json_part = body[: int(header_len)] if header_len else body
    try:
        doc = json.loads(json_part or b"{}")
    except (ValueError, UnicodeDecodeError) as exc:
        raise InvalidRequest(f"request body is not valid JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise InvalidRequest("request body must be a JSON object")
    params = doc.get("parameters") if isinstance(doc.get("parameters"), dict) else {}
    user_id = request.headers.get("x-user-id") or params.get("user_id")
    adapter = params.get("adapter")
    logical = router.public_name(
        request.match_info["model"],
        (i.get("name") for i in doc.get("inputs") or () if isinstance(i, dict)),
        adapter if isinstance(adapter, str) and adapter else None)
    async with router.serving(logical, str(user_id) if user_id is not None else None) as call:
        decision, server = call.decision, call.server
        version = _version(request)
        path = f"/v2/models/{decision.model}" + (f"/versions/{version}" if version else "") + "/infer"
        headers = {k: v for k, v in request.headers.items()
                   if k.lower() in ("content-type", HEADER_LENGTH.lower(), "content-encoding",
                                    "accept-encoding")}
        if decision.adapter is not None:
            body, headers = _with_adapter(doc, body, header_len, headers, decision)
        try:
            async with request.app[SESSION_KEY].post(f"http://{server.spec.http_url}{path}", data=body,
                                                     headers=headers) as resp:
                payload = await resp.read()
                status = resp.status
                resp_header_len = resp.headers.get(HEADER_LENGTH)
                content_type = resp.headers.get("Content-Type", "application/json")
        except aiohttp.ClientConnectionError as exc:
            call.code = "UNAVAILABLE"
            raise BackendUnavailable(
                f"Triton {server.name} at {server.spec.http_url} is unavailable ({exc}); "
                "the control plane restarts it, retry shortly") from exc
        if status != 200:
            call.code = "INVALID_ARGUMENT" if status == 400 else f"HTTP_{status}"
            return web.Response(body=payload, status=status, content_type="application/json")
        n = int(resp_header_len) if resp_header_len else len(payload)
        out = json.loads(payload[:n])
        params = out.setdefault("parameters", {})
        params.update(model=decision.model, variant=decision.variant)
        if decision.experiment:
            params["experiment"] = decision.experiment
        if decision.adapter is not None:
            params["adapter"] = decision.adapter
        out["model_name"] = decision.model
        header = json.dumps(out, separators=(",", ":")).encode()
        resp_headers = {}
        if resp_header_len:
            resp_headers[HEADER_LENGTH] = str(len(header))
        return web.Response(body=header + payload[n:], status=200, headers=resp_headers,
                            content_type=content_type.split(";")[0])


async def model_health(request: web.Request) -> web.Response:
    router = _router(request)
    decision = router.decide_without_limits(request.match_info["model"])
    body = await router.manager.health(decision.model)
    body["route"] = request.match_info["model"]
    return web.json_response(body, status=200 if body["healthy"] else 503)


async def metrics(request: web.Request) -> web.Response:
    resp = web.Response(body=generate_latest(_router(request).metrics.registry))
    resp.content_type = CONTENT_TYPE_LATEST.split(";")[0]
    return resp


async def refused(request: web.Request) -> web.Response:
    _router(request).metrics.refused.labels(request.path.split("/")[2] if request.path.count("/") > 1 else "?").inc()
    raise PermissionDenied(
        f"{request.method} {request.path} is not available on the public port: model control, "
        "repository, shared-memory, log and trace APIs go through the control plane (mmctl)")


def make_http_app(router: Router) -> web.Application:
    app = web.Application(middlewares=[error_middleware], client_max_size=router.config.max_request_bytes)
    app[ROUTER_KEY] = router

    async def session_ctx(app):
        app[SESSION_KEY] = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=router.config.request_timeout_s),
            connector=aiohttp.TCPConnector(limit=256))
        yield
        await app[SESSION_KEY].close()

    app.cleanup_ctx.append(session_ctx)
    m = "/v2/models/{model}"
    mv = "/v2/models/{model}/versions/{version}"
    app.add_routes([
        web.get("/v2/health/live", live),
        web.get("/v2/health/ready", ready),
        web.get("/v2", server_metadata),
        web.get(m, model_metadata), web.get(mv, model_metadata),
        web.get(m + "/ready", model_ready), web.get(mv + "/ready", model_ready),
        web.get(m + "/config", model_config), web.get(mv + "/config", model_config),
        web.get(m + "/stats", model_stats), web.get(mv + "/stats", model_stats),
        web.post(m + "/infer", infer), web.post(mv + "/infer", infer),
        web.get("/health/{model}", model_health),
        web.get("/metrics", metrics),
        web.route("*", "/v2/repository/{tail:.*}", refused),
        web.route("*", "/v2/systemsharedmemory{tail:.*}", refused),
        web.route("*", "/v2/cudasharedmemory{tail:.*}", refused),
        web.route("*", "/v2/logging", refused),
        web.route("*", "/v2/trace/setting", refused),
        web.route("*", m + "/trace/setting", refused),
    ])
    return app
