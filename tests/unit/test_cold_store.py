"""Cold store: folder sha256, publish, verified download (local-directory store, no sockets)."""

from __future__ import annotations

import hashlib
import itertools
import json
import subprocess
from pathlib import Path

import pytest

from control_plane.tiers.cold import (
    MANIFEST_NAME,
    LocalDirStore,
    download_verified,
    folder_sha256,
    inspect,
    manifest_text,
    normalize_sha256,
    publish,
)
from domain.errors import InvalidInput, ModelLoadFailed, ModelNotFound


def make_folder(root: Path, name: str = "m", weights: bytes = b"w" * 5000) -> Path:
    folder = root / name
    (folder / "1").mkdir(parents=True)
    (folder / "config.pbtxt").write_text(f'name: "{name}"\nbackend: "python"\n')
    (folder / "1" / "model.py").write_text("class TritonPythonModel: pass\n")
    (folder / "1" / "weights.bin").write_bytes(weights)
    return folder


def test_folder_sha256_is_sha256sum_of_the_sorted_manifest(tmp_path):
    folder = make_folder(tmp_path)
    (folder / "1" / "__pycache__").mkdir()
    (folder / "1" / "__pycache__" / "model.cpython-311.pyc").write_bytes(b"cache")
    files = {
        "1/model.py": hashlib.sha256((folder / "1" / "model.py").read_bytes()).hexdigest(),
        "1/weights.bin": hashlib.sha256(b"w" * 5000).hexdigest(),
        "config.pbtxt": hashlib.sha256((folder / "config.pbtxt").read_bytes()).hexdigest(),
    }
    expected = hashlib.sha256(manifest_text(files).encode()).hexdigest()
    assert folder_sha256(folder) == expected
    # The documented shell recipe gives the same digest.
    shell = subprocess.run(
        "find . -type f ! -path '*/__pycache__/*' ! -name mms-manifest.json | sed 's#^\\./##' "
        "| LC_ALL=C sort | xargs sha256sum | sha256sum", shell=True, cwd=folder,
        capture_output=True, text=True, check=True)
    assert shell.stdout.split()[0] == expected


def test_sha256_changes_with_any_byte_or_name(tmp_path):
    a = folder_sha256(make_folder(tmp_path / "a"))
    assert folder_sha256(make_folder(tmp_path / "b")) == a
    assert folder_sha256(make_folder(tmp_path / "c", weights=b"w" * 4999 + b"x")) != a
    renamed = make_folder(tmp_path / "d")
    (renamed / "1" / "weights.bin").rename(renamed / "1" / "weights2.bin")
    assert folder_sha256(renamed) != a


@pytest.mark.parametrize("value, ok", [
    ("a" * 64, True), ("sha256:" + "A" * 64, True), ("a" * 63, False), ("z" * 64, False), ("", False),
])
def test_a_sha256_is_accepted_only_as_64_hex_digits_with_an_optional_prefix(value, ok):
    if ok:
        assert normalize_sha256(value) == value.lower().removeprefix("sha256:")
    else:
        with pytest.raises(InvalidInput, match="64 hex digits"):
            normalize_sha256(value)


def test_publish_then_download_verified(tmp_path):
    store = LocalDirStore(tmp_path / "cold")
    folder = make_folder(tmp_path / "src")
    uri = store.default_uri("m", 1)
    info = publish(store, folder, uri)
    assert info.sha256 == folder_sha256(folder)
    assert info.size_bytes == sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
    manifest = json.loads((store.path_of(uri) / MANIFEST_NAME).read_text())
    assert manifest["sha256"] == info.sha256 and len(manifest["files"]) == 3
    assert inspect(store, uri).sha256 == info.sha256

    seen = []
    out, size = download_verified(store, uri, info.sha256, tmp_path / "staging", "m.v1",
                                  progress=lambda done, total: seen.append((done, total)))
    assert size == info.size_bytes
    assert folder_sha256(out) == info.sha256
    assert seen[-1] == (info.size_bytes, info.size_bytes)
    assert all(a[0] <= b[0] for a, b in itertools.pairwise(seen))


def test_inspect_without_manifest_hashes_every_object(tmp_path):
    store = LocalDirStore(tmp_path / "cold")
    folder = make_folder(tmp_path / "cold")  # put there by another tool: no manifest
    info = inspect(store, folder.as_uri() + "/")
    assert not info.has_manifest and info.sha256 == folder_sha256(folder)
    out, _ = download_verified(store, folder.as_uri(), info.sha256, tmp_path / "staging", "m.v1")
    assert folder_sha256(out) == info.sha256


def test_corrupt_artifact_is_retried_once_then_fails_clearly_and_leaves_nothing(tmp_path):
    store = LocalDirStore(tmp_path / "cold")
    uri = store.default_uri("m", 1)
    info = publish(store, make_folder(tmp_path / "src"), uri)
    (store.path_of(uri) / "1" / "weights.bin").write_bytes(b"x" * 5000)  # same size, other bytes
    staging = tmp_path / "staging"
    with pytest.raises(ModelLoadFailed) as err:
        download_verified(store, uri, info.sha256, staging, "m.v1")
    msg = str(err.value)
    assert "after 2 attempts" in msg and "1/weights.bin has sha256" in msg and "republish" in msg
    assert list(staging.iterdir()) == []


