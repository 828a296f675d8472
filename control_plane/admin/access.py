"""Who may call the admin API: the bearer token, the Host and Origin checks that keep a
browser page elsewhere from calling it, the status page's session cookie, and the token
file `mmctl up` writes.  ``access_middleware`` applies them to every request."""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging
import re
import secrets
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from aiohttp import web

from control_plane.state.secret_files import ensure_secret_file
from domain.errors import ControlPlaneError
from domain.settings import MIN_TOKEN_CHARS

log = logging.getLogger(__name__)

TOKEN_FILE_NAME = "admin.token"  # in the state directory, mode 0600
DATAPLANE_TOKEN_FILE_NAME = "dataplane.token"  # likewise: the router workers' credential
DATAPLANE_PREFIX = "/v1/dataplane/"  # all that the data-plane token opens
SAFE_METHODS = frozenset({"GET", "HEAD"})
LOOPBACK_NAMES = frozenset({"localhost"})
WILDCARD_HOSTS = frozenset({"0.0.0.0", "::", ""})
# The status page's session: a cookie that opens these paths (GET/HEAD) only.
SESSION_COOKIE = "mms_session"
SESSION_TTL_S = 12 * 3600
SESSION_PATHS = frozenset({"/", "/v1/overview"})
SESSION_ENDPOINT = "/v1/session"  # POST {"token": ...} signs in, DELETE signs out
STATIC_PREFIX = "/static/"
# Wrong tokens one client address may send in a window before its token checks are refused.
WRONG_TOKEN_LIMIT = 20
WRONG_TOKEN_WINDOW_S = 60.0
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


class TooManyAttempts(ControlPlaneError):
    """Too many wrong admin tokens from one address -> 429."""

    http_status = 429
    code = "too_many_attempts"


class WrongTokens:
    """Wrong admin tokens per client address.  Past ``limit`` in ``window_s``, that address's
    token checks are refused (429) until the window has passed, with the right token too:
    otherwise a guess could still be confirmed.  Loopback clients are exempt by default: they
    cannot be told apart, and one local process guessing must not lock mmctl out; the token
    `mmctl up` generates has 256 bits, and one given by hand must have ``MIN_TOKEN_CHARS``."""

    def __init__(self, limit: int = WRONG_TOKEN_LIMIT, window_s: float = WRONG_TOKEN_WINDOW_S,
                 exempt_loopback: bool = True, clock=time.monotonic):
        self.limit, self.window_s, self.exempt_loopback, self.clock = limit, window_s, exempt_loopback, clock
        self._wrong: dict[str, list[float]] = {}  # address -> times of its wrong tokens

    def _exempt(self, address: str | None) -> bool:
        if not self.exempt_loopback:
            return False
        try:
            return address is None or ipaddress.ip_address(address).is_loopback
        except ValueError:  # a unix socket path
            return True

    def _recent(self, address: str) -> list[float]:
        horizon = self.clock() - self.window_s
        times = [t for t in self._wrong.get(address, ()) if t > horizon]
        if times:
            self._wrong[address] = times
        else:
            self._wrong.pop(address, None)
        return times

    def refuse_if_over(self, address: str | None) -> None:
        if self._exempt(address):
            return
        times = self._recent(address)
        if len(times) >= self.limit:
            wait_s = max(1, round(times[0] + self.window_s - self.clock()))
            raise TooManyAttempts(f"{len(times)} wrong admin tokens from {address} in the last "
                                  f"{self.window_s:.0f} s: token checks from there resume in "
                                  f"{wait_s} s; {TOKEN_HINT}")

    def note_wrong(self, address: str | None) -> None:
        if self._exempt(address):
            return
        if len(self._wrong) > 10_000:  # many addresses: forget the ones whose window passed
            for known in list(self._wrong):
                self._recent(known)
        self._wrong.setdefault(address, []).append(self.clock())


class UnsupportedMediaType(ControlPlaneError):
    """A state-changing request that is not declared JSON -> 415."""

    http_status = 415
    code = "unsupported_media_type"


