"""Settings declared once.

A setting is one field of a config dataclass (``ServiceConfig``, the router's
``WorkerConfig``, ``ClientSettings``, ``S3Config``) whose metadata holds a ``Setting``:
its default, help, flag, environment variable and the older environment names still read.
Everything else is derived from that declaration:

* mmctl's click options (``mmctl.settings``) and the mapping of their values
  into the config object;
* the argparse parser of a process mmctl starts (``parse_argv``) and the argv that starts
  it (``to_argv``), so what the parent passes is what the child parses;
* settings read from the environment only (``env_values``: S3, secrets);
* the settings table of the docs (``mmctl settings --markdown``).

A setting that two config classes share (the router's public ports are settings of
``mmctl up`` and of ``mmctl router``) is the same ``Setting`` object in both
(``same_as``), so its default, help and environment variable exist once.

Environment variables: ``MMS_`` and the flag's name (``--max-loaded`` -> ``MMS_MAX_LOADED``)
unless a setting names its own.  The names of earlier releases (``MMCTL_TOKEN``,
``MMCTL_URL``, ...) stay readable as a setting's ``aliases``; the ``MMS_`` name wins where
both are set.  An empty variable counts as unset (as click has it) unless the setting says
that empty is a value.  Switches of the test suite (``TEST_SWITCHES``) are not settings.

Nothing here reads argv or the environment at import time.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from domain.errors import InvalidInput

ENV_PREFIX = "MMS_"
# Switches of the test suite, never settings a user sets: MMS_TEST_FAKE_NVML
# (control_plane/triton/fake_nvml.py) and MMS_STRICT_TRANSITIONS
# (control_plane/manager/records.py).  No setting's environment variable may take these
# names or the MMS_TEST_ prefix (tests/unit/test_settings.py).
TEST_SWITCH_PREFIX = "MMS_TEST_"
TEST_SWITCHES = frozenset({"MMS_TEST_FAKE_NVML", "MMS_STRICT_TRANSITIONS"})

# How a setting is written on a command line.
VALUE = "value"        # --name VALUE
FLAG = "flag"          # --name (off when absent)
SWITCH = "switch"      # --name / --no-name
MULTIPLE = "multiple"  # --name VALUE, repeatable; whitespace-separated in the environment

_KEY = "mms.setting"
_TRUE = frozenset({"1", "true", "t", "yes", "y", "on"})
_FALSE = frozenset({"0", "false", "f", "no", "n", "off"})


@dataclass(frozen=True, eq=False)  # eq=False: one object per declaration, compared by identity
class Setting:
    """One setting: everything a user reads about it and every way it reaches the product.

    ``parse`` turns one value as written (flag, environment) into the config's value and
    raises InvalidInput or ValueError; ``show`` is its inverse (argv, shown default).  For a
    MULTIPLE setting both work on one item and ``collect`` makes the field's value of the
    items (list, dict of pairs).  ``secret``: never in argv or a file, it travels in the
    environment.  ``internal``: plumbing between the product's own processes (a file the
    supervisor names), no environment variable, not in the docs.
    """

    default: Any
    help: str
    flag: str | None = None  # None: environment only
    env: str | None = None  # default: MMS_ + the flag's name
    aliases: tuple[str, ...] = ()  # older environment names, still read after ``env``
    parse: Callable[[str], Any] = str
    show: Callable[[Any], str] = str
    kind: str = VALUE
    choices: tuple[str, ...] | None = None
    metavar: str | None = None
    secret: bool = False
    internal: bool = False
    required: bool = False
    keep_empty: bool = False  # an empty environment variable is a value, not "unset"
    collect: Callable[[list], Any] = list
    old_flags: tuple[str, ...] = ()  # spellings still accepted on the command line

    def __post_init__(self) -> None:
        if self.env is None and self.flag and not self.internal:
            object.__setattr__(self, "env", ENV_PREFIX + self.flag.lstrip("-").replace("-", "_").upper())

    @property
    def env_names(self) -> tuple[str, ...]:
        """The environment variables read, in order: the MMS_ name, then the old ones."""
        return ((self.env,) if self.env else ()) + self.aliases

    @property
    def help_with_env(self) -> str:
        """The help, and the variables that set it: ``... (env MMS_X or MMCTL_X)``."""
        return f"{self.help} (env {' or '.join(self.env_names)})" if self.env_names else self.help

    def field(self, flag: str | None = None, commands: tuple[str, ...] | None = None) -> Any:
        """A dataclass field holding this setting.  ``flag``: another spelling for the
        commands of this config class (``--router-host`` for the worker's ``--host``);
        ``commands``: the mmctl commands among those of the class that take it (None: all)."""
        meta = {_KEY: _Binding(self, flag or self.flag, commands)}
        if self.kind == MULTIPLE:
            return dataclasses.field(default_factory=lambda: self.collect(list(self.default)),
                                     metadata=meta)
        return dataclasses.field(default=self.default, metadata=meta)

    def parse_one(self, text: str) -> Any:
        """One value as written; InvalidInput, quoting it, when it is not one."""
        if self.kind in (FLAG, SWITCH):
            return _boolean(text)
        if text == "" and self.default is None and self.parse is str:
            return None  # an empty optional text is unset (--admin-token "")
        if self.choices is not None and text not in self.choices:
            raise InvalidInput(f"{text!r} is not one of {', '.join(self.choices)}")
        try:
            return self.parse(text)
        except ValueError:
            raise InvalidInput(f"{text!r} is not {_WHAT.get(self.parse, 'valid')}") from None

    def from_text(self, text: str) -> Any:
        """The value of a whole environment variable (MULTIPLE: whitespace-separated)."""
        if self.kind == MULTIPLE:
            return self.collect([self.parse_one(item) for item in text.split()])
        return self.parse_one(text)

    def argv(self, flag: str, value: Any) -> list[str]:
        """``value`` as command-line words (nothing for None)."""
        if value is None:
            return []
        if self.kind == FLAG:
            return [flag] if value else []
        if self.kind == SWITCH:
            return [flag if value else "--no-" + flag[2:]]
        if self.kind == MULTIPLE:
            items = value.items() if isinstance(value, Mapping) else value
            return [word for item in items for word in (flag, self.show(item))]
        return [flag, self.show(value)]


_WHAT = {int: "a whole number", float: "a number"}


def _boolean(text: str) -> bool:
    word = text.strip().lower()
    if word in _TRUE or word in _FALSE:
        return word in _TRUE
    raise InvalidInput(f"{text!r} is not a yes/no value (1/0, true/false, yes/no, on/off)")


@dataclass(frozen=True)
class _Binding:
    setting: Setting
    flag: str | None
    commands: tuple[str, ...] | None


@dataclass(frozen=True)
class Declared:
    """A field of a config class that is a setting: its name there, the setting, and how
    that class's commands spell it."""

    name: str
    setting: Setting
    flag: str | None
    commands: tuple[str, ...] | None

    def taken_by(self, command: str) -> bool:
        return (self.flag is not None and not self.setting.internal
                and (self.commands is None or command in self.commands))


def setting(default: Any, help: str, *, commands: tuple[str, ...] | None = None, **how) -> Any:
    """A dataclass field that is a setting (``Setting``'s arguments; ``commands`` as in
    ``Setting.field``)."""
    return Setting(default, help, **how).field(commands=commands)


def declared(cls: type) -> list[Declared]:
    """The settings among ``cls``'s fields, in field order."""
    out = []
    for f in dataclasses.fields(cls):
        binding = f.metadata.get(_KEY)
        if binding is not None:
            out.append(Declared(f.name, binding.setting, binding.flag, binding.commands))
    return out


def declared_setting(cls: type, name: str) -> Setting:
    for d in declared(cls):
        if d.name == name:
            return d.setting
    raise KeyError(f"{cls.__name__} declares no setting {name!r}")


def same_as(cls: type, name: str, flag: str | None = None,
            commands: tuple[str, ...] | None = None) -> Any:
    """A field holding the setting that ``cls`` declares as ``name``: one declaration
    (default, help, environment), another config class."""
    return declared_setting(cls, name).field(flag, commands)


def shared_values(source: object, target: type) -> dict[str, Any]:
    """``source``'s values of the settings that ``target`` declares too, by ``target``'s
    field names: what a parent hands a child configured by ``target``."""
    mine = {d.setting: d.name for d in declared(type(source))}
    return {d.name: getattr(source, mine[d.setting]) for d in declared(target) if d.setting in mine}


# --------------------------------------------------------------------------- environment
def env_text(s: Setting, environ: Mapping[str, str] | None = None) -> tuple[str, str] | None:
    """(variable, text) of the first of ``s.env_names`` that is set, or None."""
    environ = os.environ if environ is None else environ
    for name in s.env_names:
        text = environ.get(name)
        if text is not None and (text != "" or s.keep_empty):
            return name, text
    return None


def env_value(s: Setting, environ: Mapping[str, str] | None = None) -> Any:
    """The setting's value from the environment, else its default.  A bad value is
    InvalidInput naming the variable (``MMS_S3_PART_BYTES='x' is not a whole number``)."""
    found = env_text(s, environ)
    if found is None:
        return s.default
    name, text = found
    try:
        return s.from_text(text)
    except InvalidInput as exc:
        raise InvalidInput(f"{name}={exc.message}" if exc.message.startswith(repr(text))
                           else f"{name}: {exc.message}") from None


def env_values(cls: type, environ: Mapping[str, str] | None = None,
               names: Sequence[str] | None = None) -> dict[str, Any]:
    """``cls``'s settings (or those of ``names``) that are set in the environment."""
    out = {}
    for d in declared(cls):
        if (names is None or d.name in names) and env_text(d.setting, environ) is not None:
            out[d.name] = env_value(d.setting, environ)
    return out


def env_names(cls: type, secret_only: bool = False) -> set[str]:
    """Every environment name (old aliases too) of ``cls``'s settings (or secret ones)."""
    return {n for d in declared(cls) if d.setting.secret or not secret_only
            for n in d.setting.env_names}


def secret_env_names(cls: type) -> set[str]:
    return env_names(cls, secret_only=True)


def secret_env(obj: object, names: Sequence[str] | None = None) -> dict[str, str]:
    """The secret settings of ``obj`` that have a value, as the environment of a child
    process (their MMS_ names, which win over any old name the child inherits)."""
    return {d.setting.env: d.setting.show(getattr(obj, d.name)) for d in declared(type(obj))
            if d.setting.secret and d.setting.env and (names is None or d.name in names)
            and getattr(obj, d.name) is not None}


# --------------------------------------------------------------------------- argparse, argv
def _argparse_type(s: Setting) -> Callable[[str], Any]:
    def convert(text: str) -> Any:
        try:
            return s.parse_one(text)
        except InvalidInput as exc:
            raise argparse.ArgumentTypeError(exc.message) from None
    convert.__name__ = s.metavar or getattr(s.parse, "__name__", "value")
    return convert


def argument_parser(cls: type, prog: str, description: str,
                    environ: Mapping[str, str] | None = None) -> argparse.ArgumentParser:
    """An argparse parser of ``cls``'s settings that have a flag (secrets excepted: they
    come from the environment); a flag not given takes the environment's value."""
    p = argparse.ArgumentParser(prog=prog, description=description)
    for d in declared(cls):
        s = d.setting
        if d.flag is None or s.secret:
            continue
        flags = [d.flag, *s.old_flags]
        from_env = env_text(s, environ) is not None
        default = env_value(s, environ) if from_env else s.default
        common = {"dest": d.name, "help": s.help_with_env}
        if s.kind == FLAG:
            p.add_argument(*flags, action="store_true", default=default, **common)
        elif s.kind == SWITCH:
            p.add_argument(*flags, action=argparse.BooleanOptionalAction, default=default, **common)
        elif s.kind == MULTIPLE:  # appended to None: the environment's items only when none given
            p.add_argument(*flags, action="append", type=_argparse_type(s), default=None,
                           metavar=s.metavar, **common)
        else:
            p.add_argument(*flags, type=_argparse_type(s), default=default, metavar=s.metavar,
                           required=s.required and not from_env, **common)
    return p


def parse_argv(cls: type, argv: Sequence[str] | None, prog: str, description: str,
               environ: Mapping[str, str] | None = None) -> Any:
    """``cls`` from a command line built by ``to_argv`` (or typed by a person), the
    environment filling in secrets and flags not given."""
    ns = argument_parser(cls, prog, description, environ).parse_args(argv)
    values = {}
    for d in declared(cls):
        s = d.setting
        if d.flag is None or s.secret:
            if env_text(s, environ) is not None:
                values[d.name] = env_value(s, environ)
            continue
        value = getattr(ns, d.name)
        if s.kind == MULTIPLE:
            value = s.collect(value) if value is not None else env_value(s, environ)
        values[d.name] = value
    return cls(**values)


def to_argv(obj: object) -> list[str]:
    """The command line that ``parse_argv`` reads back into an equal ``obj``: every setting
    with a flag and a value, defaults included (a child may see another environment);
    secrets never (they go in the child's environment, ``secret_env``)."""
    words: list[str] = []
    for d in declared(type(obj)):
        if d.flag is not None and not d.setting.secret:
            words += d.setting.argv(d.flag, getattr(obj, d.name))
    return words


# --------------------------------------------------------------------------- small parsers
def comma_list(text: str) -> list[str]:
    """``gpu0, gpu1/mig2`` -> ["gpu0", "gpu1/mig2"]."""
    return [item.strip() for item in text.split(",") if item.strip()]


def at_least_zero(text: str) -> int:
    value = int(text)
    if value < 0:
        raise InvalidInput(f"{value} is not >= 0")
    return value


def file_path(text: str) -> Path:
    """A path that must not be a directory (it may not exist yet)."""
    path = Path(text)
    if path.is_dir():
        raise InvalidInput(f"{text!r} is a directory, not a file")
    return path


# --------------------------------------------------------------------------- shared settings
# Read by more than one of the product's processes (the control plane, its router workers,
# mmctl): declared here, the layer every one of them may import.
ADMIN_TOKEN = Setting(
    None, "Bearer token of the admin API (prefer the environment: argv is visible to other "
    "users). mmctl up / control-plane: the token the admin API requires; default: reuse or "
    "generate <state-dir>/admin.token (mode 0600), where mmctl finds it. mmctl sends it; it "
    "wins over its --token-file.",
    env="MMS_ADMIN_TOKEN", aliases=("MMCTL_TOKEN",), secret=True)  # mmctl up: --admin-token
DATAPLANE_TOKEN = Setting(
    None, "Token of the data-plane endpoints (/v1/dataplane/*), the only ones it opens: router "
    "workers send it instead of the admin token. mmctl up / control-plane: default: reuse or "
    "generate <state-dir>/dataplane.token (mode 0600). Environment only.",
    env="MMS_DATAPLANE_TOKEN", secret=True)
MIN_TOKEN_CHARS = 16  # an admin token given by hand (a generated one has 43)
LOG_LEVEL = Setting("INFO", "DEBUG, INFO, WARNING or ERROR.", flag="--log-level")
TRACE_EXPORTER = Setting(
    None, "Request tracing with OpenTelemetry, off when unset: otlp (OTLP over HTTP to "
    "OTEL_EXPORTER_OTLP_ENDPOINT; otlp=URL names it), console (JSON lines on stderr) or "
    "file=PATH (JSON lines appended to PATH). The router passes the W3C traceparent on to "
    "Triton.", flag="--trace-exporter", env="MMS_TRACE_EXPORTER")
