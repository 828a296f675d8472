"""mmctl's options, derived from the settings' one declaration (``domain.settings``):
``options(cls, command)`` puts every setting of ``cls`` that ``command`` takes on it as a click
option (flag, type, default, help, environment variables); ``values(cls, command, opts)``
maps what click parsed back onto ``cls``'s fields; ``--config FILE`` (TOML) gives the same
settings from a file.  ``mmctl settings --markdown`` renders the table for the docs.

Precedence, highest first: the command line, the environment (MMS_* then the old names),
the --config file, the declared default.
"""

from __future__ import annotations

import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click
from click.core import ParameterSource

from control_plane.client import ClientSettings
from control_plane.runtime.config import ServiceConfig
from control_plane.tiers.cold.s3 import S3Config
from domain.errors import InvalidInput
from domain.settings import (
    FLAG,
    MULTIPLE,
    SWITCH,
    Declared,
    Setting,
    declared,
    env_text,
    env_values,
    file_path,
)
from domain.worker_settings import WorkerConfig

# Every config class with settings, and the mmctl commands that take them as options
# ("mmctl": the group's own options, before the command).  S3Config's settings have no
# flag: the control plane of `up` / `control-plane` reads them from its environment.
TABLES: dict[type, tuple[str, ...]] = {
    ServiceConfig: ("up", "control-plane"),
    WorkerConfig: ("router",),
    ClientSettings: ("mmctl",),
    S3Config: ("up", "control-plane"),
}
CONFIG_FILE_OPTION = "config_file"  # --config: not a setting, the file of settings

_TYPE_NAMES = {int: "integer", float: "float", Path: "path", file_path: "file", str: "text"}


class SettingType(click.ParamType):
    """A setting's ``parse`` as a click type: text is parsed, a value already parsed (a
    default, a TOML number) is kept."""

    def __init__(self, s: Setting):
        self.setting = s
        self.name = _TYPE_NAMES.get(s.parse, "text")

    def convert(self, value: Any, param, ctx) -> Any:
        if not isinstance(value, str):
            return value
        try:
            return self.setting.parse_one(value)
        except InvalidInput as exc:
            found = (env_text(self.setting) if ctx is not None and param is not None
                     and ctx.get_parameter_source(param.name) == ParameterSource.ENVIRONMENT
                     else None)
            self.fail(f"{exc.message} (from {found[0]})" if found else exc.message, param, ctx)


def click_option(d: Declared) -> Callable:
    """``d`` as a click option.  Its default goes in as text, so that --help shows it as a
    person writes it (16MiB) and the type parses it like any value given."""
    s = d.setting
    kw: dict[str, Any] = {"help": s.help_with_env, "envvar": list(s.env_names) or None}
    if s.kind == SWITCH:
        return click.option(f"{d.flag}/--no-{d.flag[2:]}", d.name, default=s.default,
                            show_default=s.default is not None, **kw)
    if s.kind == FLAG:
        return click.option(d.flag, d.name, is_flag=True, default=s.default, **kw)
    kw["type"] = click.Choice(s.choices) if s.choices else SettingType(s)
    if s.metavar:
        kw["metavar"] = s.metavar
    if s.kind == MULTIPLE:
        return click.option(d.flag, d.name, multiple=True, default=(), **kw)
    default = None if s.default is None else s.show(s.default)
    return click.option(d.flag, d.name, required=s.required, default=default,
                        show_default=default is not None, **kw)


def taken(cls: type, command: str) -> list[Declared]:
    return [d for d in declared(cls) if d.taken_by(command)]


def options(cls: type, command: str, config_file: bool = True) -> Callable:
    """A decorator putting ``cls``'s settings of ``command`` on a click command, in the
    order of the fields, and --config FILE before them."""
    decorators = [click_option(d) for d in taken(cls, command)]
    if config_file:
        decorators.insert(0, _config_file_option(cls, command))

    def apply(f):
        for decorate in reversed(decorators):
            f = decorate(f)
        return f
    return apply


