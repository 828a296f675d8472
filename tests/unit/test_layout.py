"""The layout's import contracts ([tool.importlinter] in pyproject.toml) hold: code run
inside Triton imports neither the control plane nor the router, the router imports only the
control plane's domain, and the domain imports no other part of the product."""

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
