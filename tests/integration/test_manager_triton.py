"""The model manager against a real tritonserver (explicit model-control mode)."""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from control_plane.errors import (
    CapacityExhausted,
    InvalidModelName,
    ModelLoadFailed,
    ModelNotFound,
    TritonUnavailable,
)
from control_plane.manager import ManagerConfig, ModelManager, ModelState, ServerSpec
from control_plane.state_store import StateStore
from control_plane.triton_process import free_port
from tests.conftest import run, triton_log_count

pytestmark = pytest.mark.integration


def make_manager(triton, repository, tmp_path, max_loaded=None, budget=None, policy="lru", **cfg):
    """These tests pin down LRU behaviour, so they ask for the LRU policy by name."""
    spec = ServerSpec("triton0", triton.grpc_url, triton.http_url, triton.metrics_url,
                      memory_budget_bytes=budget, max_loaded=max_loaded)
    server = ModelManager.make_server(spec, policy)
    store = StateStore(tmp_path / "state" / "state.db")
    return ModelManager([server], store, repository=repository,
                        config=ManagerConfig(policy=policy, **cfg))


def triton_ready_set(triton) -> set[str]:
    client = grpcclient.InferenceServerClient(triton.grpc_url)
    index = client.get_model_repository_index(as_json=True)["models"]
    return {m["name"] for m in index if m.get("state") == "READY"}


def infer(url: str, model: str, rows: int = 2) -> np.ndarray:
    client = grpcclient.InferenceServerClient(url)
    x = grpcclient.InferInput("FEATURES", [rows, 64], "FP32")
    x.set_data_from_numpy(np.linspace(-1, 1, rows * 64, dtype=np.float32).reshape(rows, 64))
    return client.infer(model, [x]).as_numpy("SCORES")


def loaded(mgr: ModelManager) -> set[str]:
    return {m["model"] for m in mgr.status() if m["state"] == "ready"}


def test_lru_order_with_recency_from_inference_and_ensure(triton, repository, tmp_path):
    async def scenario():
        mgr = make_manager(triton, repository, tmp_path, max_loaded=3)
        await mgr.start()
        for name in ("cust001", "cust002", "cust003"):
            await mgr.ensure(name)
        # An inference sent straight to Triton refreshes cust001's recency.
        await asyncio.to_thread(infer, triton.grpc_url, "cust001")
        await mgr.ensure("cust004")  # evicts cust002, not cust001
        assert loaded(mgr) == {"cust001", "cust003", "cust004"}
        await mgr.ensure("cust003")  # an ensure refreshes recency too
        await mgr.ensure("cust005")  # evicts cust001 (cust003 was just used)
        assert loaded(mgr) == {"cust003", "cust004", "cust005"}
        assert triton_ready_set(triton) == {"cust003", "cust004", "cust005"}
        states = {m["model"]: m["state"] for m in mgr.status()}
        assert states["cust001"] == states["cust002"] == "warm"
        assert mgr.metrics.evictions.labels("triton0")._value.get() == 2
        await mgr.close()

    run(scenario())


def test_pinned_models_survive_pressure_and_full_pinned_gives_clear_error(triton, repository, tmp_path):
    async def scenario():
        mgr = make_manager(triton, repository, tmp_path, max_loaded=2)
        await mgr.start()
        await mgr.pin("cust001")
        for name in ("cust002", "cust003", "cust004"):
            await mgr.ensure(name)
            assert "cust001" in loaded(mgr)
        await mgr.pin("cust004")
        with pytest.raises(CapacityExhausted) as err:
            await mgr.ensure("cust005")
        message = str(err.value)
        assert "cust001" in message and "cust004" in message and "2 models" in message
        # Nothing evicted, nothing half-loaded.
        assert triton_ready_set(triton) == {"cust001", "cust004"}
        assert mgr.get("cust005").state == ModelState.WARM
        assert mgr.servers["triton0"].planner.used_slots == 2
        await mgr.unpin("cust004")
        await mgr.ensure("cust005")
        assert triton_ready_set(triton) == {"cust001", "cust005"}
        await mgr.close()

    run(scenario())


def test_memory_budget_counts_bytes(triton, repository, tmp_path):
    async def scenario():
        mgr = make_manager(triton, repository, tmp_path)
        size = mgr.artifact_bytes("cust001")
        assert size > 0
        mgr.servers["triton0"].planner.capacity.max_bytes = int(size * 2.5)
        await mgr.start()
        for name in ("cust001", "cust002", "cust003"):
            await mgr.ensure(name)
        assert loaded(mgr) == {"cust002", "cust003"}
        assert mgr.servers["triton0"].planner.used_bytes <= size * 2.5
        await mgr.close()

    run(scenario())


