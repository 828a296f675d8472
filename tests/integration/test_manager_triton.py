"""The model manager against a real tritonserver (explicit model-control mode)."""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from control_plane.manager.manager_config import ManagerConfig
from control_plane.manager.model_manager import ModelManager
from control_plane.manager.records import ModelState, ServerSpec
from control_plane.state.state_store import StateStore
from control_plane.triton.process import free_port
from domain.errors import (
    CapacityExhausted,
    InvalidModelName,
    ModelLoadFailed,
    ModelNotFound,
    TritonUnavailable,
)
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
        # An inference sent straight to Triton refreshes cust001's recency at the next
        # reconcile pass, once Triton's statistics show it (they may lag the answer by a
        # moment on a busy machine); a miss itself asks Triton nothing before it places.
        admin = mgr.servers["triton0"].admin
        before = int((await admin.statistics())["cust001"].get("last_inference", 0) or 0)
        await asyncio.to_thread(infer, triton.grpc_url, "cust001")
        deadline = time.monotonic() + 10
        while int((await admin.statistics())["cust001"].get("last_inference", 0) or 0) <= before:
            assert time.monotonic() < deadline, "Triton's statistics never showed the inference"
            await asyncio.sleep(0.05)
        await mgr.step()
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
        size = mgr.catalog.artifact_bytes("cust001")
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
        except Exception as exc:  # noqa: BLE001 - whatever fails is recorded and asserted below
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
        # Wrong input shape: an error for that request only; the next one is served.
        await mgr.ensure("cust001")
        client = grpcclient.InferenceServerClient(triton.grpc_url)
        wrong = grpcclient.InferInput("FEATURES", [1, 32], "FP32")
        wrong.set_data_from_numpy(np.zeros((1, 32), np.float32))
        with pytest.raises(InferenceServerException, match="unexpected shape for input 'FEATURES'"):
            client.infer("cust001", [wrong])
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


# --------------------------------------------------------------------------- warm-up
PICKY_MODEL_PY = '''
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    """add_sub that refuses all-zero inputs, as a real model may refuse a synthetic request."""

    def execute(self, requests):
        responses = []
        for request in requests:
            a = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            b = pb_utils.get_input_tensor_by_name(request, "INPUT1").as_numpy()
            if not a.any() and not b.any():
                responses.append(pb_utils.InferenceResponse(
                    error=pb_utils.TritonError("all-zero input is not a valid request")))
                continue
            responses.append(pb_utils.InferenceResponse(
                [pb_utils.Tensor("OUTPUT0", a + b), pb_utils.Tensor("OUTPUT1", a - b)]))
        return responses
'''

PICKY_CONFIG = '''
name: "{name}"
backend: "python"
max_batch_size: 0
input [
  {{ name: "INPUT0" data_type: TYPE_INT32 dims: [ 16 ] }},
  {{ name: "INPUT1" data_type: TYPE_INT32 dims: [ 16 ] }}
]
output [
  {{ name: "OUTPUT0" data_type: TYPE_INT32 dims: [ 16 ] }},
  {{ name: "OUTPUT1" data_type: TYPE_INT32 dims: [ 16 ] }}
]
instance_group [ {{ count: 1 kind: KIND_CPU }} ]
{extra}
'''

OWN_WARMUP = '''
model_warmup [ {
  name: "random"
  batch_size: 1
  inputs { key: "INPUT0" value { data_type: TYPE_INT32 dims: [ 16 ] random_data: true } }
  inputs { key: "INPUT1" value { data_type: TYPE_INT32 dims: [ 16 ] random_data: true } }
} ]
'''

SYNTHETIC_OFF = 'parameters { key: "mms_warmup" value: { string_value: "false" } }'


def write_picky(repository, name: str, extra: str = "") -> None:
    (repository / name / "1").mkdir(parents=True)
    (repository / name / "1" / "model.py").write_text(PICKY_MODEL_PY)
    (repository / name / "config.pbtxt").write_text(PICKY_CONFIG.format(name=name, extra=extra))


def test_warmup_as_the_model_says(triton, repository, tmp_path):
    write_picky(repository, "picky_own", OWN_WARMUP)
    write_picky(repository, "picky_off", SYNTHETIC_OFF)
    write_picky(repository, "picky")

    async def scenario():
        mgr = make_manager(triton, repository, tmp_path, max_loaded=4)
        await mgr.start()
        # Its own model_warmup ran inside Triton's load; zeros were never sent.
        own = await mgr.ensure("picky_own")
        assert own.state == ModelState.READY and own.warmup["mode"] == "model" and own.healthy
        # Turned off in config.pbtxt: loads with no warm-up request.
        off = await mgr.ensure("picky_off")
        assert off.state == ModelState.READY and off.warmup["mode"] == "off"
        # Neither: the synthetic request is refused.  Triton loaded the model, so it is
        # served; its health says what was sent and how to turn the check off.
        picky = await mgr.ensure("picky")
        assert picky.state == ModelState.READY and not picky.healthy
        for needle in ("all-zero input", "INPUT0 shape [16] INT32", "INPUT1 shape [16] INT32",
                       "model_warmup", "mms_warmup"):
            assert needle in picky.warmup["error"], (needle, picky.warmup["error"])
        assert triton_ready_set(triton) == {"picky_own", "picky_off", "picky"}
        # A probe of a model that is not warmed up synthetically asks Triton, sends nothing.
        health = await mgr.health("picky_own", probe=True)
        assert health["healthy"] and health["warmup"]["mode"] == "model"
        await mgr.close()

    run(scenario())


# --------------------------------------------------------------------------- pins vs unloads
def test_load_unload_pin_a_moment_apart_ends_pinned_and_loaded(triton, repository, tmp_path):
    async def scenario():
        mgr = make_manager(triton, repository, tmp_path, max_loaded=3)
        await mgr.start()
        load = asyncio.create_task(mgr.ensure("cust003"))
        await asyncio.sleep(0.3)
        unload = asyncio.create_task(mgr.unload("cust003"))
        await asyncio.sleep(0.3)
        rec = await mgr.pin("cust003")
        await asyncio.gather(load, unload, return_exceptions=True)
        assert (rec.state, rec.pinned) == (ModelState.READY, True)
        await asyncio.sleep(2.0)  # an unload that went on anyway would have finished
        assert mgr.get("cust003").state == ModelState.READY
        assert "cust003" in triton_ready_set(triton)
        await mgr.close()

    run(scenario())
