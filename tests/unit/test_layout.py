"""The layout's import contracts ([tool.importlinter] in pyproject.toml) hold: code run
inside Triton imports neither the control plane nor the router, the router imports nothing of
the control plane (what both share is `domain`), and the domain imports no other part of the
product."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_import_contracts_are_kept():
    # In a process of its own: import-linter configures logging for its process.
    result = subprocess.run([str(Path(sys.executable).parent / "lint-imports"), "--no-cache"],
                            cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "broken" in result.stdout and "0 broken" in result.stdout


def test_mmctl_commands_are_added_one_way():
    """Each module of mmctl defines its commands with click and lists them in
    COMMANDS; mmctl adds exactly those (no command is attached to the group elsewhere)."""
    import importlib

    import click

    from mmctl import adapters, families, registry, routing, serve, settings

    mmctl = importlib.import_module("mmctl.main").cli
    listed = [c for m in (routing, serve, registry, adapters, families, settings)
              for c in m.COMMANDS]
    assert all(isinstance(c, click.Command) for c in listed)
    assert set(mmctl.commands.values()) >= set(listed)
    own = set(mmctl.commands.values()) - set(listed)
    assert {c.name for c in own} == {"status", "load", "pin", "unpin", "unload", "scale", "health", "fleet",
                                     "endpoints", "demo-fleet"}
    for path in (ROOT / "mmctl").glob("*.py"):
        text = path.read_text()
        assert "@cli.command" not in text and "@cli.group" not in text, path
        assert "add_command(" not in text or path.name == "main.py", path


def test_the_control_plane_router_and_mmctl_import_without_torch():
    """Their install (and image) leaves torch out: only the demo's writer needs it, and
    without it says what to install instead of an ImportError.  safetensors is theirs (an
    added adapter is read and checked without torch)."""
    code = """
import importlib, pkgutil, sys
for name in ("torch", "safetensors.torch"):
    sys.modules[name] = None  # an import of it fails, as where it is not installed
needs = []
for package in ("control_plane", "router", "domain", "mmctl"):
    for info in pkgutil.walk_packages(importlib.import_module(package).__path__, package + "."):
        if info.name.endswith("__main__"):
            continue
        try:
            importlib.import_module(info.name)
        except ImportError:
            needs.append(info.name)
print(",".join(sorted(needs)))
"""
    result = subprocess.run([sys.executable, "-c", code],
                            cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["control_plane.demo.fleet,control_plane.demo.lora"]


def test_writing_the_demo_without_torch_says_what_to_install(tmp_path, monkeypatch):
    import importlib.util

    from click.testing import CliRunner

    from mmctl.main import cli

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "torch" else real(name, *a))
    result = CliRunner().invoke(cli, ["demo-fleet", "--out", str(tmp_path / "m"), "--layout", "family"])
    assert result.exit_code == 1
    assert "needs torch" in result.output and "multimodel-serving[runtime]" in result.output
    assert not (tmp_path / "m").exists()