def test_truncated_object_is_a_partial_transfer(tmp_path):
    store = LocalDirStore(tmp_path / "cold")
    uri = store.default_uri("m", 1)
    info = publish(store, make_folder(tmp_path / "src"), uri)
    (store.path_of(uri) / "1" / "weights.bin").write_bytes(b"w" * 100)
    with pytest.raises(ModelLoadFailed, match="partial transfer"):
        download_verified(store, uri, info.sha256, tmp_path / "staging", "m.v1", attempts=1)


def test_wrong_registry_sha256_is_refused(tmp_path):
    store = LocalDirStore(tmp_path / "cold")
    uri = store.default_uri("m", 1)
    publish(store, make_folder(tmp_path / "src"), uri)
    with pytest.raises(ModelLoadFailed, match="registry expects"):
        download_verified(store, uri, "0" * 64, tmp_path / "staging", "m.v1")


class FlakyStore(LocalDirStore):
    """Serves a corrupt chunk on the first read of one file, good data afterwards."""

    def __init__(self, root, victim):
        super().__init__(root)
        self.victim, self.reads = victim, 0

    def stream(self, uri, relpath):
        if relpath == self.victim:
            self.reads += 1
            if self.reads == 1:
                data = b"".join(super().stream(uri, relpath))
                yield bytes([data[0] ^ 1]) + data[1:]
                return
        yield from super().stream(uri, relpath)


def test_a_transient_corruption_is_healed_by_the_retry(tmp_path):
    store = FlakyStore(tmp_path / "cold", "1/weights.bin")
    uri = store.default_uri("m", 1)
    info = publish(store, make_folder(tmp_path / "src"), uri)
    out, _ = download_verified(store, uri, info.sha256, tmp_path / "staging", "m.v1")
    assert store.reads == 2 and folder_sha256(out) == info.sha256
    assert [p.name for p in (tmp_path / "staging").iterdir()] == [out.name]


def test_missing_artifact_is_not_found(tmp_path):
    store = LocalDirStore(tmp_path / "cold")
    with pytest.raises(ModelNotFound, match="no artifact"):
        download_verified(store, store.default_uri("nope", 1), "a" * 64, tmp_path / "s", "nope.v1")
    with pytest.raises(ModelNotFound, match="publish it first"):
        inspect(store, store.default_uri("nope", 1))


def test_manifest_with_escaping_path_is_refused(tmp_path):
    store = LocalDirStore(tmp_path / "cold")
    uri = store.default_uri("m", 1)
    store.put_bytes(uri, MANIFEST_NAME, json.dumps(
        {"files": [{"path": "../../etc/passwd", "sha256": "a" * 64, "size_bytes": 1}]}).encode())
    with pytest.raises(ModelLoadFailed, match="unsafe path"):
        download_verified(store, uri, "a" * 64, tmp_path / "s", "m.v1")


def test_s3_config_repr_never_shows_the_secret():
    from control_plane.tiers.cold import S3Config

    config = S3Config.from_env({"MMS_S3_BUCKET": "models", "MMS_S3_ACCESS_KEY_ID": "AKIAEXAMPLE",
                                "MMS_S3_SECRET_ACCESS_KEY": "wJalrXUtnFEMI-very-secret"})
    config.session_token = "session-token-value"
    for text in (repr(config), str(config), f"{config}", repr([config])):
        assert "wJalrXUtnFEMI-very-secret" not in text
        assert "session-token-value" not in text
        assert "bucket='models'" in text and "secret_access_key='***'" in text
    assert "secret_access_key=None" in repr(S3Config(bucket="models"))


def test_a_failed_write_to_the_local_store_leaves_no_temporary_file(tmp_path, monkeypatch):
    import shutil

    store = LocalDirStore(tmp_path / "cold")
    uri = (tmp_path / "cold" / "m" / "1").as_uri() + "/"

    def disk_full(source, dest):
        with open(dest, "wb") as f:
            f.write(b"half")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(shutil, "copyfile", disk_full)
    source = tmp_path / "weights.bin"
    source.write_bytes(b"w" * 100)
    with pytest.raises(OSError, match="No space left"):
        store.put_file(uri, "1/weights.bin", source)
    assert [p.name for p in (tmp_path / "cold" / "m" / "1" / "1").iterdir()] == []


def test_an_s3_upload_that_fails_says_what_to_check_and_shows_no_secret():
    from botocore.exceptions import ClientError

    from control_plane.tiers.cold import S3Config, S3Store

    class Refusing:
        def upload_file(self, *args, **kwargs):
            raise ClientError({"Error": {"Code": "AccessDenied", "Message": "Access Denied"}}, "PutObject")

        def put_object(self, **kwargs):
            raise ClientError({"Error": {"Code": "AccessDenied", "Message": "Access Denied"}}, "PutObject")

    config = S3Config(bucket="models", access_key_id="AKIAEXAMPLE", secret_access_key="wJalrXUtnFEMI-secret")
    store = S3Store(config, client=Refusing())
    for put in (lambda: store.put_file("s3://models/m/1/", "config.pbtxt", Path(__file__)),
                lambda: store.put_bytes("s3://models/m/1/", "mms-manifest.json", b"{}")):
        with pytest.raises(ModelLoadFailed) as info:
            put()
        assert "AccessDenied" in info.value.message and "MMS_S3_BUCKET" in info.value.message
        assert "wJalrXUtnFEMI-secret" not in info.value.message
