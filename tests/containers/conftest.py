"""What the container suites share: the images `make images` builds, built once per run
(then from the engine's cache: unchanged sources give the same wheels, the same layers)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests import system_packages

ROOT = Path(__file__).resolve().parents[2]
BUILD_TIMEOUT_S = 1500


@pytest.fixture(scope="session")
def images():
    try:
        system_packages.ensure("podman", "runc", "catatonit",
                               "netavark", "aardvark-dns", "debootstrap")
    except system_packages.PackagesMissing as exc:
        pytest.fail(str(exc))
    built = subprocess.run([sys.executable, str(ROOT / "docker" / "images.py"), "--engine", "podman"],
                           capture_output=True, text=True, timeout=BUILD_TIMEOUT_S, check=False)
    assert built.returncode == 0, built.stdout[-4000:] + built.stderr[-4000:]
    sizes = [line for line in built.stdout.splitlines() if line.startswith("localhost/mmserve")]
    print("\n".join(sizes))
    return sizes
