"""The status page: the fleet at a glance, in a browser, on the admin API's port.

``GET /`` is the page (``static/index.html`` and its script), ``GET /v1/overview`` its data
(``overview``), polled every two seconds; ``POST /v1/session`` signs a browser in with the
admin token (a session cookie, see ``control_plane.admin.api``), ``DELETE`` signs it out.
Everything is read-only and served from this package: no asset comes from anywhere else,
so the page works on a machine without a network.  The page writes every value into the
document as text (``textContent``), never as markup: a model name, a failure message or
a filter cannot inject any.

Handlers only translate HTTP; ``Overview`` builds the document.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from importlib import resources

from aiohttp import web

from control_plane.admin.access import (
    SESSION_COOKIE,
    SESSION_ENDPOINT,
    SESSION_TTL_S,
    STATIC_PREFIX,
    Unauthorized,
)
from control_plane.admin.api import ACCESS_KEY, PAGE_HEADERS, SIGN_IN_KEY, json_body
from control_plane.admin.status_page.history import SAMPLE_EVERY_S
from control_plane.admin.status_page.overview import Overview, OverviewCache, StatusSources
from domain.errors import InvalidInput
from domain.periodic import run_periodically

__all__ = ["StatusSources", "add_status_page"]

STATIC_TYPES = {".html": "text/html", ".js": "text/javascript", ".css": "text/css",
                ".svg": "image/svg+xml"}
OVERVIEW_KEY = web.AppKey("status_overview", OverviewCache)
FILES_KEY = web.AppKey("status_files", dict)


def static_files() -> dict[str, tuple[bytes, str]]:
    """Every file of ``static/`` by name, read once: the only files the page route serves
    (a name not in this dict is a 404, so no path reaches the filesystem)."""
    files = {}
    for entry in resources.files(__package__).joinpath("static").iterdir():
        suffix = "." + entry.name.rsplit(".", 1)[-1]
        if entry.is_file() and suffix in STATIC_TYPES:
            files[entry.name] = (entry.read_bytes(), STATIC_TYPES[suffix])
    return files


async def page(request: web.Request) -> web.Response:
    body, _ = request.app[FILES_KEY]["index.html"]
    return web.Response(body=body, content_type="text/html", charset="utf-8",
                        headers=PAGE_HEADERS)


async def static(request: web.Request) -> web.Response:
    found = request.app[FILES_KEY].get(request.match_info["name"])
    if found is None:
        raise web.HTTPNotFound()
    body, content_type = found
    return web.Response(body=body, content_type=content_type,
                        headers={**PAGE_HEADERS, "Cache-Control": "no-cache"})


async def overview(request: web.Request) -> web.Response:
    body = await request.app[OVERVIEW_KEY].body()
    resp = web.Response(body=body, content_type="application/json",
                        headers={"Cache-Control": "no-store", "X-Content-Type-Options": "nosniff"})
    resp.enable_compression()
    return resp


async def sign_in(request: web.Request) -> web.Response:
    token = (await json_body(request)).get("token")
    if not isinstance(token, str) or not token.strip():
        raise InvalidInput("send the admin token as {\"token\": \"...\"}")
    access = request.app[ACCESS_KEY]
    if not access.check_token(token.strip(), request.remote):
        raise Unauthorized("that is not the admin token: it is in the file `mmctl endpoints` "
                           "names as admin_token_file (.state/admin.token by default)")
    resp = web.json_response({"signed_in": True, "expires_in_s": SESSION_TTL_S},
                             headers={"Cache-Control": "no-store"})
    resp.set_cookie(SESSION_COOKIE, access.session_value(time.time()), max_age=SESSION_TTL_S,
                    path="/", httponly=True, samesite="Strict", secure=served_over_tls(request))
    return resp


def served_over_tls(request: web.Request) -> bool:
    """The browser reached us over HTTPS: directly, or through a proxy that terminated TLS
    and says so (X-Forwarded-Proto / Forwarded).  Believing a forged header only makes the
    cookie stricter, never weaker."""
    if request.secure or request.headers.get("X-Forwarded-Proto", "").lower() == "https":
        return True
    return "proto=https" in request.headers.get("Forwarded", "").lower().replace(" ", "")


async def sign_out(request: web.Request) -> web.Response:
    """Ends the session for good (the cookie opens nothing any more, on any control plane
    sharing the state store), then clears it in the browser."""
    request.app[ACCESS_KEY].end_session(request.cookies.get(SESSION_COOKIE), time.time())
    resp = web.json_response({"signed_in": False})
    resp.del_cookie(SESSION_COOKIE, path="/")
    return resp


def add_status_page(app: web.Application, sources: StatusSources) -> Overview:
    """The page's routes on the admin app, and its sampler while the app runs."""
    built = Overview(sources)
    app[OVERVIEW_KEY] = OverviewCache(built)
    app[FILES_KEY] = static_files()
    app[SIGN_IN_KEY] = app[FILES_KEY]["signin.html"][0]
    app.add_routes([
        web.get("/", page),
        web.get(STATIC_PREFIX + "{name}", static),
        web.get("/v1/overview", overview),
        web.post(SESSION_ENDPOINT, sign_in),
        web.delete(SESSION_ENDPOINT, sign_out),
    ])

    async def sampler(app: web.Application):
        failures = getattr(sources.manager.metrics, "loop_failures", None)
        task = asyncio.get_running_loop().create_task(run_periodically(
            "status-history", built.sample_control_plane, SAMPLE_EVERY_S, failures))
        yield
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await built.close()
        close = getattr(sources.router_metrics, "close", None)
        if close is not None:
            await close()

    app.cleanup_ctx.append(sampler)
    return built
