"""The calls Triton's example clients make (triton-inference-server/client,
src/python/examples), made by this suite's own code against a real tritonserver directly and
through `mmctl up` (two router workers), with the models those examples call
(``tests.triton_examples``): the same answers on both sides.

Covered: health and metadata; infer sync, async (callbacks and handles) and aio over gRPC
and HTTP; strings; explicit int, int8 and byte contents on a raw gRPC stub; reuse of
InferInput objects across calls with and without shared memory; keepalive options; custom
channel arguments and headers.  System shared memory has its own module
(test_shared_memory.py).  ``python -m tests.client_examples`` runs the examples themselves.
"""

from __future__ import annotations

import asyncio
import queue
import uuid

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as grpcaio
import tritonclient.http as httpclient
import tritonclient.http.aio as httpaio
import tritonclient.utils.shared_memory as shm
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException, deserialize_bytes_tensor

from control_plane.triton.process import TritonLaunchConfig, TritonProcess
from tests.product import Product
from tests.triton_examples import EXAMPLE_MODELS, write_example_repository

pytestmark = pytest.mark.integration

CLIENTS = {"grpc": grpcclient, "http": httpclient}
SIDES = ("direct", "routed")
IN0 = np.arange(16, dtype=np.int32).reshape(1, 16)
IN1 = np.full((1, 16), -1, dtype=np.int32)


@pytest.fixture(scope="module")
def urls(tmp_path_factory):
    root = tmp_path_factory.mktemp("examples")
    triton = TritonProcess(TritonLaunchConfig(repository=write_example_repository(root / "direct"),
                                              work_dir=root / "triton"))
    triton.start()
    product = Product(root / "state", write_example_repository(root / "repository"),
                      "--router-workers", "2")
    try:
        product.start()
        admin = grpcclient.InferenceServerClient(triton.grpc_url)
        for model in EXAMPLE_MODELS:
            admin.load_model(model)
            out = product.mmctl("load", model)
            assert out.returncode == 0, out.stdout + out.stderr
        endpoints = product.json("endpoints")
        yield {"direct": {"grpc": triton.grpc_url, "http": triton.http_url},
               "routed": {"grpc": endpoints["router_grpc"], "http": endpoints["router_http"]}}
    finally:
        product.stop()
        triton.stop()


def both(urls, protocol: str, call) -> tuple:
    """``call(client)`` on both sides: (direct, routed)."""
    module = CLIENTS[protocol]
    return tuple(call(module.InferenceServerClient(urls[side][protocol])) for side in SIDES)


def add_sub_inputs(module, dtype="INT32", a=IN0, b=IN1):
    tensors = []
    for name, data in (("INPUT0", a), ("INPUT1", b)):
        tensor = module.InferInput(name, list(data.shape), dtype)
        tensor.set_data_from_numpy(data)
        tensors.append(tensor)
    return tensors


def outputs_of(result) -> dict:
    return {name: result.as_numpy(name).tolist() for name in ("OUTPUT0", "OUTPUT1")}


def error_of(call):
    try:
        call()
    except InferenceServerException as exc:
        return str(exc.status()), exc.message()
    raise AssertionError("no error")


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_health_and_metadata(urls, protocol):
    def look(c):
        metadata = c.get_model_metadata("simple")
        config = c.get_model_config("simple")
        if protocol == "grpc":
            metadata, config = str(metadata), str(config)
        server = c.get_server_metadata()
        name = server.name if protocol == "grpc" else server["name"]
        return (c.is_server_live(), c.is_server_ready(), c.is_model_ready("simple"), name, metadata,
                config, error_of(lambda: c.get_model_metadata("wrong_model_name")))
    direct, routed = both(urls, protocol, look)
    assert direct[:3] == (True, True, True)
    assert routed == direct


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_infer_sync(urls, protocol):
    m = CLIENTS[protocol]

    def infer(c):
        kwargs = {"binary_data": False} if protocol == "http" else {}
        outputs = [m.InferRequestedOutput("OUTPUT0"), m.InferRequestedOutput("OUTPUT1", **kwargs)]
        return outputs_of(c.infer("simple", add_sub_inputs(m), outputs=outputs, request_id="7"))
    direct, routed = both(urls, protocol, infer)
    assert direct == {"OUTPUT0": (IN0 + IN1).tolist(), "OUTPUT1": (IN0 - IN1).tolist()}
    assert routed == direct


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_infer_async(urls, protocol):
    m = CLIENTS[protocol]

    def infer(c):
        if protocol == "http":  # handles: several requests in flight on one client
            handles = [c.async_infer("simple", add_sub_inputs(m)) for _ in range(4)]
            return [outputs_of(h.get_result()) for h in handles]
        done: queue.Queue = queue.Queue()
        for _ in range(4):
            c.async_infer("simple", add_sub_inputs(m), callback=lambda result, error: done.put((result, error)))
        results = [done.get(timeout=60) for _ in range(4)]
        assert all(error is None for _, error in results), results
        return [outputs_of(result) for result, _ in results]
    direct, routed = both(urls, protocol, infer)
    assert routed == direct and len(direct) == 4


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_infer_aio(urls, protocol):
    aio = grpcaio if protocol == "grpc" else httpaio

    async def infer(url):
        client = aio.InferenceServerClient(url)
        try:
            assert await client.is_model_ready("simple")
            results = await asyncio.gather(*(client.infer("simple", add_sub_inputs(aio)) for _ in range(4)))
            return [outputs_of(r) for r in results]
        finally:
            await client.close()
    direct, routed = (asyncio.run(infer(urls[side][protocol])) for side in SIDES)
    assert routed == direct


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_strings(urls, protocol):
    m = CLIENTS[protocol]
    a = np.array([str(i).encode() for i in range(16)], dtype=np.object_).reshape(1, 16)
    b = np.array([b"1"] * 16, dtype=np.object_).reshape(1, 16)
    raw = np.array([b"\x00\xffbytes", "ünïcode".encode(), b""], dtype=np.object_).reshape(1, 3)

    def infer(c):
        sums = outputs_of(c.infer("simple_string", add_sub_inputs(m, "BYTES", a, b)))
        echo = m.InferInput("INPUT0", [1, 3], "BYTES")
        echo.set_data_from_numpy(raw)
        return sums, c.infer("simple_identity", [echo]).as_numpy("OUTPUT0").tolist()
    direct, routed = both(urls, protocol, infer)
    assert direct[1] == raw.tolist() and direct[0]["OUTPUT0"][0][3] == b"4"
    assert routed == direct


