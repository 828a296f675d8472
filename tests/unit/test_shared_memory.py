"""The router's system shared-memory registry: shared by workers through one directory, only
for loopback peers, and every tensor of a request sent inline."""

from __future__ import annotations

import base64
import mmap
import uuid

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.utils.shared_memory as shm
from tritonclient.grpc import service_pb2

from domain.router_errors import RouterError
from router.frontends.http_shared_memory import _check_cuda_register_body
from router.frontends.peers import loopback_peer
from router.frontends.shared_memory import SharedMemoryError, SystemSharedMemory, cuda_refusal
from router.frontends.shared_memory_regions import check_registration

PAGE = mmap.PAGESIZE


@pytest.fixture
def region():
    """Two pages: 0..15 (int32) at the start of each."""
    key = f"/mms_unit_{uuid.uuid4().hex[:8]}"
    handle = shm.create_shared_memory_region(key[1:], key, 2 * PAGE)
    shm.set_shared_memory_region(handle, [np.arange(16, dtype=np.int32)])
    shm.set_shared_memory_region(handle, [np.arange(16, dtype=np.int32)], offset=PAGE)
    yield key, handle
    shm.destroy_shared_memory_region(handle)


def test_two_workers_share_registrations(tmp_path, region):
    key, _handle = region
    one, other = SystemSharedMemory(tmp_path), SystemSharedMemory(tmp_path)
    one.register("r", key, 0, 64)
    assert other.read("r", 4, 8) == np.arange(1, 3, dtype=np.int32).tobytes()
    with pytest.raises(SharedMemoryError) as exc:
        other.register("r", key, 0, 64)
    assert exc.value.grpc_code == grpc.StatusCode.ALREADY_EXISTS
    one.unregister("r")
    with pytest.raises(SharedMemoryError, match="Unable to find shared memory region: 'r'"):
        other.read("r", 0, 4)
    # Registered again at another offset: the other worker reads the new registration.
    one.register("r", key, PAGE, 32)
    assert other.read("r", 8, 4) == np.int32(2).tobytes()
    assert [r.offset for r in other.status()] == [PAGE]
    one.close()
    other.close()


def test_keys_that_name_no_shared_memory_object_are_refused(tmp_path):
    memory = SystemSharedMemory(tmp_path)
    for key in ("/../etc/passwd", "/a/b", "/", "/..", "/triton_python_backend_shm_region_1", "/sem.x"):
        with pytest.raises(SharedMemoryError, match="Unable to open shared memory region"):
            memory.register("r", key, 0, 4)
    assert memory.status() == []


INVALID = grpc.StatusCode.INVALID_ARGUMENT
EINVAL = "unable to process address spaceInvalid argument"
EOVERFLOW = "unable to process address spaceValue too large for defined data type"


@pytest.mark.parametrize("offset, byte_size, object_bytes, words", [
    pytest.param(0, 2 * PAGE, 2 * PAGE, None, id="the whole object"),
    pytest.param(PAGE, 1, 2 * PAGE, None, id="from a page"),
    pytest.param(0, 2 * PAGE + 1, 2 * PAGE, "invalid args", id="one byte past the end"),
    pytest.param(3 * PAGE, 1, 2 * PAGE, "invalid args", id="offset past the end"),
    pytest.param(PAGE, PAGE + 1, 2 * PAGE, "invalid args", id="offset + size past the end"),
    pytest.param(0, 16, 0, "invalid args", id="empty object"),
    pytest.param(100, 28, 2 * PAGE, EINVAL, id="offset not a multiple of the page size"),
    pytest.param(0, 0, 2 * PAGE, EINVAL, id="no bytes"),
    pytest.param(0, 0, 0, EINVAL, id="no bytes of an empty object"),
    pytest.param(2**64 - PAGE, PAGE, 2 * PAGE, EOVERFLOW, id="a sum that wraps in size_t, page aligned"),
    pytest.param(2**64 - 1, 2, 2 * PAGE, EINVAL, id="a sum that wraps in size_t"),
])
def test_registrations_are_refused_as_triton_refuses_them(offset, byte_size, object_bytes, words):
    """tritonserver 2.51's answers, measured: its bounds check, then what mmap refuses."""
    if words is None:
        check_registration("r", "/k", offset, byte_size, object_bytes)
        return
    with pytest.raises(SharedMemoryError) as refused:
        check_registration("r", "/k", offset, byte_size, object_bytes)
    assert refused.value.grpc_code == INVALID
    assert refused.value.message.startswith(f"failed to register shared memory region 'r': {words}")
    assert ("is empty (0 bytes)" in refused.value.message) == (object_bytes == 0)


