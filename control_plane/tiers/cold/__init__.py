"""The cold tier: model folders in object storage (S3-compatible) or a local directory.

An *artifact* is one model folder (``config.pbtxt``, ``<version>/model.py``, weights)
stored under a URI prefix: ``s3://bucket/models/cust017/3/`` or ``file:///srv/models/cust017/3/``.

The folder sha256 the registry records is defined in ``digests``; how downloads stream,
hash and verify (parallel ranged GETs from S3, one retry) in ``transfer``.

Modules:
    digests   manifests, per-file and folder sha256
    stores    the ColdStore interface, LocalDirStore (file://), ColdStores by URI scheme
    s3        S3Config and S3Store (boto3, parallel ranged GETs)
    transfer  publish, inspect, download_verified
"""

from control_plane.tiers.cold.digests import (
    CHUNK_BYTES,
    MANIFEST_FORMAT,
    MANIFEST_NAME,
    SKIPPED_DIRS,
    FileEntry,
    Progress,
    file_sha256,
    folder_manifest,
    folder_sha256,
    manifest_digest,
    manifest_text,
    normalize_sha256,
)
from control_plane.tiers.cold.s3 import S3Config, S3Store
from control_plane.tiers.cold.stores import ArtifactInfo, ColdStore, ColdStores, LocalDirStore
from control_plane.tiers.cold.transfer import download_verified, inspect, publish

__all__ = [
    "CHUNK_BYTES",
    "MANIFEST_FORMAT",
    "MANIFEST_NAME",
    "SKIPPED_DIRS",
    "ArtifactInfo",
    "ColdStore",
    "ColdStores",
    "FileEntry",
    "LocalDirStore",
    "Progress",
    "S3Config",
    "S3Store",
    "download_verified",
    "file_sha256",
    "folder_manifest",
    "folder_sha256",
    "inspect",
    "manifest_digest",
    "manifest_text",
    "normalize_sha256",
    "publish",
]
