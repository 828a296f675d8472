"""Pieces every ``mmctl`` command module shares: the admin-API client and exit codes."""

from __future__ import annotations

import contextlib
import datetime as dt
import getpass
import math
import sys

import click

from control_plane.client import AdminClient, ControlPlaneUnreachable
from domain.errors import ControlPlaneError
from domain.exit_codes import EXIT_BY_ERROR, EXIT_ERROR, EXIT_UNREACHABLE


class Api(AdminClient):
    """The admin client of one ``mmctl`` invocation: an error is printed, with what to do,
    and ends mmctl with its documented exit code (``EXIT_BY_ERROR``)."""

    def call(self, method: str, path: str, ok_statuses=(200,), body: dict | None = None, **params):
        with self._exit_on_error():
            return super().call(method, path, ok_statuses, body, **params)

    def stream(self, path: str, **params):
        with self._exit_on_error():
            yield from super().stream(path, **params)

    @contextlib.contextmanager
    def _exit_on_error(self):
        try:
            yield
        except ControlPlaneUnreachable as exc:
            click.echo(f"error: {exc.message}", err=True)
            sys.exit(EXIT_UNREACHABLE)
        except ControlPlaneError as exc:
            click.echo(f"error: {exc.message}", err=True)
            if exc.code == "unauthorized":
                token, source = self.token_source
                click.echo(f"(mmctl sent {f'the token from {source}' if token else source})", err=True)
            sys.exit(EXIT_BY_ERROR.get(exc.code, EXIT_ERROR))


pass_api = click.make_pass_decorator(Api)


class FiniteFloat(click.ParamType):
    """A number option sent in a JSON body: NaN and infinity are refused here, with the
    option's name (JSON has no such numbers: the body could not even be written)."""

    name = "number"

    def convert(self, value, param, ctx):
        if isinstance(value, float):
            number = value
        else:
            try:
                number = float(value)
            except (TypeError, ValueError):
                self.fail(f"{value!r} is not a number", param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value!r} is not a finite number", param, ctx)
        return number


FINITE = FiniteFloat()


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
