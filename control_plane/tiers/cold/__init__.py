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