def explicit_request(model: str, datatype: str, field: str, a, b) -> service_pb2.ModelInferRequest:
    """A request with typed ``contents`` instead of raw bytes, built on the generated stub."""
    request = service_pb2.ModelInferRequest(model_name=model)
    for name, values in (("INPUT0", a), ("INPUT1", b)):
        tensor = request.inputs.add(name=name, datatype=datatype, shape=[1, 16])
        getattr(tensor.contents, field).extend(values)
    request.outputs.add(name="OUTPUT0")
    request.outputs.add(name="OUTPUT1")
    return request


@pytest.mark.parametrize("model,datatype,field,a,b", [
    ("simple", "INT32", "int_contents", list(range(16)), [1] * 16),
    ("simple_int8", "INT8", "int_contents", list(range(-8, 8)), [120] * 16),  # wraps, as in Triton
    ("simple_string", "BYTES", "bytes_contents", [str(i).encode() for i in range(16)], [b"1"] * 16),
])
def test_explicit_contents(urls, model, datatype, field, a, b):
    def infer(url):
        with grpc.insecure_channel(url) as channel:
            response = service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelInfer(
                explicit_request(model, datatype, field, a, b))
        return response.model_name, list(response.raw_output_contents), dict(response.parameters)
    direct, routed = (infer(urls[side]["grpc"]) for side in SIDES)
    assert routed == direct
    if datatype == "BYTES":
        assert deserialize_bytes_tensor(direct[1][0]).tolist() == [str(i + 1).encode() for i in range(16)]


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_infer_objects_reused_with_and_without_shared_memory(urls, protocol):
    """The same InferInput and InferRequestedOutput objects, switched between inline data
    and shared-memory regions between calls."""
    m = CLIENTS[protocol]
    tag = uuid.uuid4().hex[:8]
    handles = {role: shm.create_shared_memory_region(f"{role}{tag}", f"/mms_reuse_{role}_{tag}", 64)
               for role in ("in0", "in1", "out0")}
    shm.set_shared_memory_region(handles["in0"], [IN0])
    shm.set_shared_memory_region(handles["in1"], [IN1])

    def session(c):
        c.unregister_system_shared_memory()
        for role in handles:
            c.register_system_shared_memory(f"{role}_data", f"/mms_reuse_{role}_{tag}", 64)
        inputs = add_sub_inputs(m)
        outputs = [m.InferRequestedOutput("OUTPUT0"), m.InferRequestedOutput("OUTPUT1")]
        seen = [outputs_of(c.infer("simple", inputs, outputs=outputs))]
        inputs[0].set_shared_memory("in0_data", 64)
        inputs[1].set_shared_memory("in1_data", 64)
        outputs[0].set_shared_memory("out0_data", 64)
        result = c.infer("simple", inputs, outputs=outputs)
        seen.append((shm.get_contents_as_numpy(handles["out0"], np.int32, [1, 16]).tolist(),
                     result.as_numpy("OUTPUT1").tolist()))
        outputs[0].unset_shared_memory()
        for tensor, data in zip(inputs, (IN0 * 2, IN1), strict=True):
            tensor.set_data_from_numpy(data)
        seen.append(outputs_of(c.infer("simple", inputs, outputs=outputs)))
        c.unregister_system_shared_memory()
        return seen

    try:
        direct, routed = both(urls, protocol, session)
    finally:
        for handle in handles.values():
            shm.destroy_shared_memory_region(handle)
    assert direct[1] == ((IN0 + IN1).tolist(), (IN0 - IN1).tolist())
    assert direct[2]["OUTPUT0"] == (IN0 * 2 + IN1).tolist()
    assert routed == direct


def test_keepalive_and_custom_channel_arguments(urls):
    keepalive = grpcclient.KeepAliveOptions(keepalive_time_ms=2**31 - 1, keepalive_timeout_ms=20000,
                                            keepalive_permit_without_calls=False,
                                            http2_max_pings_without_data=2)
    channel_args = [("grpc.max_send_message_length", 1024 * 1024),
                    ("grpc.max_receive_message_length", 1024 * 1024),
                    ("grpc.keepalive_time_ms", 2**31 - 1), ("grpc.dns_enable_srv_queries", 1)]
    for options in ({"keepalive_options": keepalive}, {"channel_args": channel_args}):
        seen = []
        for side in SIDES:
            c = grpcclient.InferenceServerClient(urls[side]["grpc"], **options)
            seen.append(outputs_of(c.infer("simple", add_sub_inputs(grpcclient), headers={"test": "1"},
                                           client_timeout=30)))
        assert seen[1] == seen[0], options
