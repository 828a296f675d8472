"""The S3-compatible store (AWS S3, MinIO, Ceph, moto) through boto3.

A large object comes as parallel ranged GETs (boto3's transfer manager,
``S3Config.max_concurrency`` parts of ``part_size_bytes`` at a time), handed to the
caller's sink in order as they arrive.  boto3 is imported only when a store is made.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from urllib.parse import urlparse

from control_plane.tiers.cold.digests import (
    CHUNK_BYTES,
    MANIFEST_NAME,
    SKIPPED_DIRS,
    FileEntry,
    _safe_relpath,
)
from control_plane.tiers.cold.stores import ColdStore, _with_slash
from domain.errors import ControlPlaneError, InvalidInput, ModelLoadFailed
from domain.settings import env_values, setting


@dataclass
class S3Config:
    """Where the S3-compatible store is: settings of the environment only (``MMS_S3_*``,
    ``domain.settings``).  Credentials left None come from boto3's usual chain
    (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY / profiles / instance roles)."""

    bucket: str = setting("", "Bucket of the cold store (S3 or S3-compatible); empty: no S3.",
                          env="MMS_S3_BUCKET")
    prefix: str = setting("models", "Key prefix of the artifacts in the bucket (empty: the "
                          "bucket's root).", env="MMS_S3_PREFIX", keep_empty=True)
    endpoint_url: str | None = setting(  # e.g. http://127.0.0.1:9000 for MinIO; None = AWS
        None, "Endpoint of an S3-compatible server (e.g. http://127.0.0.1:9000 for MinIO); "
        "unset: AWS.", env="MMS_S3_ENDPOINT_URL", aliases=("AWS_ENDPOINT_URL_S3",))
    region: str | None = setting(None, "Region of the bucket.", env="MMS_S3_REGION",
                                 aliases=("AWS_REGION", "AWS_DEFAULT_REGION"))
    access_key_id: str | None = setting(
        None, "Access key id (unset: boto3's credential chain).", env="MMS_S3_ACCESS_KEY_ID",
        secret=True)
    secret_access_key: str | None = setting(
        None, "Secret access key (unset: boto3's credential chain).",
        env="MMS_S3_SECRET_ACCESS_KEY", secret=True)
    session_token: str | None = None
    # "path" for MinIO and most S3-compatible servers; unset: path with an endpoint, else auto
    addressing_style: str = setting(
        "auto", "auto, path or virtual (default: path with MMS_S3_ENDPOINT_URL, else auto).",
        env="MMS_S3_ADDRESSING_STYLE")
    max_attempts: int = 3  # botocore's own retries of one request
    # Downloads: ranged GETs in flight per object, and their size.  One GET stream gets a
    # fraction of what S3 serves a client; AWS's guidance is concurrent ranges of 8-16 MB.
    # Objects up to one part come in one GET.
    max_concurrency: int = setting(8, "Ranged GETs in flight per object when downloading.",
                                   env="MMS_S3_MAX_CONCURRENCY", parse=int)
    part_size_bytes: int = setting(8 << 20, "Bytes of each ranged GET (at least 5 MiB); objects "
                                   "up to one part come in one GET.", env="MMS_S3_PART_BYTES",
                                   parse=int)

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
        values = env_values(cls, env)
        values.setdefault("addressing_style", "path" if values.get("endpoint_url") else "auto")
        return cls(**values)

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

    def read_bytes(self, uri: str, relpath: str, max_bytes: int | None = None) -> bytes | None:
        bucket, prefix = self.split(uri)
        ranged = {} if max_bytes is None else {"Range": f"bytes=0-{max(max_bytes, 1) - 1}"}
        try:
            return self.client.get_object(Bucket=bucket, Key=prefix + relpath, **ranged)["Body"].read()
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
        try:
            self.client.upload_file(str(source), bucket, prefix + relpath)
        except Exception as exc:  # AccessDenied, no credentials, an endpoint down: said clearly
            raise self._errors(f"{uri}{relpath}", exc) from exc

    def put_bytes(self, uri: str, relpath: str, data: bytes) -> None:
        bucket, prefix = self.split(uri)
        try:
            self.client.put_object(Bucket=bucket, Key=prefix + relpath, Body=data)
        except Exception as exc:
            raise self._errors(f"{uri}{relpath}", exc) from exc

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

