"""A Python client of the control plane's admin API: what ``mmctl`` uses, and what any
program that drives the product uses.

Every failure is an exception, never an exit: the admin API's own errors arrive as the
``domain.errors`` class of their code (``ModelNotFound``,
``CapacityExhausted``, ...); a control plane that cannot be reached is
``ControlPlaneUnreachable``; no answer in time is ``NoAnswerInTime`` (an
``OperationTimeout``); a refused token or call is ``AdminRefused`` with the API's code
(``unauthorized``, ``forbidden``, ...).

    from control_plane.client import AdminClient
    admin = AdminClient("http://127.0.0.1:8090", token_file=Path(".state/admin.token"))
    admin.load("cust007")["state"]   # "ready"
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

import requests

from domain.errors import (
    ERRORS_BY_CODE,
    ControlPlaneError,
    InvalidInput,
    OperationTimeout,
)
from domain.settings import ADMIN_TOKEN, env_text, setting

DEFAULT_URL = "http://127.0.0.1:8090"
DEFAULT_TOKEN_FILE = Path(".state") / "admin.token"  # where `mmctl up` (default --state-dir) writes it


class ControlPlaneUnreachable(ControlPlaneError):
    code = "unreachable"


class NoAnswerInTime(OperationTimeout):
    """The control plane did not answer within the client's timeout."""


class AdminRefused(ControlPlaneError):
    """The admin API refused the call itself (token, Host, Origin, content type)."""

    def __init__(self, code: str, message: str, status: int):
        super().__init__(message)
        self.code = code
        self.status = status


@dataclass
class ClientSettings:
    """How mmctl reaches the admin API: the options of ``mmctl`` itself (before the command),
    declared once (``domain.settings``).  MMCTL_URL and MMCTL_TOKEN_FILE, the
    names of earlier releases, are still read."""

    url: str = setting(DEFAULT_URL, "Admin API of the control plane.", flag="--url",
                       aliases=("MMCTL_URL",))
    timeout_s: float = setting(600.0, "Seconds to wait for an answer (loads can take long).",
                               flag="--timeout", parse=float)
    token_file: Path = setting(
        DEFAULT_TOKEN_FILE, "The admin token written by `mmctl up` into its --state-dir; "
        "MMS_ADMIN_TOKEN (or MMCTL_TOKEN), if set, is used instead.", flag="--token-file",
        parse=Path, metavar="PATH", aliases=("MMCTL_TOKEN_FILE",))
    admin_token: str | None = ADMIN_TOKEN.field()  # environment only (find_token)


def _token_names() -> str:
    """``MMS_ADMIN_TOKEN (or MMCTL_TOKEN)``."""
    return f"{ADMIN_TOKEN.env} (or {', '.join(ADMIN_TOKEN.aliases)})"


def find_token(token_file: Path | None = None) -> tuple[str | None, str]:
    """The admin token and where it came from: env MMS_ADMIN_TOKEN (or MMCTL_TOKEN), else
    ``token_file`` (default .state/admin.token) if it exists.  An unreadable file is
    InvalidInput."""
    found = env_text(ADMIN_TOKEN)
    if found is not None and found[1].strip():
        return found[1].strip(), found[0]
    path = token_file or DEFAULT_TOKEN_FILE
    try:
        token = path.read_text().strip()
    except FileNotFoundError:
        return None, f"no {_token_names()} and no token file at {path}"
    except OSError as exc:
        raise InvalidInput(f"cannot read the admin token file {path}: {exc.strerror}; run as the "
                           f"user that started `mmctl up`, or set {ADMIN_TOKEN.env}") from None
    return token or None, str(path)


