"""Model families on a real tritonserver: the model manager decides which variants hold the
family model's slots (LRU, pins, the budget), and a variant's miss is a copy into a slot."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import tritonclient.grpc as grpcclient
from safetensors.torch import save_file
from tritonclient.utils import InferenceServerException

from control_plane.families import FamilyCatalog, family_slots, write_family, write_variant
from control_plane.families.slot_control import FamilyAdmin
from control_plane.manager.manager_config import ManagerConfig
from control_plane.manager.model_manager import ModelManager
from control_plane.manager.records import ServerSpec
from control_plane.state.state_store import StateStore
from control_plane.triton.process import TritonLaunchConfig, TritonProcess
from domain.errors import ControlPlaneError
from tests.conftest import pid_alive, run, triton_log_count

pytestmark = pytest.mark.integration

SCALER = Path(__file__).resolve().parents[1] / "fixtures" / "families" / "scaler"
VARIANTS = {"acme": (2.0, 1.0), "globex": (3.0, -1.0), "initech": (-1.0, 0.5), "umbrella": (0.5, 4.0)}


def scaler_weights(scale: float, shift: float) -> dict[str, torch.Tensor]:
    return {"scale": torch.full((4,), scale), "shift": torch.full((4,), shift)}


def scaler_family(root: Path) -> Path:
    """A repository under ``root`` holding the scaler family (base weights: scale 1, shift 0)."""
    repo = root / "repo"
    repo.mkdir()
    base = root / "base.safetensors"
    save_file(scaler_weights(1.0, 0.0), str(base))
    write_family(repo, "scaler", config_text=(SCALER / "config.pbtxt").read_text(),
                 version_files=SCALER / "1", base_weights=base)
    return repo


@pytest.fixture
def repository(tmp_path) -> Path:
    """Triton's repository for these tests (conftest's ``triton`` serves it): the scaler
    family and its variants."""
    repo = scaler_family(tmp_path)
    for name, (scale, shift) in VARIANTS.items():
        write_variant(repo, name, "scaler", scaler_weights(scale, shift))
    return repo


def pgrep(triton, pattern: str) -> list[str]:
    """Processes of ``triton``'s process group (its python stubs) whose command line matches:
    another test's Triton, running beside this one, is never touched."""
    return pgrep_group(triton.pid, pattern)


def pgrep_group(group: int, pattern: str | None = None) -> list[str]:
    """Processes of the process group ``group`` (whose command line matches ``pattern``)."""
    return subprocess.run(["pgrep", "-g", str(group), *(["-f", pattern] if pattern else [])],
                          capture_output=True, text=True, check=False).stdout.split()


def make_manager(triton, repo, tmp_path, max_loaded):
    catalog = FamilyCatalog(repo)
    spec = ServerSpec("triton0", triton.grpc_url, triton.http_url, max_loaded=max_loaded)
    admin = FamilyAdmin(triton.grpc_url, catalog,
                        lambda f: family_slots(f, max_loaded, None, len(catalog.variants(f.name))))
    server = ModelManager.make_server(spec, "lru", admin=admin)
    store = StateStore(tmp_path / "state.db")
    return ModelManager([server], store, repository=repo, config=ManagerConfig(policy="lru"))


