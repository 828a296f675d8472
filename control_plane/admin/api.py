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

import hashlib
import hmac
import ipaddress
import json
import logging
import os
import secrets
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from control_plane.domain.errors import ControlPlaneError, InvalidInput
from control_plane.manager import ModelManager, ModelState

log = logging.getLogger(__name__)

TOKEN_FILE_NAME = "admin.token"  # in the state directory, mode 0600
SAFE_METHODS = frozenset({"GET", "HEAD"})
LOOPBACK_NAMES = frozenset({"localhost"})
WILDCARD_HOSTS = frozenset({"0.0.0.0", "::", ""})
# The status page's session: a cookie that opens these paths (GET/HEAD) only.
SESSION_COOKIE = "mms_session"
SESSION_TTL_S = 12 * 3600
SESSION_PATHS = frozenset({"/", "/v1/overview"})
SESSION_ENDPOINT = "/v1/session"  # POST {"token": ...} signs in, DELETE signs out
STATIC_PREFIX = "/static/"
TOKEN_HINT = ("mmctl sends it from MMS_ADMIN_TOKEN (or MMCTL_TOKEN) or its --token-file "
              "(default .state/admin.token, which `mmctl up` writes into its --state-dir); "
              "other clients send "
              "'Authorization: Bearer <token>'")


class Unauthorized(ControlPlaneError):
    """No or a wrong admin token -> 401."""

    http_status = 401
    code = "unauthorized"


class Forbidden(ControlPlaneError):
    """Host or Origin of a request that did not come from an admin client -> 403."""

    http_status = 403
    code = "forbidden"


class UnsupportedMediaType(ControlPlaneError):
    """A state-changing request that is not declared JSON -> 415."""

    http_status = 415
    code = "unsupported_media_type"


@dataclass(frozen=True)
class AdminAccess:
    """Who may call the admin API.

    ``token``: the bearer token every non-public request must carry; None turns the token
    check off (in-process tests only; ``mmctl up`` always sets one).  ``bind_host``: the
    address the API listens on; Host headers may name it, a loopback address, ``localhost``
    or one of ``allowed_hosts``; when it is a wildcard (0.0.0.0, ::) any IP address and the
    machine's own names are accepted as well.
    """

    token: str | None = None
    bind_host: str = "127.0.0.1"
    allowed_hosts: frozenset[str] = frozenset()

    def host_allowed(self, host_header: str | None) -> bool:
        if not host_header:
            return False
        try:
            parts = urlsplit("//" + host_header)
            parts.port  # noqa: B018  (raises ValueError on a malformed port)
            name = (parts.hostname or "").rstrip(".")
        except ValueError:
            return False
        if not name:
            return False
        bind = self.bind_host.strip("[]").lower()
        try:
            address = ipaddress.ip_address(name)
        except ValueError:  # a name: only ours (a name an attacker controls may point here)
            return name in LOOPBACK_NAMES or name == bind or name in self.allowed_hosts
        # An address literal cannot be re-pointed by DNS, so it is no rebinding risk; still
        # accept only the ones that reach this server.
        return (address.is_loopback or bind in WILDCARD_HOSTS
                or address == _address_or_none(bind) or name in self.allowed_hosts)

    def token_ok(self, authorization: str | None) -> bool:
        if self.token is None:
            return True
        scheme, _, given = (authorization or "").partition(" ")
        return scheme.lower() == "bearer" and self.token_matches(given.strip())

    def token_matches(self, given: str) -> bool:
        return self.token is None or hmac.compare_digest(given.encode(), self.token.encode())

    def session_value(self, now: float) -> str:
        """A session cookie's value: its expiry and a MAC of it keyed by the token."""
        expires = int(now + SESSION_TTL_S)
        return f"{expires}.{self._session_mac(expires)}"

    def session_ok(self, value: str | None, now: float) -> bool:
        if self.token is None:
            return True
        expires, _, mac = (value or "").partition(".")
        if not expires.isdigit() or int(expires) <= now:
            return False
        return hmac.compare_digest(mac.encode(), self._session_mac(int(expires)).encode())

    def _session_mac(self, expires: int) -> str:
        return hmac.new((self.token or "").encode(), f"mms-status-page:{expires}".encode(),
                        hashlib.sha256).hexdigest()


def _address_or_none(text: str):
    try:
        return ipaddress.ip_address(text)
    except ValueError:
        return None