def same_secret(given: str, secret: str) -> bool:
    """Constant-time comparison of a secret the client sent with ours.  What the client sent
    may hold any code point (a header's bytes that are not UTF-8 come as surrogates, so may a
    JSON string): it is compared, never a reason for an error."""
    return hmac.compare_digest(given.encode("utf-8", "surrogatepass"), secret.encode())


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
    # The router workers' credential: opens DATAPLANE_PREFIX only (None: no such token; the
    # admin token opens those routes too, so workers of an older deployment keep working).
    dataplane_token: str | None = field(default=None, repr=False)
    allowed_hosts: frozenset[str] = frozenset()
    wrong_tokens: WrongTokens = field(default_factory=WrongTokens, compare=False)
    revocations: SessionRevocations | None = field(default=None, compare=False)

    def check_token(self, given: str, address: str | None) -> bool:
        """``given`` is the token, counted against ``address`` when it is not (TooManyAttempts
        once that address sent too many wrong ones)."""
        self.wrong_tokens.refuse_if_over(address)
        if self.token_matches(given):
            return True
        self.wrong_tokens.note_wrong(address)
        return False

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

    def token_ok(self, authorization: str | None, address: str | None = None,
                 path: str = "") -> bool:
        """Whether ``authorization`` opens ``path``: the admin token opens everything, the
        data-plane token DATAPLANE_PREFIX only (Forbidden elsewhere: it is no guess)."""
        if self.token is None:
            return True
        scheme, _, given = (authorization or "").partition(" ")
        if scheme.lower() != "bearer":
            return False
        given = given.strip()
        # A locked-out address is refused before any comparison, the data-plane token's too:
        # a right guess must get the same 429 as a wrong one (check_token asks again, free).
        self.wrong_tokens.refuse_if_over(address)
        if self.dataplane_token and same_secret(given, self.dataplane_token):
            if path.startswith(DATAPLANE_PREFIX):
                return True
            raise Forbidden(f"the data-plane token opens {DATAPLANE_PREFIX}* only, the router "
                            "workers' endpoints; model control and everything else need the "
                            f"admin token: {TOKEN_HINT}")
        return self.check_token(given, address)

    def token_matches(self, given: str) -> bool:
        return self.token is None or same_secret(given, self.token)

    def session_value(self, now: float) -> str:
        """A session cookie's value: its expiry, its id and a MAC of both keyed by the token
        (nothing kept per session; sign-out records the id, see SessionRevocations)."""
        expires, sid = int(now + SESSION_TTL_S), secrets.token_hex(16)
        return f"{expires}.{sid}.{self._session_mac(expires, sid)}"

    def session_ok(self, value: str | None, now: float) -> bool:
        if self.token is None:
            return True
        session = self._session(value, now)
        return session is not None and not (self.revocations is not None
                                            and self.revocations.revoked(session[1]))

    def end_session(self, value: str | None, now: float) -> None:
        """Sign-out: the session ``value`` opens nothing from now on, on every control plane
        that shares the state store."""
        session = self._session(value, now)
        if session is not None and self.revocations is not None:
            self.revocations.revoke(session[1], session[0])

    def _session(self, value: str | None, now: float) -> tuple[int, str] | None:
        """(expiry, id) of a well-formed, unexpired session of ours, else None."""
        found = _SESSION_FORM.fullmatch(value or "")
        if found is None or int(found[1]) <= now:
            return None
        expires, sid = int(found[1]), found[2]
        if not same_secret(found[3], self._session_mac(expires, sid)):
            return None
        return expires, sid

    def _session_mac(self, expires: int, sid: str) -> str:
        return hmac.new((self.token or "").encode(), f"mms-status-page:{expires}:{sid}".encode(),
                        hashlib.sha256).hexdigest()


# expiry (ASCII digits: str.isdigit takes characters int() refuses), id, MAC
_SESSION_FORM = re.compile(r"([0-9]{1,12})\.([0-9a-f]{32})\.([0-9a-f]{64})", re.ASCII)


class SessionRevocations:
    """Sessions ended by sign-out, kept in the state store so that the leader, its standbys
    and the next life refuse them alike.  A lookup is remembered for ``cache_s`` (the page
    polls every 2 s); a revocation made here counts at once."""

    PREFIX = "session-revoked:"
    MAX_REMEMBERED = 10_000

    def __init__(self, get: Callable[[str], str | None], put: Callable[[str, str], None],
                 cache_s: float = 2.0, clock: Callable[[], float] = time.monotonic):
        self._get, self._put, self.cache_s, self.clock = get, put, cache_s, clock
        self._seen: dict[str, tuple[bool, float]] = {}  # id -> (revoked, until)

    def revoke(self, sid: str, expires: int) -> None:
        self._put(self.PREFIX + sid, str(expires))
        self._remember(sid, True, float("inf"))

    def revoked(self, sid: str) -> bool:
        now = self.clock()
        known = self._seen.get(sid)
        if known is not None and known[1] > now:
            return known[0]
        revoked = self._get(self.PREFIX + sid) is not None
        self._remember(sid, revoked, float("inf") if revoked else now + self.cache_s)
        return revoked

    def _remember(self, sid: str, revoked: bool, until: float) -> None:
        if len(self._seen) >= self.MAX_REMEMBERED:
            self._seen.clear()
        self._seen[sid] = (revoked, until)


def _address_or_none(text: str):
    try:
        return ipaddress.ip_address(text)
    except ValueError:
        return None


def access_for(bind_host: str, token: str | None, extra_hosts: Iterable[str] = (),
               dataplane_token: str | None = None,
               revocations: SessionRevocations | None = None) -> AdminAccess:
    """The AdminAccess of an API bound to ``bind_host``; a wildcard bind also answers to the
    machine's host names (how other machines on a private network reach it)."""
    names = {h.strip().strip("[]").rstrip(".").lower() for h in extra_hosts if h.strip()}
    if bind_host in WILDCARD_HOSTS:
        import socket

        names |= {socket.gethostname().lower(), socket.getfqdn().lower()}
    return AdminAccess(token=token, bind_host=bind_host, allowed_hosts=frozenset(names),
                       dataplane_token=dataplane_token, revocations=revocations)


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
        if not (_public(request) or _signs_in(request) or _session_opens(request, access)
                or access.token_ok(request.headers.get("Authorization"), request.remote,
                                   request.path)):
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
    """The admin token, kept in ``path`` with mode 0600 so mmctl on this machine finds it
    (``--admin-token`` / MMS_ADMIN_TOKEN given: written there; see ensure_secret_file)."""
    return ensure_secret_file(path, token, what="admin token")


def ensure_dataplane_token_file(path: Path, token: str | None = None) -> str:
    """The data-plane token, kept in ``path`` with mode 0600 (MMS_DATAPLANE_TOKEN given:
    written there).  One set by hand, in the environment or written into the file, needs
    MIN_TOKEN_CHARS like the admin token; a shorter one raises InvalidInput at start."""
    return ensure_secret_file(path, token, what="data-plane token", min_chars=MIN_TOKEN_CHARS,
                              setting="MMS_DATAPLANE_TOKEN")
