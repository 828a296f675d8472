"""S3 downloads as parallel ranged GETs, verified as the bytes arrive (moto's S3 server)."""

from __future__ import annotations

import hashlib
import os
import threading

import boto3
import pytest

from control_plane.tiers.cold import (
    MANIFEST_NAME,
    S3Config,
    S3Store,
    download_verified,
    folder_sha256,
    publish,
)
from control_plane.triton.process import free_port
from domain.errors import ModelLoadFailed

pytestmark = pytest.mark.integration

BUCKET = "parallel"
MiB = 1 << 20


@pytest.fixture(scope="module")
def s3_config():
    from moto.server import ThreadedMotoServer

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    config = S3Config(bucket=BUCKET, prefix="m", endpoint_url=f"http://127.0.0.1:{port}",
                      region="us-east-1", access_key_id="testing", secret_access_key="testing",
                      addressing_style="path", max_concurrency=4, part_size_bytes=5 * MiB)
    boto3.client("s3", endpoint_url=config.endpoint_url, region_name="us-east-1",
                 aws_access_key_id="testing", aws_secret_access_key="testing").create_bucket(Bucket=BUCKET)
    yield config
    server.stop()


@pytest.fixture
def folder(tmp_path):
    """A model folder whose weights take several parts (23 MiB of random bytes)."""
    root = tmp_path / "model"
    (root / "1").mkdir(parents=True)
    (root / "config.pbtxt").write_text('name: "big"\nbackend: "python"\n')
    (root / "1" / "weights.bin").write_bytes(os.urandom(23 * MiB))
    return root


def recording(store: S3Store) -> list[str]:
    """The Range header of every GetObject the store's client sends (threads included)."""
    ranges: list[str] = []
    lock = threading.Lock()

    def before_send(request, **_kwargs):
        value = request.headers.get("Range") or b""
        with lock:
            ranges.append(value.decode() if isinstance(value, bytes) else value)

    store.client.meta.events.register("before-send.s3.GetObject", before_send)
    return ranges


def test_a_large_object_comes_as_parallel_ranges_and_arrives_verified(s3_config, folder, tmp_path):
    store = S3Store(s3_config)
    uri = f"s3://{BUCKET}/m/big/1/"
    info = publish(store, folder, uri)
    ranges = recording(store)
    got, size = download_verified(store, uri, info.sha256, tmp_path / "staging", "big")
    assert size == info.size_bytes
    assert folder_sha256(got) == folder_sha256(folder) == info.sha256
    assert (got / "1" / "weights.bin").read_bytes() == (folder / "1" / "weights.bin").read_bytes()
    parts = [r for r in ranges if r.startswith("bytes=")]
    assert len(parts) >= 5, ranges  # 23 MiB in 5 MiB ranges, not one GET
    assert got.parent == tmp_path / "staging"  # streamed into the staging area


def test_an_object_larger_than_its_manifest_is_refused_as_the_extra_bytes_arrive(
        s3_config, folder, tmp_path):
    store = S3Store(s3_config)
    uri = f"s3://{BUCKET}/m/grown/1/"
    info = publish(store, folder, uri)
    # Someone replaces the weights with a bigger object under the same manifest.
    store.client.put_object(Bucket=BUCKET, Key="m/grown/1/1/weights.bin",
                            Body=os.urandom(40 * MiB))
    seen = []
    with pytest.raises(ModelLoadFailed, match="larger than"):
        download_verified(store, uri, info.sha256, tmp_path / "staging", "grown",
                          progress=lambda done, total: seen.append(done))
    assert not list((tmp_path / "staging").iterdir())  # nothing half-written is left
    assert max(seen, default=0) <= info.size_bytes  # never a byte past the listed size


def test_a_corrupt_part_fails_verification(s3_config, folder, tmp_path):
    store = S3Store(s3_config)
    uri = f"s3://{BUCKET}/m/corrupt/1/"
    info = publish(store, folder, uri)
    data = bytearray((folder / "1" / "weights.bin").read_bytes())
    data[17 * MiB] ^= 0xFF  # one byte in the fourth part
    store.client.put_object(Bucket=BUCKET, Key="m/corrupt/1/1/weights.bin", Body=bytes(data))
    with pytest.raises(ModelLoadFailed, match="sha256"):
        download_verified(store, uri, info.sha256, tmp_path / "staging", "corrupt")
    assert hashlib.sha256(bytes(data)).hexdigest() != info.files[0].sha256
    assert store.read_bytes(uri, MANIFEST_NAME) is not None
