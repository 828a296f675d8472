"""KServe v2 HTTP/REST on the public port, plus /health/{model} and /metrics.

Inference goes through the inference pipeline, HTTP's codec around it being
``router.frontends.http_inference``.  Repository, logging and trace endpoints answer 403;
CUDA shared memory is refused with what to use instead.
"""

from __future__ import annotations

import json
import logging
import os
from functools import partial
from typing import TYPE_CHECKING

import aiohttp
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector

from domain.errors import ControlPlaneError
from domain.router_errors import (
    InvalidRequest,
    NoSuchPath,
    PayloadTooLarge,
    PermissionDenied,
    RateLimited,
    RouterError,
    from_control_plane,
    parse_version,
)
from router.frontends import http_inference
from router.frontends.grpc_frontend import EXTENSIONS, SERVER_NAME, SERVER_VERSION
from router.frontends.http_shared_memory import shared_memory_routes
from router.frontends.peers import http_client
from router.serving.miss_budget import CLIENT
from router.serving.repository_config import triton_json

if TYPE_CHECKING:  # the assembly builds the router these ports serve
    from router.frontends.public_router import PublicRouter

log = logging.getLogger(__name__)

ROUTER_KEY: web.AppKey[PublicRouter] = web.AppKey("router")
SESSION_KEY = web.AppKey("session", aiohttp.ClientSession)


def _error(exc: RouterError) -> web.Response:
    headers = {}
    if isinstance(exc, RateLimited):
        headers["Retry-After"] = str(max(1, round(exc.retry_after_s + 0.499)))
    return web.json_response({"error": exc.message}, status=exc.http_status, headers=headers)