def test_sixteen_concurrent_ensures_cause_one_triton_load(triton, repository, tmp_path):
    async def scenario():
        mgr = make_manager(triton, repository, tmp_path)
        await mgr.start()
        records = await asyncio.gather(*(mgr.ensure("cust006") for _ in range(16)))
        assert all(r.state == ModelState.READY for r in records)
        assert mgr.get("cust006").loads == 1
        assert mgr.metrics.loads.labels("triton0", "ok")._value.get() == 1
        await mgr.close()

    run(scenario())
    assert triton_log_count(triton, "successfully loaded 'cust006'") == 1


def test_long_inference_in_flight_is_not_cut_by_unload(triton, repository, tmp_path):
    result: dict = {}

    def slow_request():
        try:
            result["scores"] = infer(triton.grpc_url, "slow", rows=1)
        except Exception as exc:  # recorded and asserted below
            result["error"] = exc
        result["done_at"] = time.monotonic()

    async def scenario():
        mgr = make_manager(triton, repository, tmp_path)
        await mgr.start()
        await mgr.ensure("slow")
        await asyncio.sleep(3.5)  # let the warm-up's 3 s execute finish first
        thread = threading.Thread(target=slow_request)
        thread.start()
        await asyncio.sleep(0.5)
        await mgr.unload("slow")
        unloaded_at = time.monotonic()
        await asyncio.to_thread(thread.join)
        assert "error" not in result, result.get("error")
        assert result["scores"].shape == (1, 1)
        # Memory is counted free only after Triton let the running request finish.
        assert unloaded_at >= result["done_at"]
        assert mgr.get("slow").state == ModelState.WARM
        await mgr.close()

    run(scenario())


def test_unload_waits_for_leases_to_drain(triton, repository, tmp_path):
    async def scenario():
        mgr = make_manager(triton, repository, tmp_path, drain_timeout_s=10)
        await mgr.start()
        await mgr.ensure("cust002")
        released = {}

        async def hold():
            async with mgr.lease("cust002"):
                await asyncio.sleep(1.0)
                released["at"] = time.monotonic()

        holder = asyncio.create_task(hold())
        await asyncio.sleep(0.1)
        assert mgr.get("cust002").inflight == 1
        await mgr.unload("cust002")
        assert time.monotonic() >= released["at"]
        await holder
        await mgr.close()

    run(scenario())


def test_bad_input_gets_clear_errors(triton, repository, tmp_path):
    async def scenario():
        mgr = make_manager(triton, repository, tmp_path, max_loaded=2)
        await mgr.start()
        with pytest.raises(ModelNotFound, match="not in the model repository"):
            await mgr.ensure("cust999")
        for bad in ("../etc", "a/b", "a b", "x;rm -rf", "$(id)", "", "name\n", "."):
            with pytest.raises(InvalidModelName):
                await mgr.ensure(bad)
        # A model that fails to load ends `failed` with the reason and holds no capacity.
        with pytest.raises(ModelLoadFailed, match="broken on purpose"):
            await mgr.ensure("broken")
        rec = mgr.get("broken")
        assert rec.state == ModelState.FAILED and "broken on purpose" in rec.failure
        assert mgr.servers["triton0"].planner.used_slots == 0
        health = await mgr.health("broken")
        assert health["healthy"] is False and "broken on purpose" in health["failure"]
        # Wrong input shape: the model answers with an error for that request only.
        await mgr.ensure("cust001")
        client = grpcclient.InferenceServerClient(triton.grpc_url)
        x = grpcclient.InferInput("FEATURES", [1, 64], "FP32")
        x.set_data_from_numpy(np.zeros((1, 64), np.float32))
        assert client.infer("cust001", [x]).as_numpy("SCORES").shape == (1, 1)
        await mgr.close()

    run(scenario())


def test_triton_not_running_is_a_clear_error(tmp_path, repository):
    async def scenario():
        port = free_port()
        spec = ServerSpec("triton0", f"127.0.0.1:{port}", "", None, max_loaded=2)
        mgr = ModelManager([ModelManager.make_server(spec)], StateStore(tmp_path / "s.db"),
                           repository=repository)
        await mgr.start()  # logs, does not crash
        assert mgr.servers["triton0"].up is False
        with pytest.raises(TritonUnavailable, match="not reachable"):
            await mgr.ensure("cust001")
        await mgr.close()

    run(scenario())


def test_restart_reconciles_with_triton_and_keeps_pins(triton, repository, tmp_path):
    async def first():
        mgr = make_manager(triton, repository, tmp_path, max_loaded=3)
        await mgr.start()
        await mgr.pin("cust001")
        await mgr.ensure("cust002")
        # Abandoned without close(): the next manager must rebuild from Triton + SQLite.

    async def second():
        mgr = make_manager(triton, repository, tmp_path, max_loaded=3)
        await mgr.start()
        assert loaded(mgr) == triton_ready_set(triton) == {"cust001", "cust002"}
        assert mgr.get("cust001").pinned and not mgr.get("cust002").pinned
        await mgr.ensure("cust003")
        await mgr.ensure("cust004")  # evicts the adopted, unpinned cust002
        assert triton_ready_set(triton) == {"cust001", "cust003", "cust004"}
        await mgr.close()

    run(first())
    run(second())
