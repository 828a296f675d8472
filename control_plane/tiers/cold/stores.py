"""The store interface, the local-directory store (``file://``) and ``ColdStores``, the
configured stores by URI scheme."""

from __future__ import annotations

import os
import shutil
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import unquote, urlparse

from control_plane.tiers.cold.digests import CHUNK_BYTES, FileEntry, _artifact_files
from domain.errors import InvalidInput


@dataclass(frozen=True)
class ArtifactInfo:
    uri: str
    sha256: str
    size_bytes: int
    files: tuple[FileEntry, ...] = ()
    has_manifest: bool = True


class ColdStore(ABC):
    """Where artifacts live.  One store per URI scheme; every method blocks (use a thread)."""

    scheme: str

    def accepts(self, uri: str) -> bool:
        return uri.startswith(self.scheme + "://")

    @abstractmethod
    def default_uri(self, model: str, version: int) -> str:
        """Where ``publish`` puts a version when no URI is given."""

    @abstractmethod
    def list_files(self, uri: str) -> list[FileEntry]:
        """Every object under ``uri`` (sha256 unknown); empty if there is none."""

    @abstractmethod
    def read_bytes(self, uri: str, relpath: str, max_bytes: int | None = None) -> bytes | None:
        """A small object (the manifest), or None if it does not exist; ``max_bytes``: its
        first bytes only (a weights file's header)."""

    @abstractmethod
    def stream(self, uri: str, relpath: str) -> Iterator[bytes]:
        """The object's bytes in chunks of about CHUNK_BYTES."""

    def copy_into(self, uri: str, relpath: str, sink: Callable[[bytes], None]) -> None:
        """Pass the object's bytes to ``sink`` in order, as they arrive (a store that can
        fetch parts in parallel does; the default streams one GET).  An exception from
        ``sink`` stops the transfer and is raised here."""
        for chunk in self.stream(uri, relpath):
            sink(chunk)

    @abstractmethod
    def put_file(self, uri: str, relpath: str, source: Path) -> None: ...

    @abstractmethod
    def put_bytes(self, uri: str, relpath: str, data: bytes) -> None: ...

    def describe(self) -> str:
        return self.scheme


def _with_slash(uri: str) -> str:
    return uri if uri.endswith("/") else uri + "/"


class LocalDirStore(ColdStore):
    """Artifacts in a local directory: the embedded default (``file://`` URIs)."""

    scheme = "file"

    def __init__(self, root: Path):
        self.root = root.resolve()

    def default_uri(self, model: str, version: int) -> str:
        return (self.root / model / str(version)).as_uri() + "/"

    def path_of(self, uri: str) -> Path:
        parsed = urlparse(uri)
        if parsed.scheme != "file" or parsed.netloc not in ("", "localhost"):
            raise InvalidInput(f"{uri!r} is not a local file:// URI (file:///absolute/path/)")
        return Path(unquote(parsed.path))

    def list_files(self, uri: str) -> list[FileEntry]:
        root = self.path_of(uri)
        if not root.is_dir():
            return []
        return [FileEntry(rel, None, full.stat().st_size) for rel, full in _artifact_files(root)]

    def read_bytes(self, uri: str, relpath: str, max_bytes: int | None = None) -> bytes | None:
        path = self.path_of(uri) / relpath
        try:
            with open(path, "rb") as f:
                return f.read() if max_bytes is None else f.read(max_bytes)
        except FileNotFoundError:
            return None

    def stream(self, uri: str, relpath: str) -> Iterator[bytes]:
        with open(self.path_of(uri) / relpath, "rb") as f:
            yield from iter(lambda: f.read(CHUNK_BYTES), b"")

    def put_file(self, uri: str, relpath: str, source: Path) -> None:
        dest = self.path_of(uri) / relpath
        dest.parent.mkdir(parents=True, exist_ok=True)
        _replace_via_temporary(dest, lambda tmp: shutil.copyfile(source, tmp))

    def put_bytes(self, uri: str, relpath: str, data: bytes) -> None:
        dest = self.path_of(uri) / relpath
        dest.parent.mkdir(parents=True, exist_ok=True)
        _replace_via_temporary(dest, lambda tmp: tmp.write_bytes(data))

    def describe(self) -> str:
        return f"local directory {self.root}"


def _replace_via_temporary(dest: Path, write: Callable[[Path], object]) -> None:
    """``write`` a temporary file beside ``dest``, then rename it over ``dest``: a reader
    never sees half a file, and a write that fails (a full disk) leaves no temporary file."""
    tmp = dest.with_name(f".{dest.name}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        write(tmp)
        os.replace(tmp, dest)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


@dataclass
class ColdStores:
    """The configured stores by URI scheme; ``default`` is where ``publish`` writes."""

    stores: list[ColdStore] = field(default_factory=list)
    default: ColdStore | None = None

    def __post_init__(self):
        if self.default is None and self.stores:
            self.default = self.stores[0]
        if self.default is not None and self.default not in self.stores:
            self.stores.insert(0, self.default)

    def for_uri(self, uri: str) -> ColdStore:
        for store in self.stores:
            if store.accepts(uri):
                return store
        schemes = ", ".join(f"{s.scheme}://" for s in self.stores) or "none"
        raise InvalidInput(f"no cold store handles {uri!r}; configured: {schemes}")

    def default_uri(self, model: str, version: int) -> str:
        if self.default is None:
            raise InvalidInput("no cold store is configured; give --artifact URI")
        return self.default.default_uri(model, version)

