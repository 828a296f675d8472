"""podman as the container suites call it: with the project's containers.conf (runc on
cgroupfs, no default ulimits: what this kind of machine needs)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CONTAINERS_CONF = ROOT / "docker" / "podman" / "containers.conf"


def engine_env() -> dict[str, str]:
    return dict(os.environ, CONTAINERS_CONF=str(CONTAINERS_CONF))


def podman(*args: str, check: bool = True, timeout: float = 300,
           stdin: str | None = None) -> subprocess.CompletedProcess:
    """``podman ARGS``; with ``check``, a failure is an AssertionError carrying its output."""
    result = subprocess.run(["podman", *args], capture_output=True, text=True, env=engine_env(),
                            timeout=timeout, input=stdin, check=False)
    if check and result.returncode != 0:
        raise AssertionError(f"podman {' '.join(args[:3])} failed ({result.returncode}):\n"
                             f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    return result