def access_for(bind_host: str, token: str | None, extra_hosts: Iterable[str] = ()) -> AdminAccess:
    """The AdminAccess of an API bound to ``bind_host``; a wildcard bind also answers to the
    machine's host names (how other machines on a private network reach it)."""
    names = {h.strip().strip("[]").rstrip(".").lower() for h in extra_hosts if h.strip()}
    if bind_host in WILDCARD_HOSTS:
        import socket

        names |= {socket.gethostname().lower(), socket.getfqdn().lower()}
    return AdminAccess(token=token, bind_host=bind_host, allowed_hosts=frozenset(names))


def _public(request: web.Request) -> bool:
    """Read-only endpoints a Prometheus scraper or a liveness probe calls without a token.
    A health probe (``?probe=1``) runs an inference, so it needs the token."""
    if request.method not in SAFE_METHODS:
        return False
    if request.path in ("/metrics", "/health", "/livez", "/readyz"):
        return True
    if request.path.startswith(STATIC_PREFIX):
        return True
    return request.path.startswith("/health/") and "probe" not in request.query


def _signs_in(request: web.Request) -> bool:
    """The sign-in call carries the token in its body; its handler checks it."""
    return request.path == SESSION_ENDPOINT and request.method in ("POST", "DELETE")


def _session_opens(request: web.Request, access: AdminAccess) -> bool:
    return (request.method in SAFE_METHODS and request.path in SESSION_PATHS
            and access.session_ok(request.cookies.get(SESSION_COOKIE), time.time()))


def access_middleware(access: AdminAccess):
    @web.middleware
    async def check_access(request: web.Request, handler):
        host = request.headers.get("Host")
        if not access.host_allowed(host):
            raise Forbidden(
                f"the admin API does not answer to Host {host!r}; call it by a loopback address, "
                f"'localhost' or its bound address ({access.bind_host}); add names with "
                "mmctl up --admin-allowed-host")
        origin = request.headers.get("Origin")
        fetch_site = request.headers.get("Sec-Fetch-Site", "").lower()
        if (origin is not None and origin.lower() != f"{request.scheme}://{host}".lower()) \
                or fetch_site in ("cross-site", "same-site"):
            raise Forbidden(f"cross-origin request from {origin or fetch_site!r} refused: the "
                            "admin API takes no requests from web pages")
        if not (_public(request) or _signs_in(request)
                or access.token_ok(request.headers.get("Authorization"))
                or _session_opens(request, access)):
            given = "a wrong token" if request.headers.get("Authorization") else "no token"
            raise Unauthorized(f"the admin API needs its token and got {given}: {TOKEN_HINT}")
        if request.method not in SAFE_METHODS and request.content_type != "application/json":
            sent = request.headers.get("Content-Type")
            raise UnsupportedMediaType(
                f"{request.method} {request.path} must be sent with Content-Type: "
                f"application/json (got {sent or 'none'}); send {{}} when there is nothing to say")
        return await handler(request)

    return check_access


def ensure_token_file(path: Path, token: str | None = None) -> str:
    """The admin token, kept in ``path`` with mode 0600 so mmctl on this machine finds it.

    ``token`` given (``--admin-token`` / MMS_ADMIN_TOKEN): written there.  Otherwise the file's
    token is reused, so clients keep working across restarts (delete the file to rotate it),
    unless the file is empty or readable by others; then a new one is generated.
    """
    if token is None and path.is_file():
        mode = path.stat().st_mode & 0o777
        existing = path.read_text().strip()
        if existing and not mode & 0o077:
            return existing
        if existing:
            log.warning("%s was readable by other users (mode %o); generating a new admin token",
                        path, mode)
    token = token or secrets.token_urlsafe(32)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        os.fchmod(f.fileno(), 0o600)  # O_CREAT's mode does not apply to an existing file
        f.write(token + "\n")
    return token

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
    for rec in records:
        row = rec.to_dict()
        if locate is not None:  # hot / warm / cold, from the warm tier
            row["tier"] = locate(rec.name)["tier"]
        if tier is None or row.get("tier", "hot" if rec.server else "warm") == tier:
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
        web.get("/health/{model}", health),
        web.get("/health", service_health),
        web.get("/v1/fleet", fleet),
        web.get("/v1/endpoints", endpoints),
        web.get("/metrics", metrics),
        web.get("/livez", livez),
        web.get("/readyz", readyz),
    ])
    return app
