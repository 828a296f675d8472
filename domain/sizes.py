"""Sizes as people write them: 500000000, 500MB, 2GiB, 1.5 GB."""

from __future__ import annotations

from domain.errors import InvalidInput

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10,
          "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(value: str | int) -> int:
    """Bytes; InvalidInput (with examples) for anything else."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    text = str(value).strip().upper().replace(" ", "")
    number = text.rstrip("KMGTIB")
    try:
        size = int(float(number) * _UNITS[text[len(number):]])
    except (ValueError, KeyError):
        raise InvalidInput(f"{value!r} is not a size (examples: 500000000, 500MB, 2GiB)") from None
    if size < 0:
        raise InvalidInput(f"{value!r} is negative; a size is >= 0 bytes")
    return size


def size_text(size: int) -> str:
    """``size`` as people write it, exactly: 16777216 -> "16MiB", 1000 -> "1000"
    (``parse_size`` reads it back to the same number)."""
    for unit in ("TiB", "GiB", "MiB", "KiB"):
        scale = _UNITS[unit.upper()]
        if size and size % scale == 0:
            return f"{size // scale}{unit}"
    return str(size)
