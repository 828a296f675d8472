"""Artifact manifests and the folder sha256 the registry records.

An *artifact* is one model folder (``config.pbtxt``, ``<version>/model.py``, weights)
stored under a URI prefix.

Folder sha256 (what the registry records)
    The sha256 of the folder's *manifest text*: one line ``<file sha256 hex>  <path>\\n`` per
    regular file, paths relative to the folder with ``/`` separators, sorted by their UTF-8
    bytes.  ``__pycache__`` folders and the manifest object itself are left out.  This is
    what ``sha256sum`` prints, so it can be checked by hand::

        cd cust017 && find . -type f ! -path '*/__pycache__/*' ! -name mms-manifest.json \\
          | sed 's#^\\./##' | LC_ALL=C sort | xargs sha256sum | sha256sum

    ``publish`` uploads the files and then ``mms-manifest.json`` (per-file sha256 and size),
    so a download knows which files belong to the artifact and can check each one as it
    streams.  An artifact without a manifest (uploaded by another tool) is still accepted:
    every object under the prefix is downloaded and the folder sha256 is computed from them.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from domain.errors import InvalidInput, ModelLoadFailed, ModelNotFound

MANIFEST_NAME = "mms-manifest.json"
MANIFEST_FORMAT = "mms-artifact/1"
CHUNK_BYTES = 1 << 20
SKIPPED_DIRS = frozenset({"__pycache__"})

# progress(done_bytes, total_bytes); called from the downloading thread.
Progress = Callable[[int, int], None]


# --------------------------------------------------------------------------- digests
@dataclass(frozen=True)
class FileEntry:
    path: str  # relative, "/"-separated
    sha256: str | None
    size_bytes: int


def normalize_sha256(value: str) -> str:
    """Accept ``<64 hex>`` or ``sha256:<64 hex>``; return the lower-case hex."""
    text = value.strip().lower()
    text = text.removeprefix("sha256:")
    if len(text) != 64 or any(c not in "0123456789abcdef" for c in text):
        raise InvalidInput(
            f"sha256 {value!r} is not 64 hex digits (optionally prefixed 'sha256:'); "
            "compute it with control_plane.tiers.cold.folder_sha256 or omit it to take the "
            "artifact's manifest"
        )
    return text


def manifest_text(files: Mapping[str, str]) -> str:
    """``sha256sum``-style text of ``{relative path: sha256 hex}``, sorted by path bytes."""
    return "".join(f"{files[p]}  {p}\n" for p in sorted(files, key=lambda p: p.encode()))


def manifest_digest(files: Mapping[str, str]) -> str:
    return hashlib.sha256(manifest_text(files).encode()).hexdigest()


def _artifact_files(root: Path) -> Iterator[tuple[str, Path]]:
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIPPED_DIRS)
        for fn in sorted(filenames):
            full = Path(dirpath) / fn
            rel = full.relative_to(root).as_posix()
            if rel == MANIFEST_NAME or full.is_symlink() or not full.is_file():
                continue
            yield rel, full


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(CHUNK_BYTES), b""):
            h.update(chunk)
    return h.hexdigest()


def folder_manifest(root: Path) -> list[FileEntry]:
    """Per-file sha256 and size of a model folder (symlinks are not followed)."""
    if not root.is_dir():
        raise ModelNotFound(f"model folder {root} does not exist")
    entries = [FileEntry(rel, file_sha256(full), full.stat().st_size) for rel, full in _artifact_files(root)]
    if not entries:
        raise InvalidInput(f"model folder {root} has no files; expected config.pbtxt and <version>/")
    return entries


def folder_sha256(root: Path) -> str:
    """The folder sha256 defined in the module docstring."""
    return manifest_digest({e.path: e.sha256 for e in folder_manifest(root)})


def _manifest_doc(entries: list[FileEntry]) -> dict:
    return {
        "format": MANIFEST_FORMAT,
        "sha256": manifest_digest({e.path: e.sha256 for e in entries}),
        "size_bytes": sum(e.size_bytes for e in entries),
        "files": [{"path": e.path, "sha256": e.sha256, "size_bytes": e.size_bytes}
                  for e in sorted(entries, key=lambda e: e.path.encode())],
    }


def _parse_manifest(raw: bytes, uri: str) -> list[FileEntry]:
    try:
        doc = json.loads(raw)
        entries = [FileEntry(_safe_relpath(f["path"], uri), str(f["sha256"]).lower(), int(f["size_bytes"]))
                   for f in doc["files"]]
    except (ValueError, KeyError, TypeError) as exc:
        raise ModelLoadFailed(
            f"{MANIFEST_NAME} under {uri} is not a valid manifest ({exc}); republish the "
            "artifact (mmctl registry add --from-dir ...)") from exc
    return entries


def _safe_relpath(path: str, uri: str) -> str:
    """Reject object keys that would escape the download folder."""
    parts = path.split("/")
    if not path or path.startswith("/") or any(p in ("", ".", "..") for p in parts) or "\\" in path:
        raise ModelLoadFailed(f"artifact {uri} contains an unsafe path {path!r}; refusing to download it")
    return path
