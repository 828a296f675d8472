"""The router's system shared-memory registry: shared by workers through one directory, only
for loopback peers, and every tensor of a request sent inline."""

from __future__ import annotations

import uuid

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.utils.shared_memory as shm
from tritonclient.grpc import service_pb2

from router.frontends.peers import loopback_peer
from router.frontends.shared_memory import SharedMemoryError, SystemSharedMemory


@pytest.fixture
def region():
    key = f"/mms_unit_{uuid.uuid4().hex[:8]}"
    handle = shm.create_shared_memory_region(key[1:], key, 64)
    shm.set_shared_memory_region(handle, [np.arange(16, dtype=np.int32)])
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
    # Registered again at another offset: the other worker maps the new registration.
    one.register("r", key, 32, 32)
    assert other.read("r", 0, 4) == np.int32(8).tobytes()
    assert [r.offset for r in other.status()] == [32]
    one.close()
    other.close()


def test_keys_that_name_no_shared_memory_object_are_refused(tmp_path):
    memory = SystemSharedMemory(tmp_path)
    for key in ("/../etc/passwd", "/a/b", "/", "/..", "/triton_python_backend_shm_region_1", "/sem.x"):
        with pytest.raises(SharedMemoryError, match="Unable to open shared memory region"):
            memory.register("r", key, 0, 4)
    assert memory.status() == []


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
