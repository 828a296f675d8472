"""mmctl's help as a user reads it: every command says what it does, and what it says about
the eviction policy is what the product does."""

from __future__ import annotations

import click
from click.testing import CliRunner

from control_plane.eviction import DEFAULT_POLICY, POLICIES
from mmctl.main import cli


def _help(*args: str) -> str:
    out = CliRunner().invoke(cli, [*args, "--help"], prog_name="mmctl")
    assert out.exit_code == 0, out.output
    return out.output


def test_load_help_names_the_default_policy():
    assert DEFAULT_POLICY == "lru"
    text = " ".join(_help("load").split())
    assert "least recently used" in text and "--policy" in text


def test_up_offers_every_policy_and_shows_the_default():
    text = " ".join(_help("up").split())
    assert f"[default: {DEFAULT_POLICY}]" in text
    for name in POLICIES:
        assert name in text


def _commands(group: click.Group, prefix: str = "mmctl"):
    ctx = click.Context(group)
    for name in group.list_commands(ctx):
        cmd = group.get_command(ctx, name)
        yield f"{prefix} {name}", cmd
        if isinstance(cmd, click.Group):
            yield from _commands(cmd, f"{prefix} {name}")


def test_every_command_and_group_has_a_help_line():
    missing = [path for path, cmd in _commands(cli) if not cmd.get_short_help_str(limit=200).strip()]
    assert not missing, f"commands without a help line: {missing}"
    listing = _help()
    for path, cmd in _commands(cli):
        if path.count(" ") == 1:  # top-level: `mmctl --help` lists it with its line
            assert path.split()[1] in listing
