"""The real helm that `make setup` installs (deploy/install_helm.py), for the suites that
render the chart."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest


def helm_binary() -> str:
    beside_python = Path(sys.executable).parent / "helm"
    found = str(beside_python) if beside_python.is_file() else shutil.which("helm")
    if found is None:
        pytest.fail(f"helm is not installed: `make setup` puts it at {beside_python} "
                    "(python deploy/install_helm.py .venv/bin/helm does only that)")
    return found
