"""The layout's import contracts ([tool.importlinter] in pyproject.toml) hold: code run
inside Triton imports neither the control plane nor the router, the router imports only the
control plane's domain, and the domain imports no other part of the product."""

from __future__ import annotations

from pathlib import Path

from importlinter.cli import lint_imports

ROOT = Path(__file__).resolve().parents[2]


def test_the_import_contracts_are_kept(monkeypatch):
    monkeypatch.chdir(ROOT)
    monkeypatch.syspath_prepend(str(ROOT))
    kept = lint_imports(config_filename=str(ROOT / "pyproject.toml"), no_cache=True, no_logo=True)
    assert kept == 0, "an import breaks the layout's contracts: `lint-imports` says which"