class AdminClient:
    def __init__(self, url: str = DEFAULT_URL, timeout_s: float = 600.0, token_file: Path | None = None,
                 token: str | None = None):
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        self.token_file = token_file
        # (token, where it came from), read once at the first call unless given.
        self._token: tuple[str | None, str] | None = None if token is None else (token, "the caller")

    @property
    def token(self) -> str | None:
        return self.token_source[0]

    @property
    def token_source(self) -> tuple[str | None, str]:
        if self._token is None:
            self._token = find_token(self.token_file)
        return self._token

    def call(self, method: str, path: str, ok_statuses=(200,), body: dict | None = None,
             **params) -> tuple[int, dict | list]:
        """(status, JSON body) of one admin call; raises a ControlPlaneError otherwise."""
        resp = self._request(method, path, body, params)
        return self._answer(resp, ok_statuses)

    def stream(self, path: str, **params) -> Iterator[bytes]:
        """The body of a GET as it arrives (a status of thousands of models); raises a
        ControlPlaneError as ``call`` does when the call is refused."""
        resp = self._request("GET", path, None, params, stream=True)
        if resp.status_code != 200:
            self._answer(resp, (200,))
        yield from resp.iter_content(chunk_size=None)

    def _request(self, method: str, path: str, body: dict | None, params: dict,
                 stream: bool = False) -> requests.Response:
        token = self.token
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        if body is None and method.upper() not in ("GET", "HEAD"):
            body = {}  # the admin API takes state changes only as JSON, even with nothing to say
        params = {k: v for k, v in params.items() if v is not None}
        try:
            return requests.request(method, self.url + path, params=params or None, json=body,
                                    headers=headers, timeout=self.timeout_s, stream=stream)
        except requests.ConnectionError:
            raise ControlPlaneUnreachable(
                f"the control plane is not running at {self.url}; start it with `make up` (or "
                "`mmctl up`), or point --url / MMS_URL (or MMCTL_URL) at it") from None
        except requests.Timeout:
            raise NoAnswerInTime(f"no answer from {self.url} within {self.timeout_s:.0f}s (raise "
                                 "--timeout for big models)") from None

    def _answer(self, resp: requests.Response, ok_statuses) -> tuple[int, dict | list]:
        try:
            answer = resp.json()
        except ValueError:
            answer = {"error": "internal", "message": resp.text[:500]}
        if resp.status_code in ok_statuses:
            return resp.status_code, answer
        code = answer.get("error", "internal") if isinstance(answer, dict) else "internal"
        message = answer.get("message", str(answer)) if isinstance(answer, dict) else str(answer)
        cls = ERRORS_BY_CODE.get(code)
        if cls is None:
            raise AdminRefused(code, message, resp.status_code)
        raise cls(message)

    # ------------------------------------------------------------------ typed calls
    def status(self, match: str | None = None, state: str | None = None, tier: str | None = None,
               server: str | None = None) -> list[dict]:
        """Models: state, tier, server, pinned, last use, load time, memory; those whose
        name matches ``match`` (a name or a glob), in ``state``, ``tier``, on ``server``."""
        return self.call("GET", "/v1/status", match=match, state=state, tier=tier, server=server)[1]

    def status_without_warm(self) -> tuple[list[dict], int]:
        """Models but those only warm and not pinned, and how many those are."""
        body = self.call("GET", "/v1/status", warm="0")[1]
        return body["models"], body["warm_hidden"]

    def load(self, model: str) -> dict:
        return self.call("POST", f"/v1/models/{_q(model)}/load")[1]

    def unload(self, model: str, force: bool = False) -> dict:
        return self.call("POST", f"/v1/models/{_q(model)}/unload", **({"force": "1"} if force else {}))[1]

    def pin(self, model: str) -> dict:
        return self.call("POST", f"/v1/models/{_q(model)}/pin")[1]

    def unpin(self, model: str) -> dict:
        return self.call("POST", f"/v1/models/{_q(model)}/unpin")[1]

    def scale(self, model: str, replicas: int | str, minimum: int | None = None,
              maximum: int | None = None) -> dict:
        """Keep ``replicas`` copies of ``model``, each on its own server (``"auto"``: between
        ``minimum`` and ``maximum``, as its traffic needs)."""
        body: dict = {"replicas": replicas}
        body.update({k: v for k, v in (("min", minimum), ("max", maximum)) if v is not None})
        return self.call("POST", f"/v1/models/{_q(model)}/scale", body=body)[1]

    def health(self, model: str, probe: bool = False) -> dict:
        """The model's health (``healthy``, state, warm-up); an unhealthy model is an answer,
        not an error."""
        return self.call("GET", f"/health/{_q(model)}", ok_statuses=(200, 503),
                         **({"probe": "1"} if probe else {}))[1]

    def fleet(self) -> list[dict]:
        return self.call("GET", "/v1/fleet")[1]

    def endpoints(self) -> dict:
        return self.call("GET", "/v1/endpoints")[1]


def _q(model: str) -> str:
    return quote(model, safe="")
