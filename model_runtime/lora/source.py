"""The adapter cache's cold tier: the adapter directory the control plane fills."""

from __future__ import annotations

from pathlib import Path

from .names import validate_adapter_name


class AdapterSource:
    """The cold tier: a directory with one PEFT adapter directory per adapter name.

    Names starting with '.' are staging leftovers (``.acme.tmp``) and are never served."""

    def __init__(self, root: Path | str):
        self.root = Path(root)

    def path(self, name: str) -> Path:
        return self.root / validate_adapter_name(name)

    def exists(self, name: str) -> bool:
        return self.path(name).is_dir()

    def names(self) -> list[str]:
        try:
            entries = sorted(p for p in self.root.iterdir() if p.is_dir())
        except FileNotFoundError:
            return []
        return [p.name for p in entries if not p.name.startswith(".")]
