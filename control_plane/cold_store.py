"""The cold tier: model folders in object storage (S3-compatible) or a local directory.

An *artifact* is one model folder (``config.pbtxt``, ``<version>/model.py``, weights)
stored under a URI prefix: ``s3://bucket/models/cust017/3/`` or ``file:///srv/models/cust017/3/``.

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
import os
import shutil
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from urllib.parse import unquote, urlparse

from .errors import ControlPlaneError, InvalidInput, ModelLoadFailed, ModelNotFound

log = logging.getLogger(__name__)

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
            "compute it with control_plane.cold_store.folder_sha256 or omit it to take the "
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


# --------------------------------------------------------------------------- stores
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
    def read_bytes(self, uri: str, relpath: str) -> bytes | None:
        """A small object (the manifest), or None if it does not exist."""

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

    def read_bytes(self, uri: str, relpath: str) -> bytes | None:
        path = self.path_of(uri) / relpath
        try:
            return path.read_bytes()
        except FileNotFoundError:
            return None

    def stream(self, uri: str, relpath: str) -> Iterator[bytes]:
        with open(self.path_of(uri) / relpath, "rb") as f:
            yield from iter(lambda: f.read(CHUNK_BYTES), b"")

    def put_file(self, uri: str, relpath: str, source: Path) -> None:
        dest = self.path_of(uri) / relpath
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_name(f".{dest.name}.{uuid.uuid4().hex[:8]}.tmp")
        shutil.copyfile(source, tmp)
        os.replace(tmp, dest)

    def put_bytes(self, uri: str, relpath: str, data: bytes) -> None:
        dest = self.path_of(uri) / relpath
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_name(f".{dest.name}.{uuid.uuid4().hex[:8]}.tmp")
        tmp.write_bytes(data)
        os.replace(tmp, dest)

    def describe(self) -> str:
        return f"local directory {self.root}"


@dataclass
class S3Config:
    """Where the S3-compatible store is.  Credentials left None come from boto3's usual chain
    (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY / profiles / instance roles)."""

    bucket: str = ""
    prefix: str = "models"
    endpoint_url: str | None = None  # e.g. http://127.0.0.1:9000 for MinIO; None = AWS
    region: str | None = None
    access_key_id: str | None = None
    secret_access_key: str | None = None
    session_token: str | None = None
    addressing_style: str = "auto"  # "path" for MinIO and most S3-compatible servers
    max_attempts: int = 3  # botocore's own retries of one request
    # Downloads: ranged GETs in flight per object, and their size.  One GET stream gets a
    # fraction of what S3 serves a client; AWS's guidance is concurrent ranges of 8-16 MB.
    # Objects up to one part come in one GET.  (MMS_S3_MAX_CONCURRENCY, MMS_S3_PART_BYTES)
    max_concurrency: int = 8
    part_size_bytes: int = 8 << 20

    def __repr__(self) -> str:
        # Configs end up in logs and tracebacks: the secret and the session token never do.
        shown = {f.name: getattr(self, f.name) for f in fields(self)}
        for name in ("secret_access_key", "session_token"):
            if shown[name] is not None:
                shown[name] = "***"
        return f"S3Config({', '.join(f'{k}={v!r}' for k, v in shown.items())})"

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> S3Config:
        """Read ``MMS_S3_*`` (and ``AWS_*`` through boto3).  Called from main(), never at import."""
        env = os.environ if env is None else env
        endpoint = env.get("MMS_S3_ENDPOINT_URL") or env.get("AWS_ENDPOINT_URL_S3") or None
        return cls(
            bucket=env.get("MMS_S3_BUCKET", ""),
            prefix=env.get("MMS_S3_PREFIX", "models"),
            endpoint_url=endpoint,
            region=env.get("MMS_S3_REGION") or env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION"),
            access_key_id=env.get("MMS_S3_ACCESS_KEY_ID") or None,
            secret_access_key=env.get("MMS_S3_SECRET_ACCESS_KEY") or None,
            addressing_style=env.get("MMS_S3_ADDRESSING_STYLE", "path" if endpoint else "auto"),
            max_concurrency=_int_env(env, "MMS_S3_MAX_CONCURRENCY", cls.max_concurrency),
            part_size_bytes=_int_env(env, "MMS_S3_PART_BYTES", cls.part_size_bytes),
        )

    def validate(self) -> None:
        if self.addressing_style not in ("auto", "path", "virtual"):
            raise InvalidInput(
                f"S3 addressing style {self.addressing_style!r} must be auto, path or virtual")
        if (self.access_key_id is None) != (self.secret_access_key is None):
            raise InvalidInput("give both the S3 access key id and the secret access key, or neither")
        if self.max_concurrency < 1:
            raise InvalidInput(f"S3 download concurrency ({self.max_concurrency}) must be >= 1 "
                               "(MMS_S3_MAX_CONCURRENCY)")
        if self.part_size_bytes < 5 << 20:
            raise InvalidInput(f"S3 part size ({self.part_size_bytes} bytes) must be at least "
                               "5 MiB, S3's smallest multipart part (MMS_S3_PART_BYTES)")


def _int_env(env: Mapping[str, str], name: str, default: int) -> int:
    raw = env.get(name)
    if raw is None or not raw.strip():
        return default
    try:
        return int(raw)
    except ValueError:
        raise InvalidInput(f"{name}={raw!r} is not a whole number") from None


class S3Store(ColdStore):
    """Artifacts in any S3-compatible object store (AWS S3, MinIO, Ceph, moto) via boto3."""

    scheme = "s3"

    def __init__(self, config: S3Config, client=None):
        config.validate()
        self.config = config
        self.client = client if client is not None else self._make_client(config)

    @staticmethod
    def _make_client(config: S3Config):
        try:
            import boto3
            from botocore.config import Config
        except ImportError as exc:  # pragma: no cover - install hint
            raise InvalidInput("the S3 cold store needs boto3: pip install boto3") from exc
        session = boto3.session.Session(
            aws_access_key_id=config.access_key_id,
            aws_secret_access_key=config.secret_access_key,
            aws_session_token=config.session_token,
            region_name=config.region or "us-east-1",
        )
        return session.client(
            "s3", endpoint_url=config.endpoint_url,
            config=Config(signature_version="s3v4", retries={"max_attempts": config.max_attempts,
                                                             "mode": "standard"},
                          s3={"addressing_style": config.addressing_style}))

    def default_uri(self, model: str, version: int) -> str:
        if not self.config.bucket:
            raise InvalidInput("no S3 bucket configured (MMS_S3_BUCKET); give --artifact s3://bucket/path/")
        prefix = self.config.prefix.strip("/")
        key = f"{prefix}/{model}/{version}/" if prefix else f"{model}/{version}/"
        return f"s3://{self.config.bucket}/{key}"

    @staticmethod
    def split(uri: str) -> tuple[str, str]:
        parsed = urlparse(uri)
        if parsed.scheme != "s3" or not parsed.netloc:
            raise InvalidInput(f"{uri!r} is not an s3://bucket/prefix/ URI")
        return parsed.netloc, _with_slash(parsed.path.lstrip("/")) if parsed.path.strip("/") else ""

    def _errors(self, uri: str, exc: Exception) -> ControlPlaneError:
        where = self.config.endpoint_url or "AWS S3"
        return ModelLoadFailed(
            f"object store {where} failed for {uri}: {exc}; check the endpoint, bucket and "
            "credentials (MMS_S3_ENDPOINT_URL, MMS_S3_BUCKET, AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY)")

    def list_files(self, uri: str) -> list[FileEntry]:
        bucket, prefix = self.split(uri)
        out = []
        try:
            for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
                for obj in page.get("Contents", []):
                    rel = obj["Key"][len(prefix):]
                    if not rel or rel == MANIFEST_NAME or rel.endswith("/"):
                        continue
                    if any(part in SKIPPED_DIRS for part in rel.split("/")[:-1]):
                        continue
                    out.append(FileEntry(_safe_relpath(rel, uri), None, int(obj["Size"])))
        except Exception as exc:
            if _is_missing(exc):
                return []
            raise self._errors(uri, exc) from exc
        return out

    def read_bytes(self, uri: str, relpath: str) -> bytes | None:
        bucket, prefix = self.split(uri)
        try:
            return self.client.get_object(Bucket=bucket, Key=prefix + relpath)["Body"].read()
        except Exception as exc:
            if _is_missing(exc):
                return None
            raise self._errors(uri, exc) from exc

    def stream(self, uri: str, relpath: str) -> Iterator[bytes]:
        bucket, prefix = self.split(uri)
        try:
            body = self.client.get_object(Bucket=bucket, Key=prefix + relpath)["Body"]
            try:
                yield from body.iter_chunks(CHUNK_BYTES)
            finally:
                body.close()
        except ControlPlaneError:
            raise
        except Exception as exc:
            raise self._errors(f"{uri}{relpath}", exc) from exc

    def copy_into(self, uri: str, relpath: str, sink: Callable[[bytes], None]) -> None:
        """Parallel ranged GETs (boto3's transfer manager); ``sink`` gets the bytes in order:
        a target that cannot seek makes the manager hold parts that arrive early until the
        ones before them are written."""
        from boto3.s3.transfer import TransferConfig

        bucket, prefix = self.split(uri)
        config = TransferConfig(multipart_threshold=self.config.part_size_bytes,
                                multipart_chunksize=self.config.part_size_bytes,
                                max_concurrency=self.config.max_concurrency,
                                io_chunksize=CHUNK_BYTES)
        target = _InOrderSink(sink)
        try:
            self.client.download_fileobj(bucket, prefix + relpath, target, Config=config)
        except Exception as exc:
            if target.error is not None:  # the sink's own (a full disk, more bytes than listed)
                raise target.error from None
            raise self._errors(f"{uri}{relpath}", exc) from exc

    def put_file(self, uri: str, relpath: str, source: Path) -> None:
        bucket, prefix = self.split(uri)
        self.client.upload_file(str(source), bucket, prefix + relpath)

    def put_bytes(self, uri: str, relpath: str, data: bytes) -> None:
        bucket, prefix = self.split(uri)
        self.client.put_object(Bucket=bucket, Key=prefix + relpath, Body=data)

    def describe(self) -> str:
        return f"S3 {self.config.endpoint_url or 'AWS'} bucket {self.config.bucket or '-'}"


class _InOrderSink:
    """A write-only target: boto3's transfer manager then writes parts in order.  Keeps the
    sink's own exception, which the transfer manager raises as a failed transfer."""

    def __init__(self, sink: Callable[[bytes], None]):
        self.sink = sink
        self.error: BaseException | None = None

    def write(self, data: bytes) -> None:
        try:
            self.sink(data)
        except BaseException as exc:
            self.error = exc
            raise


def _is_missing(exc: Exception) -> bool:
    code = getattr(exc, "response", {}).get("Error", {}).get("Code", "") if hasattr(exc, "response") else ""
    return code in ("NoSuchKey", "NoSuchBucket", "404", "NotFound")


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


# --------------------------------------------------------------------------- publish
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
            def sink(chunk: bytes) -> None:  # in order, as the bytes arrive
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
