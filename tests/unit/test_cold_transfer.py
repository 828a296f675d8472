"""The S3 download path: ranged GETs through boto3's transfer manager (fake client)."""

from __future__ import annotations

import hashlib
import json

import pytest

from control_plane.tiers.cold import (
    MANIFEST_NAME,
    S3Config,
    S3Store,
    download_verified,
    manifest_digest,
)
from domain.errors import InvalidInput, ModelLoadFailed

DATA = bytes(range(256)) * 4096  # 1 MiB


class FakeS3:
    """Holds objects; download_fileobj writes them in slices as the transfer manager would."""

    def __init__(self, objects: dict[str, bytes], fail_with: Exception | None = None):
        self.objects = objects
        self.fail_with = fail_with
        self.configs = []

    def get_object(self, Bucket, Key):
        if Key not in self.objects:
            raise KeyError(Key)

        class Body:
            def __init__(self, data):
                self.data = data

            def read(self):
                return self.data

        return {"Body": Body(self.objects[Key])}

    def download_fileobj(self, Bucket, Key, Fileobj, Config=None):
        self.configs.append(Config)
        assert not hasattr(Fileobj, "seek")  # so parts are written in order
        data = self.objects[Key]
        for start in range(0, len(data), 256 * 1024):
            if self.fail_with is not None and start > 0:
                raise self.fail_with
            Fileobj.write(data[start:start + 256 * 1024])


def store_with(files: dict[str, bytes], **fake) -> tuple[S3Store, str, str]:
    manifest = {"files": [{"path": p, "sha256": hashlib.sha256(d).hexdigest(), "size_bytes": len(d)}
                          for p, d in files.items()]}
    objects = {f"m/x/1/{p}": d for p, d in files.items()}
    objects[f"m/x/1/{MANIFEST_NAME}"] = json.dumps(manifest).encode()
    store = S3Store(S3Config(bucket="b", max_concurrency=6, part_size_bytes=16 << 20),
                    client=FakeS3(objects, **fake))
    digest = manifest_digest({f["path"]: f["sha256"] for f in manifest["files"]})
    return store, "s3://b/m/x/1/", digest


def test_downloads_go_through_the_transfer_manager_with_the_configured_concurrency(tmp_path):
    store, uri, digest = store_with({"1/weights.bin": DATA, "config.pbtxt": b"name: 'x'"})
    folder, size = download_verified(store, uri, digest, tmp_path / "staging", "x")
    assert size == len(DATA) + 9
    assert (folder / "1" / "weights.bin").read_bytes() == DATA
    config = store.client.configs[0]
    assert (config.max_concurrency, config.multipart_chunksize) == (6, 16 << 20)


def test_a_transfer_error_is_a_clear_download_failure(tmp_path):
    from botocore.exceptions import ConnectionClosedError

    store, uri, digest = store_with({"1/weights.bin": DATA},
                                    fail_with=ConnectionClosedError(endpoint_url="http://s3"))
    with pytest.raises(ModelLoadFailed, match="object store .* failed for s3://b/m/x/1/1/weights.bin"):
        download_verified(store, uri, digest, tmp_path / "staging", "x")
    assert not list((tmp_path / "staging").iterdir())


def test_the_download_concurrency_comes_from_the_environment_and_is_checked():
    assert S3Config.from_env({"MMS_S3_MAX_CONCURRENCY": "16"}).max_concurrency == 16
    assert S3Config.from_env({}).max_concurrency == 8
    assert S3Config.from_env({"MMS_S3_PART_BYTES": str(16 << 20)}).part_size_bytes == 16 << 20
    with pytest.raises(InvalidInput, match="MMS_S3_MAX_CONCURRENCY='many' is not a whole number"):
        S3Config.from_env({"MMS_S3_MAX_CONCURRENCY": "many"})
    with pytest.raises(InvalidInput, match=r"concurrency \(0\) must be >= 1"):
        S3Config(max_concurrency=0).validate()
    with pytest.raises(InvalidInput, match="at least 5 MiB"):
        S3Config(part_size_bytes=1 << 20).validate()
