"""Which families exist in Triton's repository, which family each variant belongs to, and
how many slots a family gets on a server.  Reads files only on ``refresh``; lookups are
dictionary reads (the router's snapshot and every load use them)."""

from __future__ import annotations

import json
import logging
import os
import secrets
import stat
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from model_runtime.family.layout import Layout, LayoutError
from model_runtime.family.protocol import CONTROL_KEY_FILE, LAYOUT_FILE

log = logging.getLogger(__name__)

VARIANT_FILE = "variant.json"
WEIGHTS_FILE = "weights.safetensors"


@dataclass(frozen=True)
class Family:
    name: str  # the Triton model that holds the slots
    layout: Layout
    folder: Path

    @property
    def slot_bytes(self) -> int:
        return self.layout.data_bytes


# The most slots a family's model is loaded with: its slot list's length (a slot holds no
# memory until a variant fills it, so the bound is on bookkeeping only).
MAX_FAMILY_SLOTS = 4096


def family_slots(family: Family, max_loaded: int | None, budget_bytes: int | None,
                 variants: int) -> int:
    """Slots a family's model is loaded with on one server: the most variants the server's
    budget can hold (``--max-loaded``, and the byte budget in slots of the family's size),
    so the family is never the reason a variant cannot come in.  Slots are elastic: one
    takes memory (and a place of the server's budget, as a model does) only while a variant
    fills it, so the empty ones cost nothing.  With neither limit, one per variant known now
    and half as many again (a later registration) before a load with more slots is
    needed.  At least one."""
    limits = [n for n in (max_loaded,
                          budget_bytes // max(family.slot_bytes, 1) if budget_bytes else None)
              if n is not None]
    if not limits:
        return max(1, min(MAX_FAMILY_SLOTS, variants + variants // 2))
    return max(1, min(MAX_FAMILY_SLOTS, min(limits)))


def control_key(repository: Path) -> str:
    """The key family models take control commands with: read from Triton's repository, or
    written there (owner-only) the first time.  Every Triton serving the repository and the
    control plane share it; clients that only reach Triton's inference port do not."""
    path = repository / CONTROL_KEY_FILE
    try:
        mode = path.lstat().st_mode
        key = path.read_text().strip() if stat.S_ISREG(mode) else ""
        if key and not mode & 0o077:
            return key
        if key:  # family models refuse a key others can read: a new one replaces it
            log.warning("%s was readable by other users (mode %o); writing a new family "
                        "control key (families loaded before take it at their next load)",
                        path, stat.S_IMODE(mode))
    except FileNotFoundError:
        pass
    repository.mkdir(parents=True, exist_ok=True)
    key = secrets.token_hex(16)
    tmp = repository / f"{CONTROL_KEY_FILE}.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(key)
    os.replace(tmp, path)
    return path.read_text().strip()


class FamilyCatalog:
    """Families found in Triton's repository and the variant -> family map.

    ``registered``: (concrete name, family) pairs from the registry (variants whose folder
    may only be in the cold store); variant folders in the repository add theirs."""

    def __init__(self, repository: Path,
                 registered: Callable[[], Iterable[tuple[str, str]]] | None = None):
        self.repository = Path(repository)
        self._registered = registered or (lambda: ())
        self.families: dict[str, Family] = {}
        self.family_of_variant: dict[str, str] = {}
        self.generation = 0
        self.control_key = control_key(self.repository)
        self.refresh()

    def refresh(self, *_args) -> None:
        """Re-read the repository and the registry (a registry listener calls it)."""
        families, variants = {}, {}
        for child in sorted(self.repository.iterdir()) if self.repository.is_dir() else []:
            if child.name.startswith(".") or not child.is_dir():
                continue
            layout_file = child / LAYOUT_FILE
            if layout_file.is_file() and (child / "config.pbtxt").is_file():
                try:
                    layout = Layout.from_json(json.loads(layout_file.read_text()))
                except (OSError, ValueError, LayoutError) as exc:
                    log.error("family folder %s has an unreadable %s: %s", child, LAYOUT_FILE, exc)
                    continue
                families[child.name] = Family(child.name, layout, child)
                continue
            marker = child / VARIANT_FILE
            if marker.is_file():
                try:
                    variants[child.name] = json.loads(marker.read_text())["family"]
                except (OSError, ValueError, KeyError, TypeError) as exc:
                    log.error("variant folder %s has an unreadable %s: %s", child, VARIANT_FILE, exc)
        for name, family in self._registered():
            variants[name] = family
        self.families, self.family_of_variant = families, variants
        self.generation += 1  # the data-plane hub publishes carriers again when it changes

    def family(self, name: str) -> Family | None:
        return self.families.get(name)

    def family_of(self, model: str) -> Family | None:
        """The family whose slots ``model`` (a concrete name) goes into, or None."""
        name = self.family_of_variant.get(model)
        return None if name is None else self.families.get(name)

    def carrier_of(self, model: str) -> str | None:
        """The Triton model that serves ``model`` when it is a variant, else None (O(1): the
        router asks on every request)."""
        name = self.family_of_variant.get(model)
        return name if name is not None and name in self.families else None

    def carriers(self) -> dict[str, str]:
        """Variant -> the Triton model that serves it (the router's re-addressing)."""
        return {v: f for v, f in self.family_of_variant.items() if f in self.families}

    def variants(self, family: str) -> list[str]:
        return sorted(v for v, f in self.family_of_variant.items() if f == family)