class _MalformedHttpAsInfo(logging.Filter):
    """aiohttp logs a malformed HTTP request (request line, headers, body framing) as an
    ERROR with a traceback.  It is the client's mistake and is answered 400: one INFO line."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, HttpProcessingError) and (exc.code or 400) < 500:
            reason = " ".join(str(exc.message).split())[:300]
            record.msg, record.args = "%s: malformed HTTP request (%s)", (record.getMessage(), reason)
            record.levelno, record.levelname = logging.INFO, "INFO"
            record.exc_info = record.exc_text = None
        return True


MALFORMED_HTTP_AS_INFO = _MalformedHttpAsInfo()


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
    except web.RequestPayloadError as exc:  # e.g. a gzip body that does not decompress
        # The rest of the body cannot be read: mark it ended so aiohttp does not drain it
        # (and log the same error again), and close the connection after this answer.
        request.content.feed_eof()
        resp = _error(InvalidRequest(f"request body could not be read ({exc.args[0] if exc.args else exc}); "
                                     "check its Content-Encoding and Content-Length"))
        resp.force_close()
        return resp
    except ConnectionResetError:
        # The client went away while sending its body: nothing to answer, nothing broken.
        log.info("HTTP %s %s: the client closed the connection mid-request", request.method, request.path)
        return _error(InvalidRequest("the client closed the connection before the body was read"))
    except aiohttp.ClientError as exc:
        log.warning("HTTP %s %s: Triton is unavailable: %s", request.method, request.path, exc)
        return web.json_response({"error": "the server of this request is unavailable; retry "
                                           "shortly"}, status=503)
    except Exception:
        # What happened, not where: the exception (paths, addresses, internals) is the log's.
        log.exception("HTTP %s %s failed", request.method, request.path)
        return web.json_response({"error": "internal error: the router could not serve this "
                                           "request (its log says why)"}, status=500)


def _router(request: web.Request) -> PublicRouter:
    return request.app[ROUTER_KEY]


def _version(request: web.Request) -> str:
    """The URL's model version ("" when none): digits only, as Triton routes it.  Triton has
    no route for ``/versions/abc/...`` and answers 404 Not Found; a number beyond int64 is
    its 400 (``parse_version``)."""
    version = request.match_info.get("version")
    if version is None:
        return ""
    if not (version.isascii() and version.isdigit()):
        raise NoSuchPath()
    return parse_version(version)


def _json(doc) -> web.Response:
    """JSON written compactly, as Triton writes it."""
    return web.json_response(doc, dumps=_compact)


def _compact(doc) -> str:
    return json.dumps(doc, separators=(",", ":"))


async def live(request):
    return web.json_response({"live": True})


async def ready(request):
    ok = _router(request).answers.any_server_up()
    return web.Response(status=200 if ok else 503)


async def server_metadata(request):
    return web.json_response({"name": SERVER_NAME, "version": SERVER_VERSION, "extensions": EXTENSIONS})


async def model_ready(request):
    version = _version(request)
    if _router(request).answers.model_ready(request.match_info["model"], version):
        return web.Response(status=200)
    return web.Response(status=400, text=_compact({"error": "Model version not ready"}))


_SUFFIXES = {"metadata": "", "config": "/config", "statistics": "/stats"}


async def _forward_get(request: web.Request, method: str) -> web.Response:
    """Metadata, config or statistics: Triton's answer for a loaded model, renamed to the
    name and version asked for; for a model that is not loaded, never a load (see
    ``Answers.model_call``)."""
    router = _router(request)
    asked = request.match_info["model"]
    version = _version(request)
    target, server = router.answers.answering_server(asked, method, version)
    if server is None or router.state.carrier_of(target.model) is not None:
        # Not loaded: from its config.pbtxt.  A family's variant: its family model's answer
        # without the family's own fields (Answers.model_call), whose JSON is Triton's.
        answer = (await router.answers.cold_answer(asked, method, target) if server is None
                  else await router.answers.model_call(asked, method, version))
        # Triton's HTTP config is the ModelConfig itself (gRPC wraps it in a response).
        return _json(triton_json(answer.config if method == "config" else answer))
    path = (f"/v2/models/{target.model}" + (f"/versions/{target.version}" if target.version else "")
            + _SUFFIXES[method])
    async with request.app[SESSION_KEY].get(f"http://{server.http_url}{path}") as resp:
        body = await resp.read()
        status, content_type = resp.status, resp.content_type
    if status != 200 or content_type != "application/json":
        text = router.decider.public_text(body.decode(errors="replace"), target.model, asked,
                                          router.state.carrier_of(target.model))
        return web.Response(text=text, status=status, content_type=content_type)
    doc = json.loads(body)
    _model, public_version = router.decider.public_identity(target)
    if method == "metadata":
        doc["name"] = asked
        if public_version is not None:
            doc["versions"] = [public_version]
    elif method == "config":
        doc["name"] = asked
    else:
        for stats in doc.get("model_stats", ()):
            stats["name"] = asked
            if public_version is not None:
                stats["version"] = public_version
    return _json(doc)


async def model_metadata(request):
    return await _forward_get(request, "metadata")


async def model_config(request):
    return await _forward_get(request, "config")


async def model_stats(request):
    return await _forward_get(request, "statistics")


async def all_stats(request):
    """Every loaded public model (Triton's GET /v2/models/stats)."""
    return _json(triton_json(await _router(request).answers.all_statistics()))


async def infer(request: web.Request) -> web.Response:
    router = _router(request)
    CLIENT.set(partial(http_client, router.config, request))
    version = _version(request)  # Triton routes no other URL: refused before the body is read
    return await http_inference.infer(router, request.app[SESSION_KEY], request, version)


async def model_health(request: web.Request) -> web.Response:
    """Whether the model a name routes to serves now, in Triton's terms (READY or
    UNAVAILABLE): the server it is on, its concrete version, load failures and warm-up errors
    are the operators' (the admin API's ``/health/{model}``), never a client's."""
    router = _router(request)
    route = request.match_info["model"]
    decision = router.answers.describe(route)
    healthy = bool((await router.state.health(decision.model)).get("healthy"))
    return web.json_response({"model": route, "healthy": healthy,
                              "state": "READY" if healthy else "UNAVAILABLE"},
                             status=200 if healthy else 503)


def metrics_registry(router: PublicRouter):
    """This router's series; with router workers (PROMETHEUS_MULTIPROC_DIR), every worker's,
    summed, whichever worker the scrape reaches."""
    directory = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    if not directory:
        return router.metrics.registry
    registry = CollectorRegistry()
    MultiProcessCollector(registry, directory)
    return registry


async def metrics(request: web.Request) -> web.Response:
    router = _router(request)
    router.metrics.writes.flush()  # this process's requests so far, not a moment later
    resp = web.Response(body=generate_latest(metrics_registry(router)))
    resp.content_type = CONTENT_TYPE_LATEST.split(";")[0]
    return resp


async def refused(request: web.Request) -> web.Response:
    _router(request).metrics.refused.labels(request.path.split("/")[2] if request.path.count("/") > 1 else "?").inc()
    raise PermissionDenied(
        f"{request.method} {request.path} is not available on the public port: model control, "
        "repository, log and trace APIs go through the control plane (mmctl)")


def make_http_app(router: PublicRouter) -> web.Application:
    # The infer handler decompresses request bodies itself (router/frontends/http_request.py).
    app = web.Application(middlewares=[error_middleware], client_max_size=router.config.max_request_bytes,
                          handler_args={"auto_decompress": False})
    logging.getLogger("aiohttp.server").addFilter(MALFORMED_HTTP_AS_INFO)
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
        web.get("/v2/models/stats", all_stats),  # before {model}: Triton's every-model statistics
        web.get(m, model_metadata), web.get(mv, model_metadata),
        web.get(m + "/ready", model_ready), web.get(mv + "/ready", model_ready),
        web.get(m + "/config", model_config), web.get(mv + "/config", model_config),
        web.get(m + "/stats", model_stats), web.get(mv + "/stats", model_stats),
        web.post(m + "/infer", infer), web.post(mv + "/infer", infer),
        web.get("/health/{model}", model_health),
        web.get("/metrics", metrics),
        web.route("*", "/v2/repository/{tail:.*}", refused),
        *shared_memory_routes(router),
        web.route("*", "/v2/logging", refused),
        web.route("*", "/v2/trace/setting", refused),
        web.route("*", m + "/trace/setting", refused),
    ])
    return app
