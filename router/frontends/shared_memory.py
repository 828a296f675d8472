"""Triton's system shared-memory protocol on the public port, for clients on the router's host.

A client registers a POSIX shared-memory object (``/dev/shm/<key>``) under a region name,
then names the region in an inference request instead of sending the tensor: inputs are
read from the region, outputs are written into it.  The router reads and writes the object
itself and sends the tensors inline to Triton, so Triton (on another host, another GPU or
restarted since) never needs the client's memory, and a request may move between Tritons.

Registrations are shared by every router worker of one ``mmctl up`` through a directory
(one small file per region, created with ``link`` so a name is registered once): a client's
register call and its inference calls may reach different workers over different
connections.  Each use opens the object again (``O_NOFOLLOW``), checks its size as it is now
and reads or writes with ``pread``/``pwrite``: no mapping outlives a request, so an object
its owner truncated is a client error, never SIGBUS in a worker.

Only a peer on the loopback interface may register, list, unregister or name a region: a
region is this host's memory, and a remote client naming one would read or overwrite
another process's memory.  The bytes a request reads from regions count against the
request limit (``--max-request-bytes``) with its own.  The texts and codes of Triton's
errors are Triton's (tritonserver 2.51, measured), in Triton's order: a registration is
checked as Triton checks it before and when it maps the region (``check_registration``),
a tensor's place as Triton checks it at each request, inputs then outputs, before anything
is read or sent (``_check_span``).  The checks Triton does not make answer 4xx with what to
do.  CUDA shared memory is not served: its handle maps device memory of the GPU Triton runs
on, which the router does not hold; a registration is refused as Triton refuses a handle it
cannot open (``CUDA_REFUSAL``).
"""

from __future__ import annotations

import logging

import grpc
import numpy as np
from google.protobuf.message import DecodeError
from tritonclient.grpc import service_pb2
from tritonclient.utils import serialize_byte_tensor, triton_to_np_dtype

from domain.router_errors import PayloadTooLarge, PermissionDenied
from router.frontends.peers import loopback_peer
from router.frontends.shared_memory_objects import SharedMemoryError
from router.frontends.shared_memory_regions import OutputPlace, RegisteredRegions
from router.frontends.shared_memory_requests import (
    BYTE_SIZE,
    OFFSET,
    REGION,
    SHM_PARAMETERS,
    grpc_place,
    json_uses_shared_memory,
    names_region,
    uses_shared_memory,
)

log = logging.getLogger(__name__)

# Triton's answer to a CUDA registration whose handle it cannot open (INVALID_ARGUMENT / 400),
# then the router's reason: Triton's clients match on the first words ("failed to register
# shared memory region.*invalid args").
CUDA_REFUSAL = ("failed to register shared memory region: invalid args: CUDA shared memory is not "
                "available through the router: its handle maps memory of a GPU that Triton, not the "
                "router, holds. Use system shared memory (same host) or send the tensors in the request")
REMOTE_REFUSAL = ("system shared memory is only for clients on the router's host (loopback); "
                  "send the tensors in the request instead")

def refuse_remote(peer: str | None) -> None:
    """PermissionDenied unless ``peer`` (``loopback_peer``) is on the router's host."""
    if not loopback_peer(peer):
        raise PermissionDenied(REMOTE_REFUSAL)


def cuda_refusal() -> SharedMemoryError:
    return SharedMemoryError(grpc.StatusCode.INVALID_ARGUMENT, CUDA_REFUSAL)


