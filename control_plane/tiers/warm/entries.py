"""What the warm tier records: one ``WarmEntry`` per model folder, one ``Download`` per
download in flight (``mmctl`` shows both)."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class WarmEntry:
    name: str
    size_bytes: int
    managed: bool  # True: came from the cold store and can be fetched again
    sha256: str | None
    last_used: float

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class Download:
    name: str
    uri: str
    total_bytes: int
    done_bytes: int = 0
    started_at: float = 0.0

    def to_dict(self) -> dict:
        d = asdict(self)
        d["fraction"] = (self.done_bytes / self.total_bytes) if self.total_bytes else None
        return d