def test_a_second_region_of_a_registered_key_is_refused_as_triton_refuses_it(tmp_path, region):
    key, _ = region
    memory = SystemSharedMemory(tmp_path)
    memory.register("first", key, 0, PAGE)
    with pytest.raises(SharedMemoryError) as refused:
        memory.register("second", key, PAGE, PAGE)
    assert (refused.value.grpc_code, refused.value.message) == (
        grpc.StatusCode.INTERNAL, f"Invalid shared memory region: '{key}'")
    with pytest.raises(SharedMemoryError, match="'first' already in manager"):  # the name first
        memory.register("first", "/mms_unit_no_such_key", 0, PAGE)
    memory.unregister("first")
    memory.register("second", key, PAGE, PAGE)
    memory.close()


@pytest.mark.parametrize("offset, byte_size, words", [
    pytest.param(64, 8, "Invalid offset for", id="offset at the end"),
    pytest.param(-8, 8, "Invalid offset for", id="negative offset (a size_t past any region)"),
    pytest.param(60, 8, "Invalid offset + byte size for", id="offset + size past the end"),
    pytest.param(8, -8, "Invalid offset + byte size for", id="negative size"),
])
def test_a_place_outside_its_region_is_refused_before_anything_is_read(tmp_path, region, offset,
                                                                       byte_size, words):
    """Inputs first, then outputs (Triton's order), every place before any input is read."""
    key, _ = region
    memory = SystemSharedMemory(tmp_path)
    memory.register("r", key, 0, 64)
    request = service_pb2.ModelInferRequest(model_name="m")
    good = grpcclient.InferInput("A", [2], "INT32")
    good.set_shared_memory("r", 8)
    request.inputs.append(good._get_tensor())
    out = grpcclient.InferRequestedOutput("O")
    out.set_shared_memory("r", 8)
    request.outputs.append(out._get_tensor())
    bad = request.outputs.add(name="P")
    bad.parameters["shared_memory_region"].string_param = "r"
    bad.parameters["shared_memory_offset"].int64_param = offset
    bad.parameters["shared_memory_byte_size"].int64_param = byte_size
    with pytest.raises(SharedMemoryError) as refused:
        memory.inline(request)
    assert (refused.value.grpc_code, refused.value.message) == (INVALID, f"{words} shared memory region: 'r'")
    assert list(request.raw_input_contents) == []  # nothing read
    unknown = request.inputs.add(name="B", datatype="INT32", shape=[2])
    unknown.parameters["shared_memory_region"].string_param = "nosuch"
    with pytest.raises(SharedMemoryError, match="Unable to find shared memory region: 'nosuch'"):
        memory.inline(request)  # an input's error before an output's
    memory.close()


def test_loopback_peers_only():
    assert loopback_peer("ipv4:127.0.0.1:50000")
    assert loopback_peer("ipv6:[::1]:50000")
    assert loopback_peer("127.0.0.1")
    assert loopback_peer("::1")
    assert not loopback_peer("ipv4:10.1.2.3:50000")
    assert not loopback_peer("192.168.0.9")
    assert not loopback_peer(None)
    assert not loopback_peer("garbage")


def test_inline_keeps_input_order_with_raw_and_typed_contents(tmp_path, region):
    key, _ = region
    memory = SystemSharedMemory(tmp_path)
    memory.register("r", key, 0, 64)
    request = service_pb2.ModelInferRequest(model_name="m")
    first = grpcclient.InferInput("A", [2], "INT32")
    first.set_shared_memory("r", 8, offset=8)
    typed = request.inputs.add(name="B", datatype="INT32", shape=[2])
    typed.contents.int_contents.extend([7, 9])
    request.inputs.insert(0, first._get_tensor())
    places = memory.inline(request)
    assert places == {}
    assert [i.name for i in request.inputs] == ["A", "B"]
    assert list(request.raw_input_contents) == [np.array([2, 3], np.int32).tobytes(),
                                                np.array([7, 9], np.int32).tobytes()]
    assert all("shared_memory_region" not in i.parameters for i in request.inputs)
    assert not request.inputs[1].HasField("contents")
    memory.close()