class SystemSharedMemory(RegisteredRegions):
    """``RegisteredRegions`` as requests use them: a request naming regions is admitted
    (its peer, its bytes), its inputs are read into it and its outputs written back."""

    # ------------------------------------------------------------------ admission
    def admit(self, request: service_pb2.ModelInferRequest, peer: str | None, limit_bytes: int,
              request_bytes: int | None = None) -> None:
        """Refuse a request that names shared memory from a peer not on loopback, or whose
        region bytes with its own (``request_bytes``, its serialized size when None) pass
        ``limit_bytes``; nothing is read."""
        if not uses_shared_memory(request):
            return
        refuse_remote(peer)
        region_bytes = sum(max(grpc_place(t.parameters)[2], 0) for t in request.inputs
                           if REGION in t.parameters)
        _within_limit(region_bytes, request.ByteSize() if request_bytes is None else request_bytes,
                      limit_bytes)

    def admit_raw(self, raw: bytes, peer: str | None, limit_bytes: int) -> None:
        """``admit`` for a serialized ModelInferRequest; one that does not parse is left to
        the caller's own parse to refuse."""
        if not names_region(raw):
            return
        try:
            request = service_pb2.ModelInferRequest.FromString(raw)
        except DecodeError:
            return
        self.admit(request, peer, limit_bytes, len(raw))

    def admit_json(self, doc: dict, body_bytes: int, peer: str | None, limit_bytes: int) -> None:
        """``admit`` for an HTTP request's JSON header ``doc`` (its body ``body_bytes`` long)."""
        if not json_uses_shared_memory(doc):
            return
        refuse_remote(peer)
        sizes = ((t.get("parameters") or {}).get(BYTE_SIZE, 0) for t in doc.get("inputs", ())
                 if isinstance(t, dict) and REGION in (t.get("parameters") or {}))
        _within_limit(sum(s for s in sizes if type(s) is int and s > 0), body_bytes, limit_bytes)

    # ------------------------------------------------------------------ gRPC requests
    def inline(self, request: service_pb2.ModelInferRequest) -> dict[str, OutputPlace]:
        """Replace every shared-memory input of ``request`` by its bytes (raw contents) and
        take the shared-memory parameters off its outputs; returns where each such output
        goes, for ``deliver``.  Every place is checked first, inputs then outputs (Triton's
        order): a bad output region is refused before anything is read or sent."""
        shm_inputs = [t for t in request.inputs if REGION in t.parameters]
        for tensor in shm_inputs:
            self._check_span(*grpc_place(tensor.parameters))
        places = {}
        for output in request.outputs:
            if REGION in output.parameters:
                place = OutputPlace(*grpc_place(output.parameters))
                self._check_span(place.region, place.offset, place.byte_size)
                places[output.name] = place
                for key in SHM_PARAMETERS:
                    output.parameters.pop(key, None)
        if not shm_inputs:
            return places
        raw = iter(request.raw_input_contents)
        contents = []
        for tensor in request.inputs:
            params = tensor.parameters
            if REGION in params:
                region, offset, byte_size = grpc_place(params)
                contents.append(self.read(region, offset, byte_size))
                for key in SHM_PARAMETERS:
                    params.pop(key, None)
            elif tensor.HasField("contents"):
                # Raw contents are all or nothing in one request: typed ones become raw too.
                contents.append(_typed_as_raw(tensor))
                tensor.ClearField("contents")
            else:
                contents.append(next(raw, b""))
        del request.raw_input_contents[:]
        request.raw_input_contents.extend(contents)
        return places

    def deliver(self, response: service_pb2.ModelInferResponse, places: dict[str, OutputPlace]) -> None:
        """Write the outputs asked for in shared memory into their regions; Triton's answer
        for such an output carries no data."""
        for index, output in enumerate(response.outputs):
            place = places.get(output.name)
            if place is not None and index < len(response.raw_output_contents):
                self.write(output.name, place, response.raw_output_contents[index])
                response.raw_output_contents[index] = b""

    # ------------------------------------------------------------------ HTTP requests
    def inline_json(self, doc: dict, binary: bytes) -> tuple[dict, bytes, dict[str, OutputPlace]]:
        """The HTTP request ``doc`` (its binary tensors ``binary``) with shared-memory inputs
        made binary tensors and shared-memory outputs asked for as binary data.  Places are
        checked as in ``inline``; the parameters' types were checked with the request's."""
        doc = dict(doc)
        places = {}
        for tensor in doc.get("inputs", ()):
            params = tensor.get("parameters") or {}
            if REGION in params:
                self._check_span(params[REGION], params.get(OFFSET, 0), params.get(BYTE_SIZE, 0))
        if any(REGION in (o.get("parameters") or {}) for o in doc.get("outputs", ())):
            outputs = []
            for output in doc["outputs"]:
                params = output.get("parameters") or {}
                if REGION in params:
                    place = OutputPlace(params[REGION], params.get(OFFSET, 0), params.get(BYTE_SIZE, 0))
                    self._check_span(place.region, place.offset, place.byte_size)
                    places[output["name"]] = place
                    rest = {k: v for k, v in params.items() if k not in SHM_PARAMETERS}
                    output = dict(output, parameters=dict(rest, binary_data=True))
                outputs.append(output)
            doc["outputs"] = outputs
        if not any(REGION in (i.get("parameters") or {}) for i in doc.get("inputs", ())):
            return doc, binary, places
        inputs, parts, cursor = [], [], 0
        for tensor in doc["inputs"]:
            params = tensor.get("parameters") or {}
            if REGION in params:
                data = self.read(params[REGION], params.get(OFFSET, 0), params.get(BYTE_SIZE, 0))
                rest = {k: v for k, v in params.items() if k not in SHM_PARAMETERS}
                tensor = dict(tensor, parameters=dict(rest, binary_data_size=len(data)))
                parts.append(data)
            elif "binary_data_size" in params:
                size = params["binary_data_size"]
                parts.append(binary[cursor:cursor + size])
                cursor += size
            inputs.append(tensor)
        doc["inputs"] = inputs
        return doc, b"".join(parts), places

    def deliver_json(self, out: dict, binary: bytes, places: dict[str, OutputPlace]) -> bytes:
        """Write the outputs asked for in shared memory (binary in Triton's answer) into their
        regions; returns the binary tensors left for the client.  ``out`` loses those
        outputs' data parameters, as Triton answers."""
        kept, cursor = [], 0
        for output in out.get("outputs", ()):
            params = output.get("parameters") or {}
            size = params.get("binary_data_size")
            if size is None:
                continue
            data = binary[cursor:cursor + size]
            cursor += size
            if output.get("name") in places:
                self.write(output["name"], places[output["name"]], data)
                output.pop("parameters")
            else:
                kept.append(data)
        return b"".join(kept)