def infer(url: str, variant: str, x: np.ndarray | None = None) -> np.ndarray:
    client = grpcclient.InferenceServerClient(url)
    x = np.arange(8, dtype=np.float32).reshape(2, 4) if x is None else x
    inp = grpcclient.InferInput("INPUT0", list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    return client.infer("scaler", [inp], parameters={"mms_variant": variant}).as_numpy("OUTPUT0")


def expected(variant: str, x: np.ndarray | None = None) -> np.ndarray:
    x = np.arange(8, dtype=np.float32).reshape(2, 4) if x is None else x
    scale, shift = VARIANTS[variant]
    return x * scale + shift


def family_requests(triton) -> int:
    """Requests the scaler family model has answered, by Triton's own statistics (control
    requests included: each is an inference of the family model)."""
    stats = grpcclient.InferenceServerClient(triton.grpc_url).get_inference_statistics(
        "scaler", as_json=True)["model_stats"][0]
    return int(stats["inference_stats"].get("success", {}).get("count", 0) or 0)


def wait_for_family_requests(triton, at_least: int, settle_s: float = 0.3) -> int:
    """The family's request count once it reached ``at_least`` (Triton's statistics may lag
    an answer by a moment) and ``settle_s`` later, so that a second request shows too."""
    deadline = time.monotonic() + 10
    while family_requests(triton) < at_least and time.monotonic() < deadline:
        time.sleep(0.02)
    time.sleep(settle_s)
    return family_requests(triton)


def ready(mgr: ModelManager) -> set[str]:
    return {m["model"] for m in mgr.status() if m["state"] == "ready"}


def test_variants_take_slots_by_lru_and_pins_and_each_answers_with_its_own_weights(
        triton, repository, tmp_path):
    async def scenario():
        mgr = make_manager(triton, repository, tmp_path, max_loaded=2)
        await mgr.start()
        for name in ("acme", "globex"):
            await mgr.ensure(name)
        assert ready(mgr) == {"acme", "globex"}
        await mgr.pin("globex")
        mgr.touch("acme")
        loads_before = triton_log_count(triton, "successfully loaded")
        admin = mgr.servers["triton0"].admin
        statistics_calls = []
        real_statistics = admin.statistics

        async def counted_statistics():
            statistics_calls.append(time.monotonic())
            return await real_statistics()

        admin.statistics = counted_statistics
        commands = []
        real_control = admin.control

        async def counted_control(family, command):
            commands.append((command["op"], command.get("variant"), command.get("evict")))
            return await real_control(family, command)

        admin.control = counted_control
        requests_before = family_requests(triton)
        await mgr.ensure("initech")  # evicts acme: globex is pinned
        # One control command freed acme's slot and copied initech in, over the family
        # process's control socket (no request queued in Triton), and the miss asked Triton
        # for no statistics (recency comes from requests and the reconcile pass).
        assert commands == [("load", "initech", ["acme"])]
        assert wait_for_family_requests(triton, requests_before, settle_s=0.3) == requests_before
        assert statistics_calls == []
        admin.control = real_control
        # A copy into acme's slot: Triton loaded nothing (no new process, no model load).
        assert triton_log_count(triton, "successfully loaded") == loads_before
        assert ready(mgr) == {"globex", "initech"}
        index = await mgr.servers["triton0"].admin.index()
        assert {n for n, e in index.items() if e.state.value == "READY"} == {"globex", "initech"}
        for name in ("globex", "initech"):
            np.testing.assert_allclose(infer(triton.grpc_url, name), expected(name))
        with pytest.raises(Exception, match="is not loaded"):
            infer(triton.grpc_url, "acme")  # evicted: Triton's unknown-model answer
        for name in ("umbrella", "acme", "initech"):  # thrash the unpinned slot
            await mgr.ensure(name)
            np.testing.assert_allclose(infer(triton.grpc_url, name), expected(name))
            assert "globex" in ready(mgr)
        assert triton_log_count(triton, "successfully loaded") == loads_before
        await mgr.close()

    run(scenario())


def test_every_slot_pinned_is_a_clear_error_and_nothing_is_counted(triton, repository, tmp_path):
    from domain.errors import CapacityExhausted

    async def scenario():
        mgr = make_manager(triton, repository, tmp_path, max_loaded=2)
        await mgr.start()
        await mgr.pin("acme")
        await mgr.pin("globex")
        with pytest.raises(CapacityExhausted, match="pinned"):
            await mgr.ensure("initech")
        assert ready(mgr) == {"acme", "globex"}
        np.testing.assert_allclose(infer(triton.grpc_url, "acme"), expected("acme"))
        await mgr.close()

    run(scenario())


def test_a_fill_runs_beside_a_batch_and_never_rewrites_the_slot_it_reads(repository, tmp_path):
    """Two slots; a slow batch (1.5 s) for acme runs.  Globex's fill into the free slot does
    not wait for it.  Initech then takes acme's slot: its fill waits until the batch reading
    that slot is done, so the batch answers with acme's weights, the next request with
    initech's."""
    config = repository / "scaler" / "config.pbtxt"
    config.write_text(config.read_text().replace('string_value: "0"', 'string_value: "1.5"'))
    proc = TritonProcess(TritonLaunchConfig(repository=repository, work_dir=tmp_path / "triton"))
    proc.start()
    try:
        async def scenario():
            mgr = make_manager(proc, repository, tmp_path, max_loaded=2)
            await mgr.start()
            await mgr.ensure("acme")
            results: dict[str, np.ndarray] = {}
            slow = threading.Thread(target=lambda: results.setdefault("acme", infer(proc.grpc_url, "acme")))
            slow.start()
            await asyncio.sleep(0.3)  # the batch is running
            await mgr.ensure("globex")  # the free slot: beside the batch, not after it
            assert slow.is_alive(), "globex's fill waited for the running batch"
            await mgr.ensure("initech")  # takes acme's slot, once the batch reading it is done
            await asyncio.to_thread(slow.join)
            np.testing.assert_allclose(results["acme"], expected("acme"))
            for name in ("globex", "initech"):
                np.testing.assert_allclose(infer(proc.grpc_url, name), expected(name))
            assert ready(mgr) == {"globex", "initech"}
            await mgr.close()

        run(scenario())
    finally:
        proc.stop()


async def crash_the_family_and_serve_again(triton, repository, tmp_path) -> None:
    """Serve acme, SIGKILL the family's python stub, and serve acme again (its family loaded
    anew by the reconcile)."""
    mgr = make_manager(triton, repository, tmp_path, max_loaded=2)
    await mgr.start()
    await mgr.ensure("acme")
    stub = pgrep(triton, "triton_python_backend_stub.*scaler")
    assert stub, "the family's stub process was not found"
    for pid in stub:
        os.kill(int(pid), signal.SIGKILL)
    # Requests in flight or sent now fail with an error, never another variant's answer.
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        await mgr.step()  # the reconcile reads the family's slots again
        try:
            await mgr.ensure("acme")
            got = infer(triton.grpc_url, "acme")
        except (ControlPlaneError, InferenceServerException):
            await asyncio.sleep(0.5)
            continue
        np.testing.assert_allclose(got, expected("acme"))
        break
    else:
        pytest.fail("acme was not served again within 60s of its family process crashing")
    await mgr.close()


def assert_stops_without_its_exit_timeout(triton: TritonProcess, caplog) -> None:
    """Triton keeps the instance of a python-backend process that died live and never
    finishes unloading it: a stop once waited out Triton's whole exit timeout (10 s) for it.
    Every model unloaded, the stop ends Triton after a few seconds, its stubs with it."""
    server_pid = triton.pid
    started = time.monotonic()
    with caplog.at_level("INFO", logger="control_plane.triton.process"):
        triton.stop()
    took_s = time.monotonic() - started
    assert not triton.alive()
    assert "unloaded every model but had not exited" in caplog.text
    assert took_s < 10.0, f"the stop took {took_s:.1f}s: it waited out Triton's exit timeout"
    # (the stub the test killed stays a zombie: Triton never reaped it, nothing to end)
    left = [pid for pid in pgrep_group(server_pid) if pid_alive(int(pid))]
    assert left == [], f"processes of the stopped Triton left running: {left}"


def test_a_crashed_family_process_comes_back_and_its_variants_are_loaded_again(
        triton, repository, tmp_path, caplog):
    run(crash_the_family_and_serve_again(triton, repository, tmp_path))
    assert_stops_without_its_exit_timeout(triton, caplog)


def test_an_adopted_triton_stops_as_quickly_after_a_family_crash(repository, tmp_path, caplog):
    """A supervised Triton outlives its control plane and the next one adopts it: that
    control plane's stop unloads, signals and ends it like one it launched (it once sent
    SIGTERM alone and waited out Triton's exit timeout)."""
    def supervised() -> TritonLaunchConfig:
        return TritonLaunchConfig(repository=repository, work_dir=tmp_path / "triton",
                                  pid_file=tmp_path / "triton.pid", outlive_parent=True)

    first_life = TritonProcess(supervised())
    first_life.start()
    adopted = TritonProcess(supervised())
    try:
        adopted.start()
        assert adopted.adopted is not None and adopted.pid == first_life.pid
        run(crash_the_family_and_serve_again(adopted, repository, tmp_path))
        assert_stops_without_its_exit_timeout(adopted, caplog)
        assert adopted.adopted is None and not (tmp_path / "triton.pid").exists()
    finally:
        adopted.stop()
        first_life.stop()  # reaps the process its second life ended
    assert not first_life.alive()


def test_a_family_grown_for_new_variants_answers_from_its_new_process(triton, repository, tmp_path):
    """Variants registered after the family loaded: when its slots are full the family is
    loaded again with more, the variants it held are copied into the new process, and every
    command after that reaches the new process (never the one Triton replaced)."""
    async def scenario():
        # No limit: the family is loaded with a slot per variant known and half again.
        mgr = make_manager(triton, repository, tmp_path, max_loaded=None)
        await mgr.start()
        for name in VARIANTS:
            await mgr.ensure(name)
        admin = mgr.servers["triton0"].admin
        first = admin.family_slots("scaler")
        first_process = admin.instance("scaler").instance_id
        extra = {f"newco{i}": (float(i), -float(i)) for i in range(1, 5)}
        for name, (scale, shift) in extra.items():
            write_variant(repository, name, "scaler", scaler_weights(scale, shift))
        VARIANTS.update(extra)
        admin.families.refresh()  # what registering them does (mmctl registry add)
        try:
            for name in extra:
                await mgr.ensure(name)
            grown = admin.family_slots("scaler")
            assert grown["slots"] > first["slots"] == 6
            assert ready(mgr) == set(VARIANTS)
            status = await admin.control(admin.families.family("scaler"), {"op": "status"})
            assert status["instance"] != first_process
            assert admin.control_sockets.name_of("scaler") == status["control_socket"]
            assert status["control_socket"].endswith(status["instance"])
            for name in VARIANTS:
                np.testing.assert_allclose(infer(triton.grpc_url, name), expected(name))
        finally:
            for name in extra:
                VARIANTS.pop(name)
        await mgr.close()

    run(scenario())


def test_one_cache_holds_a_family_and_a_model_on_a_real_triton(triton, repository, tmp_path):
    """A server's room is one cache: the family costs the slots its variants fill (32 B
    each), so a separate model loads beside a variant; a second variant evicts the least
    recently used entry, a variant or the model alike; once no variant is left the family
    model is unloaded from Triton.  Every answer is the variant's own weights'."""
    import shutil

    shutil.copytree(SCALER.parents[1] / "models" / "simple", repository / "simple")
    (repository / "simple" / "padding.bin").write_bytes(b"\0" * 100_000)
    model_bytes = sum(p.stat().st_size for p in (repository / "simple").rglob("*") if p.is_file())
    budget = model_bytes + 40  # the model and one slot's bytes fit; not two slots beside it

    async def scenario():
        catalog = FamilyCatalog(repository)
        spec = ServerSpec("triton0", triton.grpc_url, triton.http_url, memory_budget_bytes=budget)
        admin = FamilyAdmin(triton.grpc_url, catalog, lambda f: family_slots(
            f, None, budget, len(catalog.variants(f.name))))
        server = ModelManager.make_server(spec, "lru", admin=admin)
        mgr = ModelManager([server], StateStore(tmp_path / "state.db"), repository=repository,
                           config=ManagerConfig(policy="lru", headroom_models=0))
        await mgr.start()
        await mgr.ensure("acme")
        assert mgr.fleet()[0]["used_bytes"] == 32, "one variant: one slot's bytes"
        await mgr.ensure("simple")  # beside the family, nothing evicted
        assert ready(mgr) == {"acme", "simple"}
        assert mgr.fleet()[0]["used_bytes"] == model_bytes + 32
        np.testing.assert_allclose(infer(triton.grpc_url, "acme"), expected("acme"))
        mgr.touch("simple")
        await mgr.ensure("globex")  # acme is the least recently used: its slot is globex's
        assert ready(mgr) == {"simple", "globex"}
        np.testing.assert_allclose(infer(triton.grpc_url, "globex"), expected("globex"))
        mgr.touch("globex")
        await mgr.ensure("acme")  # the model is the least recently used now: it leaves
        assert ready(mgr) == {"globex", "acme"}
        assert (await admin.triton_index())["simple"].state.value != "READY"
        for name in ("acme", "globex"):
            np.testing.assert_allclose(infer(triton.grpc_url, name), expected(name))
        assert mgr.fleet()[0]["slot_pools"]["scaler"]["members"] == 2
        await mgr.unload("acme")
        await mgr.unload("globex")
        await mgr.step()  # no variant left: the family model goes from Triton
        deadline = time.monotonic() + 30
        while mgr.fleet()[0]["slot_pools"]:  # counted until Triton confirms it unloaded
            assert time.monotonic() < deadline, "the empty family stayed loaded"
            await asyncio.sleep(0.1)
        assert (await admin.triton_index())["scaler"].state.value != "READY"
        assert mgr.fleet()[0]["used_bytes"] == 0
        await mgr.close()

    run(scenario())
