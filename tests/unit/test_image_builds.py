"""docker/images.py's checks before a build (no engine is run)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def images():
    spec = importlib.util.spec_from_file_location("images", ROOT / "docker" / "images.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def tool(folder: Path, name: str) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_text("#!/bin/sh\n")


@pytest.mark.parametrize("present, missing", [
    (("netavark", "aardvark-dns"), ["iptables"]),  # a bare Debian with podman and netavark
    (("iptables",), ["netavark", "aardvark-dns"]),
    ((), ["netavark", "aardvark-dns", "iptables"]),
])
def test_podman_without_its_network_backend_is_named_before_a_build(images, tmp_path, monkeypatch,
                                                                     present, missing):
    """Without iptables every build step failed with a bare 'netavark: No such file or
    directory'; the build now stops first and says what to install."""
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    helpers, sbin = tmp_path / "lib" / "podman", tmp_path / "sbin"
    for name in present:
        tool(sbin if name == "iptables" else helpers, name)
    with pytest.raises(images.BuildError) as info:
        images.check_podman_network((helpers,), (sbin,))
    assert f"needs {', '.join(missing)}, not installed" in str(info.value)
    assert "apt-get install netavark aardvark-dns iptables" in str(info.value)


def test_podman_with_its_network_backend_builds(images, tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    helpers, sbin = tmp_path / "libexec" / "podman", tmp_path / "sbin"
    for name in ("netavark", "aardvark-dns"):
        tool(helpers, name)
    tool(sbin, "iptables")
    images.check_podman_network((tmp_path / "nothing", helpers), (sbin,))  # raises nothing
