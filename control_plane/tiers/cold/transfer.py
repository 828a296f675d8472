"""Publishing a model folder to a store, inspecting an artifact, and verified downloads.

Downloads (``download_verified``) stream each object into a fresh folder in a staging
directory, hashing on the way; nothing is renamed into Triton's repository here (the warm
tier does that, atomically, after verification).  From S3 a large object comes as parallel
ranged GETs (boto3's transfer manager, ``S3Config.max_concurrency`` parts of
``part_size_bytes`` at a time); the parts are written and hashed in order as they arrive, so
verification costs no second pass, and an object larger than its listed size fails as
soon as the extra bytes arrive (the transfer is cancelled).  A mismatch or a broken transfer is retried
once from scratch, then fails with ModelLoadFailed saying what differed.  Blocking: call it
from an executor thread.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import time
import uuid
from pathlib import Path

from control_plane.tiers.cold.digests import (
    MANIFEST_NAME,
    FileEntry,
    Progress,
    _manifest_doc,
    _parse_manifest,
    folder_manifest,
    manifest_digest,
    normalize_sha256,
)
from control_plane.tiers.cold.stores import ArtifactInfo, ColdStore, _with_slash
from domain.errors import ControlPlaneError, ModelLoadFailed, ModelNotFound

log = logging.getLogger(__package__)  # one logger name for the whole package


def publish(store: ColdStore, folder: Path, uri: str, progress: Progress | None = None) -> ArtifactInfo:
    """Upload a model folder to ``uri``: the files first, the manifest last.

    A reader that finds the manifest therefore finds every file it lists (one object PUT is
    atomic in S3).  Re-publishing over the same URI replaces files one by one: registry
    entries recorded with the old sha256 then fail verification instead of loading a mix.
    """
    uri = _with_slash(uri)
    entries = folder_manifest(folder)
    total = sum(e.size_bytes for e in entries)
    done = 0
    for e in entries:
        store.put_file(uri, e.path, folder / e.path)
        done += e.size_bytes
        if progress is not None:
            progress(done, total)
    doc = _manifest_doc(entries)
    store.put_bytes(uri, MANIFEST_NAME, json.dumps(doc, indent=1).encode())
    log.info("published %s to %s (%d files, %d bytes, sha256 %s)", folder, uri, len(entries),
             total, doc["sha256"])
    return ArtifactInfo(uri, doc["sha256"], total, tuple(entries))


def inspect(store: ColdStore, uri: str) -> ArtifactInfo:
    """The artifact's sha256 and size from its manifest, or by hashing every object.

    Trust on first use: the registry records what is there now; later downloads must match.
    """
    uri = _with_slash(uri)
    raw = store.read_bytes(uri, MANIFEST_NAME)
    if raw is not None:
        entries = _parse_manifest(raw, uri)
        digest = manifest_digest({e.path: e.sha256 for e in entries})
        return ArtifactInfo(uri, digest, sum(e.size_bytes for e in entries), tuple(entries))
    listed = store.list_files(uri)
    if not listed:
        raise ModelNotFound(f"no artifact at {uri} ({store.describe()}); publish it first "
                            "(mmctl registry add ... --from-dir DIR)")
    hashed = []
    for e in listed:
        h = hashlib.sha256()
        for chunk in store.stream(uri, e.path):
            h.update(chunk)
        hashed.append(FileEntry(e.path, h.hexdigest(), e.size_bytes))
    digest = manifest_digest({e.path: e.sha256 for e in hashed})
    return ArtifactInfo(uri, digest, sum(e.size_bytes for e in hashed), tuple(hashed), has_manifest=False)


# --------------------------------------------------------------------------- download
class _AttemptFailed(Exception):
    pass


def _download_once(store: ColdStore, uri: str, expected_sha256: str, tmp: Path,
                   progress: Progress | None) -> int:
    raw = store.read_bytes(uri, MANIFEST_NAME)
    if raw is not None:
        entries = _parse_manifest(raw, uri)
        listed = manifest_digest({e.path: e.sha256 for e in entries})
        if listed != expected_sha256:
            raise _AttemptFailed(
                f"its manifest describes sha256 {listed}, the registry expects {expected_sha256}")
    else:
        entries = store.list_files(uri)
        if not entries:
            raise ModelNotFound(f"no artifact at {uri} ({store.describe()}); publish it or fix "
                                "the URI in the registry")
    total = sum(e.size_bytes for e in entries)
    done = 0
    last_report = 0.0
    actual: dict[str, str] = {}
    for e in entries:
        dest = tmp / e.path
        dest.parent.mkdir(parents=True, exist_ok=True)
        h = hashlib.sha256()
        size = 0
        with open(dest, "wb") as f:
            def sink(chunk: bytes, e=e, h=h, f=f) -> None:  # in order, as the bytes arrive
                nonlocal size, done, last_report
                size += len(chunk)
                if size > e.size_bytes:  # no need to fetch the rest to know it is wrong
                    raise _AttemptFailed(f"{e.path} is larger than the {e.size_bytes} bytes its "
                                         "listing says")
                f.write(chunk)
                h.update(chunk)
                done += len(chunk)
                now = time.monotonic()
                if progress is not None and now - last_report >= 0.1:
                    last_report = now
                    progress(done, total)

            store.copy_into(uri, e.path, sink)
        digest = h.hexdigest()
        if size != e.size_bytes:
            raise _AttemptFailed(f"{e.path} arrived with {size} bytes, expected {e.size_bytes} "
                                 "(partial transfer)")
        if e.sha256 is not None and digest != e.sha256:
            raise _AttemptFailed(f"{e.path} has sha256 {digest}, its manifest says {e.sha256}")
        actual[e.path] = digest
    folder = manifest_digest(actual)
    if folder != expected_sha256:
        raise _AttemptFailed(f"the folder's sha256 is {folder}, the registry expects {expected_sha256}")
    if progress is not None:
        progress(done, total)
    return total


def download_verified(store: ColdStore, uri: str, expected_sha256: str, staging_dir: Path,
                      label: str, progress: Progress | None = None, attempts: int = 2) -> tuple[Path, int]:
    """Download the artifact at ``uri`` into a new folder under ``staging_dir``; verify it.

    Returns (folder, bytes).  The folder is only returned once every file matched; on a
    mismatch or a transfer error the folder is deleted and the download starts over, up to
    ``attempts`` times, then ModelLoadFailed names what differed.  The caller owns the
    returned folder (rename it into place or delete it).
    """
    uri = _with_slash(uri)
    expected_sha256 = normalize_sha256(expected_sha256)
    staging_dir.mkdir(parents=True, exist_ok=True)
    reasons = []
    for attempt in range(1, attempts + 1):
        tmp = staging_dir / f"{label}.{uuid.uuid4().hex[:12]}.partial"
        tmp.mkdir()
        try:
            size = _download_once(store, uri, expected_sha256, tmp, progress)
            return tmp, size
        except _AttemptFailed as exc:
            reasons.append(str(exc))
            log.warning("download of %s from %s failed verification (attempt %d/%d): %s",
                        label, uri, attempt, attempts, exc)
        except ModelNotFound:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        except (ControlPlaneError, OSError) as exc:
            reasons.append(exc.message if isinstance(exc, ControlPlaneError) else repr(exc))
            log.warning("download of %s from %s failed (attempt %d/%d): %s", label, uri, attempt,
                        attempts, reasons[-1])
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        shutil.rmtree(tmp, ignore_errors=True)
    raise ModelLoadFailed(
        f"artifact {uri} for {label} failed verification after {attempts} attempts: "
        f"{reasons[-1]}; nothing was loaded.  The object store holds a corrupt or different "
        "artifact: republish it (mmctl registry add ... --from-dir DIR) or register the right "
        "sha256")

