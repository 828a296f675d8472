"""Warm tier: staging from the cold store, byte budget + LRU, busy models, restart recovery."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from control_plane.registry import Registry
from control_plane.state.state_store import StateStore
from control_plane.tiers.cold import ColdStores, LocalDirStore, folder_sha256, publish
from control_plane.tiers.warm import WARM_MANIFEST, WarmTier, default_warm_repository, folder_bytes
from domain.errors import (
    CapacityExhausted,
    InvalidInput,
    ModelLoadFailed,
    ModelNotFound,
)
from tests.conftest import run

WEIGHTS_BYTES = 10_000


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        self.now += 1.0
        return self.now


def make_folder(root: Path, name: str, weights_bytes: int = WEIGHTS_BYTES) -> Path:
    folder = root / name
    (folder / "1").mkdir(parents=True)
    (folder / "config.pbtxt").write_text(f'name: "{name}"\nbackend: "python"\nmax_batch_size: 8\n')
    (folder / "1" / "model.py").write_text("class TritonPythonModel: pass\n")
    (folder / "1" / "weights.bin").write_bytes(name.encode() * (weights_bytes // len(name)))
    return folder


class Env:
    def __init__(self, tmp_path: Path, budget_models: float | None = 2.5, count: int = 4):
        self.tmp = tmp_path
        self.store = StateStore(tmp_path / "state.db")
        self.cold = LocalDirStore(tmp_path / "cold")
        self.registry = Registry(self.store.db, stores=ColdStores([self.cold]))
        for i in range(1, count + 1):
            model = f"m{i}"
            info = publish(self.cold, make_folder(tmp_path / "src", model), self.cold.default_uri(model, 1))
            self.registry.add(model, 1, info.uri, info.sha256, info.size_bytes, who="test")
        self.size = self.registry.get("m1", 1).size_bytes
        budget = int(self.size * budget_models) if budget_models else None
        self.warm = self.new_warm(budget)

    def new_warm(self, budget=None):
        return WarmTier(self.tmp / "shm" / "repository", self.registry, ColdStores([self.cold]),
                        budget_bytes=budget, clock=Clock())

    def names(self) -> set[str]:
        return {p.name for p in self.warm.repository.iterdir()}


def test_stage_downloads_verifies_and_renames_config(tmp_path):
    env = Env(tmp_path)
    size = run(env.warm.stage("m1.v1"))
    folder = env.warm.repository / "m1.v1"
    assert size == folder_bytes(folder) > WEIGHTS_BYTES
    assert (folder / "config.pbtxt").read_text().startswith('name: "m1.v1"')
    manifest = json.loads((folder / WARM_MANIFEST).read_text())
    assert manifest["sha256"] == env.registry.get("m1", 1).sha256
    assert list(env.warm.staging_dir.iterdir()) == []
    assert env.warm.tier_of("m1.v1") == "warm" and env.warm.tier_of("m2.v1") == "cold"
    assert {"m1.v1", "m2.v1", "m3.v1", "m4.v1"} <= env.warm.known()


def test_staging_past_the_budget_evicts_the_least_recently_used_model(tmp_path):
    env = Env(tmp_path, budget_models=2.5)

    async def go():
        await env.warm.stage("m1.v1")
        await env.warm.stage("m2.v1")
        await env.warm.stage("m1.v1")  # a hit: m1 is now more recent than m2
        await env.warm.stage("m3.v1")

    run(go())
    assert env.names() == {"m1.v1", "m3.v1"}
    assert env.warm.used_bytes <= env.warm.budget_bytes


def test_busy_models_are_never_evicted_from_warm(tmp_path):
    env = Env(tmp_path, budget_models=2.5)

    async def go():
        env.warm.set_busy("m1.v1", True)  # the manager marks before staging
        await env.warm.stage("m1.v1")
        await env.warm.stage("m2.v1")
        await env.warm.stage("m3.v1")  # evicts m2 (m1 is older but busy)
        assert env.names() == {"m1.v1", "m3.v1"}
        env.warm.set_busy("m3.v1", True)
        with pytest.raises(CapacityExhausted) as err:
            await env.warm.stage("m4.v1")
        assert "m1.v1" in str(err.value) and "m3.v1" in str(err.value)
        assert env.names() == {"m1.v1", "m3.v1"}  # nothing evicted by the failed attempt
        env.warm.set_busy("m1.v1", False)
        await env.warm.stage("m4.v1")
        assert env.names() == {"m3.v1", "m4.v1"}

    run(go())


def test_in_use_guard_protects_models_adopted_from_triton(tmp_path):
    env = Env(tmp_path, budget_models=2.5)
    env.warm.in_use = lambda name: name == "m1.v1"

    async def go():
        await env.warm.stage("m1.v1")
        await env.warm.stage("m2.v1")
        await env.warm.stage("m3.v1")

    run(go())
    assert "m1.v1" in env.names()
    with pytest.raises(InvalidInput, match="unload it before"):
        env.warm.evict("m1.v1")


def test_model_larger_than_the_warm_budget(tmp_path):
    env = Env(tmp_path, budget_models=0.5)
    with pytest.raises(CapacityExhausted, match="whole warm budget"):
        run(env.warm.stage("m1.v1"))


def test_concurrent_stages_share_one_download(tmp_path):
    env = Env(tmp_path, budget_models=None)
    calls = []
    real = env.cold.stream

    def counting(uri, relpath):
        calls.append(relpath)
        return real(uri, relpath)

    env.cold.stream = counting

    async def go():
        sizes = await asyncio.gather(*(env.warm.stage("m2.v1") for _ in range(8)))
        assert len(set(sizes)) == 1

    run(go())
    assert sorted(calls) == ["1/model.py", "1/weights.bin", "config.pbtxt"]


def test_corrupt_cold_copy_never_reaches_the_repository(tmp_path):
    env = Env(tmp_path)
    victim = env.cold.path_of(env.cold.default_uri("m2", 1)) / "1" / "weights.bin"
    victim.write_bytes(b"\0" * victim.stat().st_size)
    with pytest.raises(ModelLoadFailed, match="failed verification after 2 attempts"):
        run(env.warm.stage("m2.v1"))
    assert env.names() == set() and list(env.warm.staging_dir.iterdir()) == []
    assert env.warm.used_bytes == 0 and not env.warm.downloads


def test_unknown_and_retired_models(tmp_path):
    env = Env(tmp_path)
    with pytest.raises(ModelNotFound, match="registry add"):
        run(env.warm.stage("nope.v1"))
    env.registry.add("m1", 2, env.registry.get("m1", 1).artifact_uri, env.registry.get("m1", 1).sha256,
                     env.size, who="t", stage="production")
    env.registry.promote("m1", 2, "retired", who="t")
    with pytest.raises(InvalidInput, match="retired"):
        run(env.warm.stage("m1.v2"))


def test_local_only_folders_are_served_and_never_evicted(tmp_path):
    env = Env(tmp_path, budget_models=2.5)
    make_folder(env.warm.repository, "handmade")
    env.warm.recover()
    assert env.warm.entries["handmade"].managed is False

    async def go():
        assert await env.warm.stage("handmade") == folder_bytes(env.warm.repository / "handmade")
        await env.warm.stage("m1.v1")
        await env.warm.stage("m2.v1")  # evicts m1, never the local folder

    run(go())
    assert env.names() == {"handmade", "m2.v1"}


def test_recover_removes_partial_downloads_and_broken_folders(tmp_path):
    env = Env(tmp_path, budget_models=None)
    run(env.warm.stage("m1.v1"))
    run(env.warm.stage("m2.v1"))
    run(env.warm.stage("m3.v1"))
    # What a crash can leave: a half-downloaded folder in staging, a half-deleted eviction,
    # a dot-folder in the repository, a folder whose file was truncated, a registered model
    # dropped in by hand without the warm manifest.
    (env.warm.staging_dir / "m4.v1.abc.partial" / "1").mkdir(parents=True)
    (env.warm.staging_dir / "m4.v1.abc.partial" / "1" / "weights.bin").write_bytes(b"half")
    (env.warm.repository / ".m4.v1.tmp").mkdir()
    (env.warm.repository / "m2.v1" / "1" / "weights.bin").write_bytes(b"short")
    (env.warm.repository / "m3.v1" / WARM_MANIFEST).unlink()

    warm = env.new_warm()
    report = warm.recover()
    assert sorted(report["removed_partial"]) == [".m4.v1.tmp", "m4.v1.abc.partial"]
    assert report["warm"] == ["m1.v1"]
    assert len(report["dropped"]) == 2
    assert {p.name for p in warm.repository.iterdir()} == {"m1.v1"}
    assert list(warm.staging_dir.iterdir()) == []
    # Dropped models come back from the cold store on the next stage.
    run(warm.stage("m2.v1"))
    assert folder_sha256(env.cold.path_of(env.cold.default_uri("m2", 1))) == env.registry.get("m2", 1).sha256


def test_recover_keeps_a_loaded_model_even_if_its_check_fails(tmp_path):
    env = Env(tmp_path, budget_models=None)
    run(env.warm.stage("m1.v1"))
    (env.warm.repository / "m1.v1" / WARM_MANIFEST).unlink()
    warm = env.new_warm()
    warm.in_use = lambda name: name == "m1.v1"
    warm.recover()
    assert (warm.repository / "m1.v1").is_dir() and warm.is_warm("m1.v1")


def test_recover_enforces_a_smaller_budget(tmp_path):
    env = Env(tmp_path, budget_models=None)
    for name in ("m1.v1", "m2.v1", "m3.v1"):
        run(env.warm.stage(name))
    warm = env.new_warm(budget=int(env.size * 1.5))
    warm.recover()
    assert len(list(warm.repository.iterdir())) == 1


def test_default_repository_prefers_tmpfs(tmp_path):
    shm = tmp_path / "shm"
    shm.mkdir()
    path = default_warm_repository(tmp_path / "state", shm=shm)
    assert path.parent.parent == shm and path.name == "repository"
    assert default_warm_repository(tmp_path / "state", shm=tmp_path / "absent") == \
        (tmp_path / "state").resolve() / "warm" / "repository"
    huge = default_warm_repository(tmp_path / "state", budget_bytes=1 << 60, shm=shm)
    assert huge == (tmp_path / "state").resolve() / "warm" / "repository"


# --------------------------------------------------------------------------- filesystems
def _repository_on_its_own_mount(monkeypatch, repository: Path):
    """Pretend ``repository`` is a mount point (a docker volume): a rename between it and
    anywhere outside fails with EXDEV, as the kernel does."""
    import errno
    import os

    from control_plane.tiers.warm import location

    def device(path) -> int:
        path = Path(path).resolve()
        return 2 if path == repository or repository in path.parents else 1

    real_rename = os.rename

    def rename(src, dst):
        if device(src) != device(dst):
            raise OSError(errno.EXDEV, "Invalid cross-device link", str(src), None, str(dst))
        real_rename(src, dst)

    monkeypatch.setattr(location, "_device", device)  # where staging_dir_for looks it up
    monkeypatch.setattr(os, "rename", rename)


def test_staging_stays_on_the_repositorys_filesystem_when_it_is_a_mount(tmp_path, monkeypatch):
    env = Env(tmp_path)
    repository = (tmp_path / "volume" / "models").resolve()
    repository.mkdir(parents=True)
    _repository_on_its_own_mount(monkeypatch, repository)
    warm = WarmTier(repository, env.registry, ColdStores([env.cold]))
    assert repository in warm.staging_dir.parents  # same filesystem: the rename cannot EXDEV
    assert not (repository.parent / "models.staging").exists()

    size = run(warm.stage("m1.v1"))  # raised OSError(EXDEV) before: staging sat beside the mount
    assert size == folder_bytes(repository / "m1.v1")
    assert list(warm.staging_dir.iterdir()) == []
    # A restart keeps the staging folder and never mistakes it for a model.
    report = WarmTier(repository, env.registry, ColdStores([env.cold])).recover()
    assert report["warm"] == ["m1.v1"] and report["local"] == [] and report["removed_partial"] == []


def test_a_staging_os_error_backs_off_instead_of_downloading_again(tmp_path, monkeypatch):
    """An OSError while staging (full tmpfs, read-only or cross-device repository) is a
    staging failure: the manager backs off rather than downloading on every request."""
    import errno
    import os

    from control_plane.manager.manager_config import ManagerConfig
    from control_plane.manager.model_manager import ModelManager
    from control_plane.manager.records import ServerSpec
    from control_plane.tiers.warm import tier
    from tests.unit.test_manager_unit import FakeAdmin

    env = Env(tmp_path)
    downloads = []
    real_download = tier.download_verified

    def counting_download(*args, **kwargs):
        downloads.append(args[1])
        return real_download(*args, **kwargs)

    def full_disk(src, dst):
        raise OSError(errno.ENOSPC, "No space left on device", str(dst))

    monkeypatch.setattr(tier, "download_verified", counting_download)  # looked up there
    monkeypatch.setattr(os, "rename", full_disk)

    async def go():
        server = ModelManager.make_server(ServerSpec("s0", "fake:1", "fake:2", max_loaded=2), "lru",
                                          admin=FakeAdmin(["m1.v1"]))
        mgr = ModelManager([server], env.store, config=ManagerConfig(policy="lru"), stager=env.warm)
        await mgr.start()
        with pytest.raises(ModelLoadFailed, match="No space left on device"):
            await mgr.ensure("m1.v1")
        with pytest.raises(ModelLoadFailed, match="not retrying"):
            await mgr.ensure("m1.v1")
        await mgr.close()

    run(go())
    assert len(downloads) == 1
    assert "m1.v1" not in env.warm.entries and list(env.warm.staging_dir.iterdir()) == []


# --------------------------------------------------------------------------- clean-up
def test_only_the_default_tmpfs_warm_tier_is_ever_removed(tmp_path):
    from control_plane.tiers.warm import remove_tmpfs_warm_tier, tmpfs_warm_root

    shm, state = tmp_path / "shm", tmp_path / "state"
    shm.mkdir()
    users = tmp_path / "my-models"
    (users / "m1").mkdir(parents=True)
    assert not remove_tmpfs_warm_tier(state, users, shm=shm)  # a --repository: never touched
    assert (users / "m1").is_dir()

    repository = default_warm_repository(state, shm=shm)
    warm = WarmTier(repository)
    (repository / "m1" / "1").mkdir(parents=True)
    assert warm.staging_dir.parent == repository.parent == tmpfs_warm_root(state, shm)
    assert remove_tmpfs_warm_tier(state, repository, shm=shm)
    assert not tmpfs_warm_root(state, shm).exists() and list(shm.iterdir()) == []


def test_make_clean_warm_removes_the_leftover_of_that_state_dir_only(tmp_path):
    import shutil
    import subprocess

    if shutil.which("make") is None:
        pytest.skip("no make")
    repository = default_warm_repository(tmp_path / "state")
    other = default_warm_repository(tmp_path / "other-state")
    if not str(repository).startswith("/dev/shm/"):
        pytest.skip("no writable /dev/shm")
    try:
        for repo in (repository, other):
            (repo / "m1" / "1").mkdir(parents=True)
        root = Path(__file__).resolve().parents[2]
        subprocess.run(["make", "-s", "-C", str(root), "clean-warm", f"STATE_DIR={tmp_path / 'state'}"],
                       check=True, capture_output=True, timeout=30)
        assert not repository.parent.exists()  # a crash's leftover, gone
        assert (other / "m1").is_dir()  # another state directory's warm tier is not ours
    finally:
        shutil.rmtree(repository.parent, ignore_errors=True)
        shutil.rmtree(other.parent, ignore_errors=True)


# --------------------------------------------------------------------------- event loop
def test_evictions_and_size_walks_run_off_the_event_loop(tmp_path, monkeypatch):
    """Deleting an evicted model (~0.2 s for 400 MB in tmpfs) and walking a folder's files
    must not stall the loop that serves requests."""
    import shutil
    import threading

    from control_plane.tiers.warm import tier

    env = Env(tmp_path, budget_models=2.5)
    make_folder(env.warm.repository.parent / "src", "handmade")
    shutil.move(str(env.warm.repository.parent / "src" / "handmade"), str(env.warm.repository / "handmade"))
    calls: list[tuple[str, bool]] = []
    real_rmtree, real_folder_bytes = shutil.rmtree, tier.folder_bytes

    def on_loop_thread() -> bool:
        try:
            asyncio.get_running_loop()
            return True
        except RuntimeError:
            return False

    def rmtree(path, *args, **kwargs):
        calls.append(("rmtree", on_loop_thread()))
        return real_rmtree(path, *args, **kwargs)

    def folder_bytes_(root):
        calls.append(("folder_bytes", on_loop_thread()))
        return real_folder_bytes(root)

    monkeypatch.setattr(tier.shutil, "rmtree", rmtree)
    monkeypatch.setattr(tier, "folder_bytes", folder_bytes_)  # where WarmTier looks it up

    async def go():
        loop_thread = threading.current_thread()
        await env.warm.stage("m1.v1")
        await env.warm.stage("m2.v1")
        await env.warm.stage("m3.v1")  # evicts m1
        env.warm.evict("m2.v1")  # an operator's eviction, from an admin handler on the loop
        await env.warm.stage("handmade")  # a repository folder: its size is a file walk
        await env.warm.deletions_done()
        assert threading.current_thread() is loop_thread

    run(go())
    assert ("rmtree", False) in calls and ("folder_bytes", False) in calls
    assert [c for c in calls if c[1]] == [], calls  # nothing blocking ran on the loop thread
    assert env.names() == {"m3.v1", "handmade"}
    assert [p for p in env.warm.staging_dir.iterdir()] == []  # every evicted folder deleted
