"""Cold -> warm -> hot with real servers: an S3-compatible server (moto) through boto3, real
tritonserver processes loading from the warm tier, MIG stand-ins for placement, and a
crash in the middle of a download."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import boto3
import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from control_plane.demo.fleet import FleetSpec, base_weights, customer_weights, write_model
from control_plane.manager.manager_config import ManagerConfig
from control_plane.manager.model_manager import ModelManager
from control_plane.manager.placement import Placer, ServerLabels, registry_facts
from control_plane.manager.records import ModelState, ServerSpec
from control_plane.registry import Registry
from control_plane.state.state_store import StateStore
from control_plane.tiers.cold import ColdStores, LocalDirStore, S3Config, S3Store, publish
from control_plane.tiers.warm import WarmTier
from control_plane.triton.process import TritonLaunchConfig, TritonProcess, free_port
from domain.errors import CapacityExhausted, ModelLoadFailed
from tests.conftest import pid_alive, run, triton_log_count

pytestmark = pytest.mark.integration

BUCKET = "models"


@pytest.fixture(scope="module")
def s3_server():
    from moto.server import ThreadedMotoServer

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    config = S3Config(bucket=BUCKET, prefix="fleet", endpoint_url=f"http://127.0.0.1:{port}",
                      region="us-east-1", access_key_id="testing", secret_access_key="testing",
                      addressing_style="path")
    boto3.client("s3", endpoint_url=config.endpoint_url, region_name="us-east-1",
                 aws_access_key_id="testing", aws_secret_access_key="testing").create_bucket(Bucket=BUCKET)
    yield config
    server.stop()


class Tiers:
    """State store + registry + cold stores + warm tier + Triton(s) + manager for one test."""

    def __init__(self, tmp_path: Path, stores: ColdStores, warm_budget_bytes=None):
        self.tmp = tmp_path
        self.store = StateStore(tmp_path / "state" / "state.db")
        self.stores = stores
        self.registry = Registry(self.store.db, stores=stores)
        self.warm = WarmTier(tmp_path / "shm" / "repository", self.registry, stores,
                             budget_bytes=warm_budget_bytes)
        self.warm.recover()
        self.tritons: list[TritonProcess] = []
        self.manager: ModelManager | None = None

    def start_triton(self) -> TritonProcess:
        proc = TritonProcess(TritonLaunchConfig(repository=self.warm.repository,
                                                work_dir=self.tmp / f"triton{len(self.tritons)}"))
        proc.start()
        self.tritons.append(proc)
        return proc

    def make_manager(self, servers: list[tuple[str, int | None, int | None]], labels=None) -> ModelManager:
        built = []
        for (name, budget, slots), proc in zip(servers, self.tritons):
            spec = ServerSpec(name, proc.grpc_url, proc.http_url, proc.metrics_url, device=name,
                              memory_budget_bytes=budget, max_loaded=slots)
            built.append(ModelManager.make_server(spec, "lru"))
        self.manager = ModelManager(
            built, self.store, repository=self.warm.repository, config=ManagerConfig(policy="lru"),
            stager=self.warm, priority_of=self.registry.stage_priority,
            placer=Placer(facts=registry_facts(self.registry), labels=labels or {}))
        mgr = self.manager
        self.warm.in_use = lambda n: n in mgr.records and mgr.records[n].server is not None
        return self.manager

    def close(self):
        for proc in self.tritons:
            proc.stop()
            assert not proc.alive(), "tritonserver was left running"
        self.store.close()


@pytest.fixture
def tiers_factory(tmp_path):
    made: list[Tiers] = []

    def make(stores, **kw) -> Tiers:
        t = Tiers(tmp_path, stores, **kw)
        made.append(t)
        return t

    yield make
    for t in made:
        t.close()


def infer(url: str, model: str) -> np.ndarray:
    client = grpcclient.InferenceServerClient(url)
    x = grpcclient.InferInput("FEATURES", [2, 64], "FP32")
    x.set_data_from_numpy(np.ones((2, 64), np.float32))
    return client.infer(model, [x]).as_numpy("SCORES")


def s3_objects(config: S3Config, prefix: str) -> dict[str, int]:
    client = S3Store(config).client
    resp = client.list_objects_v2(Bucket=BUCKET, Prefix=prefix)
    return {o["Key"]: o["Size"] for o in resp.get("Contents", [])}


def test_cold_to_warm_to_hot_through_s3(s3_server, fleet_template, tiers_factory):
    s3 = S3Store(s3_server)
    t = tiers_factory(ColdStores([s3]))
    info = publish(s3, fleet_template / "cust001", s3.default_uri("cust001", 1))
    assert info.uri == f"s3://{BUCKET}/fleet/cust001/1/"
    assert "fleet/cust001/1/mms-manifest.json" in s3_objects(s3_server, "fleet/cust001/")
    t.registry.add("cust001", 1, info.uri, info.sha256, info.size_bytes, who="alice",
                   stage="production", metrics={"auc": 0.78})
    assert t.warm.tier_of("cust001.v1") == "cold"
    triton = t.start_triton()
    mgr = t.make_manager([("triton0", None, 4)])

    async def scenario():
        await mgr.start()
        rec = await mgr.ensure("cust001.v1")
        assert rec.state == ModelState.READY and rec.memory_bytes == t.warm.entries["cust001.v1"].size_bytes
        scores = await asyncio.to_thread(infer, triton.grpc_url, "cust001.v1")
        assert scores.shape == (2, 1)
        locate = t.warm.locator(mgr)
        assert locate("cust001.v1")["tier"] == "hot"
        assert t.warm.busy == {"cust001.v1"}
        await mgr.unload("cust001.v1")  # GPU -> warm: the artifacts stay
        assert locate("cust001.v1")["tier"] == "warm" and t.warm.busy == set()
        await mgr.ensure("cust001.v1")  # warm hit: no second download
        await mgr.close()

    run(scenario())
    assert triton_log_count(triton, "successfully loaded 'cust001.v1'") == 2


def test_corrupted_object_is_detected_and_never_loaded(s3_server, fleet_template, tiers_factory):
    s3 = S3Store(s3_server)
    t = tiers_factory(ColdStores([s3]))
    info = publish(s3, fleet_template / "cust002", s3.default_uri("cust002", 1))
    t.registry.add("cust002", 1, info.uri, info.sha256, info.size_bytes, who="alice")
    key = "fleet/cust002/1/1/weights.safetensors"
    body = s3.client.get_object(Bucket=BUCKET, Key=key)["Body"].read()
    s3.client.put_object(Bucket=BUCKET, Key=key, Body=body[:-8] + b"\0" * 8)  # same size, bit rot
    triton = t.start_triton()
    mgr = t.make_manager([("triton0", None, 4)])

    async def scenario():
        await mgr.start()
        with pytest.raises(ModelLoadFailed) as err:
            await mgr.ensure("cust002.v1")
        msg = str(err.value)
        assert "failed verification after 2 attempts" in msg and "1/weights.safetensors has sha256" in msg
        assert mgr.get("cust002.v1").state != ModelState.READY
        assert t.warm.busy == set() and t.warm.used_bytes == 0
        await mgr.close()

    run(scenario())
    assert not (t.warm.repository / "cust002.v1").exists()
    assert list(t.warm.staging_dir.iterdir()) == []
    assert triton_log_count(triton, "cust002") == 0  # Triton never saw it


def test_warm_budget_evicts_lru_model_that_is_not_loaded(s3_server, fleet_template, tiers_factory):
    s3 = S3Store(s3_server)
    sizes = {}
    stores = ColdStores([s3])
    for name in ("cust003", "cust004", "cust005"):
        info = publish(s3, fleet_template / name, s3.default_uri(name, 1))
        sizes[name] = info.size_bytes
    t = tiers_factory(stores, warm_budget_bytes=int(max(sizes.values()) * 2.5))
    for name in sizes:
        info = publish(s3, fleet_template / name, s3.default_uri(name, 1))
        t.registry.add(name, 1, info.uri, info.sha256, info.size_bytes, who="alice")
    triton = t.start_triton()
    mgr = t.make_manager([("triton0", None, 4)])

    async def scenario():
        await mgr.start()
        await mgr.ensure("cust003.v1")  # stays loaded: oldest in warm, but busy
        await mgr.ensure("cust004.v1")
        await mgr.unload("cust004.v1")  # warm only now
        await mgr.ensure("cust005.v1")  # warm is full: cust004 goes, not the loaded cust003
        assert set(t.warm.entries) == {"cust003.v1", "cust005.v1"}
        assert await asyncio.to_thread(infer, triton.grpc_url, "cust003.v1") is not None
        await mgr.ensure("cust004.v1")  # comes back from the cold store; nothing is evictable
        await mgr.close()

    with pytest.raises(CapacityExhausted, match="loaded or loading"):
        run(scenario())
    assert set(t.warm.entries) == {"cust003.v1", "cust005.v1"}


def _write_sized(root: Path, name: str, hidden_dim: int, layers: int = 2) -> Path:
    spec = FleetSpec(count=1, hidden_dim=hidden_dim, hidden_layers=layers)
    return write_model(root, name, spec, customer_weights(spec, name, base_weights(spec)))


def test_placement_across_mig_standins(fleet_template, tiers_factory, tmp_path):
    """Two Tritons stand in for MIG slices: a small isolated one reserved for gold, a large
    shared one.  Budgets are bytes of artifacts (CPU)."""
    cold = LocalDirStore(tmp_path / "cold")
    t = tiers_factory(ColdStores([cold]))
    src = tmp_path / "src"
    folders = {"small": fleet_template / "cust006", "big": _write_sized(src, "big", 256),
               "vip": fleet_template / "cust007", "huge": _write_sized(src, "huge", 700)}
    size = {}
    for model, folder in folders.items():
        info = publish(cold, folder, cold.default_uri(model, 1))
        size[model] = info.size_bytes
        t.registry.add(model, 1, info.uri, info.sha256, info.size_bytes, who="alice",
                       sla="gold" if model == "vip" else "silver")
    assert size["small"] < size["big"] < size["huge"]
    small_budget = int(size["small"] * 1.5)
    large_budget = int(size["big"] * 3)
    assert size["huge"] > large_budget
    t.start_triton()
    t.start_triton()
    labels = {"slice-small": ServerLabels(isolated=True, reserved_for_sla="gold")}
    mgr = t.make_manager([("slice-small", small_budget, None), ("slice-large", large_budget, None)], labels)

    async def scenario():
        await mgr.start()
        assert (await mgr.ensure("big.v1")).server == "slice-large"  # only the large one fits
        assert (await mgr.ensure("vip.v1")).server == "slice-small"  # gold -> isolated slice
        assert (await mgr.ensure("small.v1")).server == "slice-large"  # silver: not the gold slice
        with pytest.raises(CapacityExhausted) as err:
            await mgr.ensure("huge.v1")
        msg = str(err.value)
        assert "fits on no device" in msg and "slice-large" in msg and str(large_budget) in msg
        assert mgr.get("huge.v1").state != ModelState.READY
        await mgr.close()

    run(scenario())
    for proc in t.tritons:
        assert triton_log_count(proc, "huge") == 0


CRASHING_STAGER = textwrap.dedent("""
    import os, signal, sys, asyncio
    from pathlib import Path
    from control_plane.tiers.cold import ColdStores, S3Config, S3Store
    from control_plane.registry import Registry
    from control_plane.state.state_store import StateStore
    from control_plane.tiers.warm import WarmTier, tier

    state, repo, endpoint = sys.argv[1:4]
    s3 = S3Store(S3Config(bucket="models", endpoint_url=endpoint, access_key_id="testing",
                          secret_access_key="testing", addressing_style="path"))
    store = StateStore(Path(state))
    warm = WarmTier(Path(repo), Registry(store.db), ColdStores([s3]))

    real = tier.download_verified
    def dying(store, uri, sha, staging, label, progress=None, attempts=2):
        def progress_then_die(done, total):
            if done > 0 and done < total:
                print("dying at", done, "of", total, flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
        return real(store, uri, sha, staging, label, progress_then_die, attempts)
    tier.download_verified = dying  # where WarmTier looks it up
    asyncio.run(warm.stage("bulky.v1"))
""")


def test_crash_during_download_leaves_no_partial_artifact(s3_server, tiers_factory, tmp_path):
    s3 = S3Store(s3_server)
    t = tiers_factory(ColdStores([s3]))
    folder = _write_sized(tmp_path / "src", "bulky", 600)  # a few MB: many 1 MiB chunks
    info = publish(s3, folder, s3.default_uri("bulky", 1))
    t.registry.add("bulky", 1, info.uri, info.sha256, info.size_bytes, who="alice")
    child = subprocess.run(
        [sys.executable, "-c", CRASHING_STAGER, str(t.store.path), str(t.warm.repository),
         s3_server.endpoint_url], capture_output=True, text=True, timeout=60, check=False,
        cwd=Path(__file__).resolve().parents[2], env=dict(os.environ))
    assert child.returncode == -signal.SIGKILL, child.stderr
    assert "dying at" in child.stdout
    leftovers = list(t.warm.staging_dir.iterdir())
    assert leftovers and leftovers[0].name.endswith(".partial")  # the crash left debris...
    assert not (t.warm.repository / "bulky.v1").exists()  # ...but never in Triton's view

    warm = WarmTier(t.warm.repository, t.registry, ColdStores([s3]))  # the restart
    report = warm.recover()
    assert report["removed_partial"] == [leftovers[0].name]
    assert list(warm.staging_dir.iterdir()) == []
    assert run(warm.stage("bulky.v1")) == warm.entries["bulky.v1"].size_bytes
    assert warm.recover()["warm"] == ["bulky.v1"]  # a complete folder passes the check


def test_crash_during_load_then_restart_reconciles(s3_server, tiers_factory, tmp_path):
    """SIGKILL the control plane while it loads a pinned model (during its warm-up): its
    Triton dies with it; a restart on the same state and warm directory keeps the pin, finds
    no partial artifacts and loads the model again."""
    s3 = S3Store(s3_server)
    t = tiers_factory(ColdStores([s3]))
    slow = FleetSpec(count=1, hidden_dim=32, hidden_layers=1, extra_parameters=(("execute_delay_s", "2"),))
    folder = write_model(tmp_path / "src", "pinme", slow, customer_weights(slow, "pinme", base_weights(slow)))
    info = publish(s3, folder, s3.default_uri("pinme", 1))
    t.registry.add("pinme", 1, info.uri, info.sha256, info.size_bytes, who="alice")
    t.store.set_pin("pinme.v1", True)
    child = subprocess.Popen(
        [sys.executable, "-c", CONTROL_PLANE, str(t.store.path), str(t.warm.repository),
         s3_server.endpoint_url, str(tmp_path / "crashed")],
        stdout=subprocess.PIPE, text=True, cwd=Path(__file__).resolve().parents[2])
    try:
        triton_pid = int(child.stdout.readline().split()[1])
        log_path = next((tmp_path / "crashed").glob("tritonserver-*.log"))
        deadline = time.monotonic() + 30
        while (triton_log_count_path(log_path, "successfully loaded 'pinme.v1'") == 0
               and time.monotonic() < deadline):
            time.sleep(0.05)  # Triton loaded it; the control plane is in the warm-up now
        assert time.monotonic() < deadline, log_path.read_text(errors="replace")
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=10)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(timeout=10)
        child.stdout.close()
    deadline = time.monotonic() + 20
    while pid_alive(triton_pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not pid_alive(triton_pid), "Triton outlived the crashed control plane"

    # Restart: a fresh Triton on the same warm directory and the same state.
    assert t.warm.recover()["warm"] == ["pinme.v1"]
    triton = t.start_triton()
    mgr = t.make_manager([("triton0", None, 4)])

    async def scenario():
        await mgr.start()  # reconcile + load the pinned models
        rec = mgr.get("pinme.v1")
        assert rec.pinned and rec.state == ModelState.READY
        await mgr.close()

    run(scenario())
    assert t.store.pins() == {"pinme.v1"}
    assert triton_log_count(triton, "successfully loaded 'pinme.v1'") == 1


def triton_log_count_path(path: Path, needle: str) -> int:
    return path.read_text(errors="replace").count(needle)


CONTROL_PLANE = textwrap.dedent("""
    import asyncio, sys
    from pathlib import Path
    from control_plane.tiers.cold import ColdStores, S3Config, S3Store
    from control_plane.manager.model_manager import ModelManager
    from control_plane.manager.records import ServerSpec
    from control_plane.registry import Registry
    from control_plane.state.state_store import StateStore
    from control_plane.triton.process import TritonLaunchConfig, TritonProcess
    from control_plane.tiers.warm import WarmTier

    state, repo, endpoint, work = sys.argv[1:5]
    s3 = S3Store(S3Config(bucket="models", endpoint_url=endpoint, access_key_id="testing",
                          secret_access_key="testing", addressing_style="path"))
    store = StateStore(Path(state))
    registry = Registry(store.db)
    warm = WarmTier(Path(repo), registry, ColdStores([s3]))
    warm.recover()
    proc = TritonProcess(TritonLaunchConfig(repository=Path(repo), work_dir=Path(work)))
    proc.start()
    print("triton", proc.proc.pid, flush=True)
    spec = ServerSpec("triton0", proc.grpc_url, proc.http_url, proc.metrics_url)
    mgr = ModelManager([ModelManager.make_server(spec, "lru", process=proc)], store,
                       repository=warm.repository, stager=warm, priority_of=registry.stage_priority)
    asyncio.run(mgr.start())
    proc.stop()
""")
