"""Pieces every ``mmctl`` command module shares: the admin-API client and exit codes."""

from __future__ import annotations

import datetime as dt
import getpass
import os
import sys
from pathlib import Path

import click
import requests

EXIT_OK, EXIT_ERROR, EXIT_USAGE, EXIT_UNREACHABLE = 0, 1, 2, 3
EXIT_NOT_FOUND, EXIT_CAPACITY, EXIT_LOAD_FAILED, EXIT_TIMEOUT, EXIT_UNHEALTHY = 4, 5, 6, 7, 8
EXIT_BY_ERROR = {
    "invalid_input": EXIT_USAGE,
    "invalid_model_name": EXIT_USAGE,
    "model_not_found": EXIT_NOT_FOUND,
    "capacity_exhausted": EXIT_CAPACITY,
    "load_failed": EXIT_LOAD_FAILED,
    "triton_unavailable": EXIT_UNREACHABLE,
    "timeout": EXIT_TIMEOUT,
    # The admin API refused the caller (token, Host, Origin, content type): fix the call.
    "unauthorized": EXIT_USAGE,
    "forbidden": EXIT_USAGE,
    "unsupported_media_type": EXIT_USAGE,
}
DEFAULT_URL = "http://127.0.0.1:8090"
DEFAULT_TOKEN_FILE = Path(".state") / "admin.token"  # where `mmctl up` (default --state-dir) writes it


def find_token(token_file: Path | None) -> tuple[str | None, str]:
    """The admin token and where it came from: env MMCTL_TOKEN, else ``token_file``
    (``--token-file`` / MMCTL_TOKEN_FILE, default .state/admin.token) if it exists."""
    token = os.environ.get("MMCTL_TOKEN", "").strip()
    if token:
        return token, "MMCTL_TOKEN"
    path = token_file or DEFAULT_TOKEN_FILE
    try:
        token = path.read_text().strip()
    except FileNotFoundError:
        return None, f"no MMCTL_TOKEN and no token file at {path}"
    except OSError as exc:
        click.echo(f"error: cannot read the admin token file {path}: {exc.strerror}; run mmctl as "
                   "the user that started `mmctl up`, or set MMCTL_TOKEN", err=True)
        sys.exit(EXIT_USAGE)
    return token or None, str(path)


class Api:
    def __init__(self, url: str, timeout_s: float, token_file: Path | None = None):
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        self.token_file = token_file
        self._token: tuple[str | None, str] | None = None  # read at the first call

    @property
    def token(self) -> str | None:
        if self._token is None:
            self._token = find_token(self.token_file)
        return self._token[0]

    def call(self, method: str, path: str, ok_statuses=(200,), body: dict | None = None, **params):
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        if body is None and method.upper() not in ("GET", "HEAD"):
            body = {}  # the admin API takes state changes only as JSON, even with nothing to say
        try:
            resp = requests.request(method, self.url + path, params=params or None, json=body,
                                    headers=headers, timeout=self.timeout_s)
        except requests.ConnectionError:
            click.echo(f"error: the control plane is not running at {self.url}; start it with "
                       "`make up` (or `mmctl up`), or point --url / MMCTL_URL at it", err=True)
            sys.exit(EXIT_UNREACHABLE)
        except requests.Timeout:
            click.echo(f"error: no answer from {self.url} within {self.timeout_s:.0f}s "
                       "(raise --timeout for big models)", err=True)
            sys.exit(EXIT_TIMEOUT)
        try:
            body = resp.json()
        except ValueError:
            body = {"error": "internal", "message": resp.text[:500]}
        if resp.status_code not in ok_statuses:
            click.echo(f"error: {body.get('message', body)}", err=True)
            if resp.status_code == 401:
                source = self._token[1] if self._token else ""
                sent = f"the token from {source}" if self.token else source
                click.echo(f"(mmctl sent {sent})", err=True)
            sys.exit(EXIT_BY_ERROR.get(body.get("error"), EXIT_ERROR))
        return resp.status_code, body


pass_api = click.make_pass_decorator(Api)


def _table(rows: list[list[str]], headers: list[str]) -> str:
    widths = [max(len(str(x)) for x in col) for col in zip(headers, *rows)]
    lines = ["  ".join(str(h).ljust(w) for h, w in zip(headers, widths))]
    lines += ["  ".join(str(c).ljust(w) for c, w in zip(row, widths)) for row in rows]
    return "\n".join(line.rstrip() for line in lines)




def current_api() -> Api:
    """The Api of the running ``mmctl`` invocation (set by the root group)."""
    return click.get_current_context().find_root().obj


def fmt_bytes(n) -> str:
    if not n:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def fmt_ago(ts) -> str:
    if not ts:
        return "-"
    secs = max(0.0, dt.datetime.now().timestamp() - ts)
    if secs < 60:
        return f"{secs:.0f}s ago"
    if secs < 3600:
        return f"{secs / 60:.0f}m ago"
    return f"{secs / 3600:.1f}h ago"


def who_am_i() -> str:
    """Recorded as the author of registry and adapter changes."""
    try:
        return getpass.getuser()
    except (KeyError, OSError):  # no user name in this environment
        return "mmctl"