def _within_limit(region_bytes: int, request_bytes: int, limit_bytes: int) -> None:
    if region_bytes + request_bytes > limit_bytes:
        raise PayloadTooLarge(
            f"request reads {region_bytes} bytes from shared memory, {region_bytes + request_bytes} "
            f"bytes with its own {request_bytes}, over the router's limit of {limit_bytes} bytes per "
            "request: send smaller batches, or raise the router's --max-request-bytes")


_TYPED_FIELDS = {"BOOL": "bool_contents", "INT8": "int_contents", "INT16": "int_contents",
                 "INT32": "int_contents", "INT64": "int64_contents", "UINT8": "uint_contents",
                 "UINT16": "uint_contents", "UINT32": "uint_contents", "UINT64": "uint64_contents",
                 "FP32": "fp32_contents", "FP64": "fp64_contents"}


def _typed_as_raw(tensor: service_pb2.ModelInferRequest.InferInputTensor) -> bytes:
    if tensor.datatype == "BYTES":
        return serialize_byte_tensor(np.array(list(tensor.contents.bytes_contents), dtype=np.object_)).item()
    field = _TYPED_FIELDS.get(tensor.datatype)
    if field is None:
        raise SharedMemoryError(grpc.StatusCode.INVALID_ARGUMENT,
                                f"unexpected datatype {tensor.datatype} for input '{tensor.name}'")
    return np.array(getattr(tensor.contents, field), dtype=triton_to_np_dtype(tensor.datatype)).tobytes()
