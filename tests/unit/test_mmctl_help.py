"""mmctl's help as a user reads it: every command says what it does, and what it says about
the eviction policy is what the product does."""

from __future__ import annotations

import click
from click.testing import CliRunner

from control_plane.cli import cli
from control_plane.eviction import DEFAULT_POLICY, POLICIES


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
