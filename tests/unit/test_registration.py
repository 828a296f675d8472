"""Registering a version whose files are published to the cold store (``register_version``):
versions are immutable, so a registration never writes over files a registered version
reads, and a refused one leaves no files behind (a local-directory store, no sockets)."""

from __future__ import annotations

import asyncio
import shutil
import threading
from pathlib import Path

import pytest

from control_plane.registry import Registry, register_version
from control_plane.state.state_store import StateStore
from control_plane.tiers.cold import ColdStores, LocalDirStore, download_verified
from domain.errors import InvalidInput
from tests.unit.test_cold_store import make_folder


@pytest.fixture
def registry(tmp_path) -> Registry:
    stores = ColdStores([LocalDirStore(tmp_path / "cold")])
    return Registry(StateStore(tmp_path / "state.db").db, stores=stores)


def files_under(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


def register(registry: Registry, folder: Path, **kwargs):
    return asyncio.run(register_version(registry, "m", who="test", source_dir=str(folder), **kwargs))


def test_a_registration_never_publishes_over_a_registered_versions_files(registry, tmp_path):
    """Its sha256 was checked only after the upload: v1's files were already rewritten, and
    v1 (its recorded sha256 the old one) could never be downloaded again."""
    v1 = register(registry, make_folder(tmp_path / "one", weights=b"1" * 4000))
    other = make_folder(tmp_path / "two", weights=b"2" * 4000)
    for uri in (v1.artifact_uri, v1.artifact_uri.rstrip("/"), v1.artifact_uri + "1/",
                v1.artifact_uri.rsplit("/", 2)[0] + "/"):
        with pytest.raises(InvalidInput, match="holds the artifact of m version 1"):
            register(registry, other, version=2, artifact_uri=uri, sha256="1" * 64)
    folder, _size = download_verified(LocalDirStore(tmp_path / "cold"), v1.artifact_uri, v1.sha256,
                                      tmp_path / "staging", "m v1")
    assert (folder / "1" / "weights.bin").read_bytes() == b"1" * 4000
    assert registry.find("m", 2) is None


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"version": 0}, "must be >= 1"),
    ({"sla": "platinum"}, "SLA class 'platinum' is unknown"),
    ({"stage": "retired"}, "initial stage 'retired'"),
    ({"artifact_uri": 5}, "artifact_uri must be a string"),
])
def test_a_refused_version_leaves_no_files_in_the_store(registry, tmp_path, kwargs, message):
    with pytest.raises(InvalidInput, match=message):
        register(registry, make_folder(tmp_path / "src"), **kwargs)
    cold = tmp_path / "cold"
    assert not cold.exists() or files_under(cold) == []


def test_two_registrations_at_once_take_two_versions(registry, tmp_path, monkeypatch):
    """Both read the same next free version and published to the same folder: one row won,
    its files possibly the other's."""
    from control_plane.registry import artifacts

    first_publishing, go_on = threading.Event(), threading.Event()
    publish = artifacts.publish

    def slow_publish(store, folder, uri):
        if folder.parent.name == "one":
            first_publishing.set()
            assert go_on.wait(10)
        return publish(store, folder, uri)

    monkeypatch.setattr(artifacts, "publish", slow_publish)
    one = make_folder(tmp_path / "one", weights=b"1" * 4000)
    two = make_folder(tmp_path / "two", weights=b"2" * 4000)

    async def both():
        first = asyncio.create_task(register_version(registry, "m", who="a", source_dir=str(one)))
        await asyncio.to_thread(first_publishing.wait, 10)
        with pytest.raises(InvalidInput, match="m version 1 is being registered now"):
            await register_version(registry, "m", version=1, who="b", source_dir=str(two))
        second = await register_version(registry, "m", who="b", source_dir=str(two))
        go_on.set()
        return await first, second

    first, second = asyncio.run(both())
    assert (first.version, second.version) == (1, 2)
    assert first.artifact_uri != second.artifact_uri
    for mv, weights in ((first, b"1" * 4000), (second, b"2" * 4000)):
        folder, _ = download_verified(LocalDirStore(tmp_path / "cold"), mv.artifact_uri, mv.sha256,
                                      tmp_path / f"staging{mv.version}", f"m v{mv.version}")
        assert (folder / "1" / "weights.bin").read_bytes() == weights


@pytest.mark.parametrize("link", ["config.pbtxt", "1/weights.bin", "1"])
def test_a_folder_with_symbolic_links_is_refused_before_anything_is_published(registry, tmp_path,
                                                                              link):
    """Links were skipped silently: a config or weights file behind one was missing from the
    published copy, which verified cleanly and failed only when Triton loaded it."""
    folder = make_folder(tmp_path / "src")
    target = tmp_path / "elsewhere" / link
    target.parent.mkdir(parents=True, exist_ok=True)
    (folder / link).rename(target)
    (folder / link).symlink_to(target)
    with pytest.raises(InvalidInput, match=f"holds symbolic links \\({link}\\).*cp -rL"):
        register(registry, folder)
    cold = tmp_path / "cold"
    assert not cold.exists() or files_under(cold) == []
    assert registry.versions("m") == []


def test_a_variant_uploaded_to_the_store_is_checked_from_its_weights_header_alone(tmp_path, monkeypatch):
    """The whole weights file (gigabytes for a real fine-tune) was read into memory, once per
    request, to parse its header."""
    from control_plane.families import WEIGHTS_FILE, FamilyCatalog, write_variant
    from control_plane.tiers.cold import publish
    from tests.integration.test_families import scaler_family, scaler_weights

    repo = scaler_family(tmp_path)
    store = LocalDirStore(tmp_path / "cold")
    uploaded = write_variant(tmp_path / "upload", "acme", "scaler", scaler_weights(2.0, 1.0))
    uri = (tmp_path / "cold" / "uploads" / "acme").as_uri() + "/"
    publish(store, uploaded, uri)
    reads = []
    read_bytes = LocalDirStore.read_bytes

    def counted(self, uri, relpath, max_bytes=None):
        data = read_bytes(self, uri, relpath, max_bytes)
        reads.append((relpath, len(data or b"")))
        return data

    monkeypatch.setattr(LocalDirStore, "read_bytes", counted)
    registry = Registry(StateStore(tmp_path / "state.db").db, stores=ColdStores([store]))
    mv = asyncio.run(register_version(registry, "acme", who="test", artifact_uri=uri, family="scaler",
                                      families=FamilyCatalog(repo)))
    assert mv.family == "scaler"
    header = [size for relpath, size in reads if relpath == WEIGHTS_FILE]
    weights_size = (uploaded / WEIGHTS_FILE).stat().st_size
    assert header and max(header) < weights_size - 16, (header, weights_size)
    # a truncated upload is still refused: its size is the listed one, not the bytes read
    cut = tmp_path / "cold" / "uploads" / "cut"
    shutil.copytree(tmp_path / "cold" / "uploads" / "acme", cut)
    with open(cut / WEIGHTS_FILE, "r+b") as f:
        f.truncate(weights_size - 8)
    (cut / "mms-manifest.json").unlink()
    with pytest.raises(InvalidInput, match="truncated"):
        asyncio.run(register_version(registry, "cut", who="test", artifact_uri=cut.as_uri() + "/",
                                     family="scaler", families=FamilyCatalog(repo)))