def values(cls: type, command: str, opts: dict) -> dict[str, Any]:
    """``cls``'s field values from the options click parsed (repeated options collected
    into the field's list or dict), and its settings of the environment only (no option:
    the data-plane token) from the environment."""
    out = {}
    for d in taken(cls, command):
        value = opts[d.name]
        out[d.name] = d.setting.collect(list(value)) if d.setting.kind == MULTIPLE else value
    out.update(env_values(cls, names=[d.name for d in declared(cls) if d.flag is None]))
    return out


def _config_file_option(cls: type, command: str) -> Callable:
    by_key = {d.flag[2:]: d for d in taken(cls, command)}

    def load(ctx: click.Context, param, path: Path | None):
        if path is None:
            return None
        try:
            data = tomllib.loads(path.read_text())
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise click.BadParameter(f"cannot read {path}: {exc}", ctx, param) from None
        unknown = sorted(set(data) - set(by_key))
        if unknown:
            raise click.BadParameter(
                f"{path}: {', '.join(unknown)} {'is not a setting' if len(unknown) == 1 else 'are not settings'} "
                f"of mmctl {command} (keys are its options' names without dashes, e.g. "
                f"{next(iter(by_key), 'max-loaded')})", ctx, param)
        defaults = {}
        for key, value in data.items():
            d = by_key[key]
            if d.setting.kind == MULTIPLE and not isinstance(value, list):
                value = [value]
            defaults[d.name] = value
        ctx.default_map = {**(ctx.default_map or {}), **defaults}
        return path

    return click.option(
        "--config", CONFIG_FILE_OPTION, type=click.Path(exists=True, dir_okay=False, path_type=Path),
        is_eager=True, expose_value=False, callback=load,
        help="TOML file of these settings, keys named as the options without dashes (e.g. "
             "max-loaded = 12, memory-budget = \"2GiB\"); options and MMS_* variables win over it.")


# --------------------------------------------------------------------------- the table, for docs
def rows() -> list[dict[str, str]]:
    """One row per setting (a setting two config classes share is one row): its options by
    command, environment variables, default and help."""
    seen: dict[Setting, dict] = {}
    for cls, commands in TABLES.items():
        for d in declared(cls):
            s = d.setting
            if s.internal:
                continue
            row = seen.setdefault(s, {"setting": s, "flags": {}, "readers": []})
            for command in commands:
                if d.taken_by(command):
                    row["flags"].setdefault(d.flag, []).append(command)
                elif d.flag is None and command not in row["readers"]:
                    row["readers"].append(command)
    out = []
    for row in seen.values():
        s = row["setting"]
        parts = [f"`{flag}` ({', '.join(cmds)})" for flag, cmds in row["flags"].items()]
        if row["readers"]:
            parts.append("environment only (" + ", ".join(row["readers"]) + ")")
        where = "; ".join(parts)
        env = f"`{s.env}`" if s.env else ""
        if s.aliases:
            env += " (also " + ", ".join(f"`{a}`" for a in s.aliases) + ")"
        out.append({"options": where, "env": env, "default": _default_text(s), "help": s.help})
    return out


def _default_text(s: Setting) -> str:
    if s.kind == FLAG or (s.kind == SWITCH and s.default is not None):
        return "on" if s.default else "off"
    if s.default is None or s.default == () or s.secret:
        return "-"
    return f"`{s.show(s.default)}`" if s.show(s.default) != "" else '`""`'


def markdown() -> str:
    lines = ["| Options (commands) | Environment variable | Default | Meaning |",
             "|---|---|---|---|"]
    for row in rows():
        cells = [row[k].replace("|", "\\|") for k in ("options", "env", "default", "help")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


@click.command("settings")
@click.option("--markdown", "as_markdown", is_flag=True, help="The table as markdown, for the docs.")
def settings_command(as_markdown: bool):
    """Every setting: its options, environment variable, default and meaning."""
    if as_markdown:
        click.echo(markdown())
        return
    for row in rows():
        plain = {k: v.replace("`", "") for k, v in row.items()}
        click.echo(f"{plain['env'] or '-'}\n  {plain['options']}; default: {plain['default']}\n"
                   f"  {plain['help']}\n")


# The commands this module adds to mmctl (mmctl.main).
COMMANDS = [settings_command]