def test_output_too_small_for_the_answer(tmp_path, region):
    key, _ = region
    memory = SystemSharedMemory(tmp_path)
    memory.register("r", key, 0, 64)
    request = service_pb2.ModelInferRequest(model_name="m")
    out = grpcclient.InferRequestedOutput("O")
    out.set_shared_memory("r", 4)
    request.outputs.append(out._get_tensor())
    places = memory.inline(request)
    response = service_pb2.ModelInferResponse(model_name="m")
    response.outputs.add(name="O", datatype="INT32", shape=[2])
    response.raw_output_contents.append(np.array([1, 2], np.int32).tobytes())
    with pytest.raises(SharedMemoryError, match=r"\(4 bytes\) should be at least 8 bytes"):
        memory.deliver(response, places)
    memory.close()


def test_typed_bytes_contents_become_triton_length_prefixed_bytes():
    """A BYTES input sent as typed contents beside shared-memory inputs goes to Triton as raw
    bytes: each element with its 4-byte little-endian length (not a pointer's bytes)."""
    from tritonclient.grpc import service_pb2

    from router.frontends.shared_memory import _typed_as_raw

    tensor = service_pb2.ModelInferRequest.InferInputTensor(name="TEXT", datatype="BYTES", shape=[2])
    tensor.contents.bytes_contents.extend([b"ab", b"cde"])
    assert _typed_as_raw(tensor) == b"\x02\x00\x00\x00ab\x03\x00\x00\x00cde"


HANDLE_B64 = base64.b64encode(bytes(64)).decode()


@pytest.mark.parametrize("body, status, words", [
    pytest.param([], 400, "Shared memory register request has no 'raw_handle' field", id="not an object"),
    pytest.param({"byte_size": 64, "device_id": 0}, 400,
                 "Shared memory register request has no 'raw_handle' field", id="no handle"),
    pytest.param({"raw_handle": "x", "byte_size": 64, "device_id": 0}, 500,
                 "attempt to access non-existing object member 'b64'", id="handle not an object"),
    pytest.param({"raw_handle": {"b64": 5}, "byte_size": 64, "device_id": 0}, 500,
                 "attempt to access JSON non-string as string", id="b64 not a string"),
    pytest.param({"raw_handle": {"b64": HANDLE_B64}}, 500,
                 "attempt to access non-existing object member 'byte_size'", id="no byte_size"),
    pytest.param({"raw_handle": {"b64": HANDLE_B64}, "byte_size": 64}, 500,
                 "attempt to access non-existing object member 'device_id'", id="no device_id"),
    pytest.param({"raw_handle": {"b64": HANDLE_B64}, "byte_size": -1, "device_id": 0}, 500,
                 "attempt to access JSON non-unsigned-integer as unsigned-integer", id="negative byte_size"),
    pytest.param({"raw_handle": {"b64": "!!!!"}, "byte_size": 64, "device_id": 0}, 400,
                 "'raw_handle' must be a valid base64 encoded cudaIpcMemHandle_t", id="not base64"),
    pytest.param({"raw_handle": {"b64": HANDLE_B64[:-4]}, "byte_size": 64, "device_id": 0}, 400,
                 "'raw_handle' must be a valid base64 encoded cudaIpcMemHandle_t", id="63 bytes"),
    pytest.param({"raw_handle": {"b64": HANDLE_B64}, "byte_size": 64, "device_id": 0}, 400,
                 "failed to register shared memory region: invalid args: CUDA shared memory is not available",
                 id="a well-formed registration"),
])
def test_cuda_registrations_are_refused_as_triton_answers_them(body, status, words):
    """tritonserver 2.51's checks of the HTTP body, measured, in its order; a registration
    that passes them is refused as Triton refuses a handle it cannot open."""
    def register():
        _check_cuda_register_body(body)
        raise cuda_refusal()

    with pytest.raises(RouterError) as refused:
        register()
    assert refused.value.http_status == status
    assert refused.value.message.startswith(words), refused.value.message
