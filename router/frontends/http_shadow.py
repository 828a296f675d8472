"""Mirror a KServe v2 HTTP inference to a route's shadow, as gRPC mirrors are.

The shadow mirror (``router.rollouts.shadow``) sends serialized gRPC ModelInferRequests and
compares the shadow's outputs with the primary's as (name, datatype, raw bytes).  An HTTP
request chosen for mirroring (its decision has a shadow) is therefore converted, and only
when the mirror is sent (a mirror shed or dropped at the offer costs nothing): its JSON header and binary tensors become the ModelInferRequest tritonclient.grpc
would build for the same inputs (every input in ``raw_input_contents``; BYTES elements with
Triton's 4-byte little-endian length prefix), addressed to the shadow.  The primary's JSON
answer is kept as it is (a shallow copy) and turned into raw bytes in the shadow's analysis
thread, not on the serving loop.

A raw binary request (Inference-Header-Content-Length: 0) names no input, so it is not
mirrored.  Shared-memory tensors have been inlined before this runs
(``router.frontends.http_inference``).
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from functools import partial

import numpy as np
from tritonclient.grpc import service_pb2
from tritonclient.utils import triton_to_np_dtype

from router.frontends.http_request import InferRequest
from router.frontends.http_request_checks import flat_row_major
from router.rollouts.shadow import Outputs
from router.serving.inference_pipeline import Target

# HTTP-only parameters: how the tensors travel in the HTTP body, nothing gRPC carries.
_HTTP_ONLY = ("binary_data_output", "binary_data", "binary_data_size")


def json_tensor_bytes(datatype: str, data: list) -> bytes:
    """A JSON tensor's ``data`` as Triton's raw bytes (BYTES: length-prefixed elements)."""
    flat = flat_row_major(data)
    if datatype == "BYTES":
        items = [v.encode("utf-8", "surrogatepass") if isinstance(v, str) else bytes(v) for v in flat]
        return b"".join(struct.pack("<I", len(v)) + v for v in items)
    return np.array(flat, dtype=triton_to_np_dtype(datatype)).tobytes()


def _set_parameter(param: service_pb2.InferParameter, key: str, value) -> None:
    if isinstance(value, bool):
        param.bool_param = value
    elif isinstance(value, int):
        if key == "priority":  # as tritonclient sends it
            param.uint64_param = value
        else:
            param.int64_param = value
    elif isinstance(value, float):
        param.double_param = value
    else:
        param.string_param = str(value)


def _copy_parameters(target, parameters: dict | None) -> None:
    for key, value in (parameters or {}).items():
        if key not in _HTTP_ONLY:
            _set_parameter(target[key], key, value)


def grpc_request(doc: dict, binary: bytes, model_name: str,
                 parameters: dict[str, str] | None = None) -> service_pb2.ModelInferRequest:
    """The checked HTTP request ``doc`` (binary tensors ``binary``, in input order) as a
    ModelInferRequest for ``model_name``, with ``parameters`` added to the request's own."""
    request = service_pb2.ModelInferRequest(model_name=model_name)
    if doc.get("id"):
        request.id = doc["id"]
    _copy_parameters(request.parameters, doc.get("parameters"))
    for key, value in (parameters or {}).items():
        request.parameters[key].string_param = value
    cursor = 0
    for tensor in doc.get("inputs", ()):
        params = tensor.get("parameters") or {}
        grpc_input = request.inputs.add(name=tensor["name"], datatype=tensor["datatype"],
                                        shape=tensor["shape"])
        _copy_parameters(grpc_input.parameters, params)
        if "binary_data_size" in params:
            size = params["binary_data_size"]
            request.raw_input_contents.append(binary[cursor:cursor + size])
            cursor += size
        else:
            request.raw_input_contents.append(json_tensor_bytes(tensor["datatype"], tensor["data"]))
    for output in doc.get("outputs", ()):
        grpc_output = request.outputs.add(name=output["name"])
        _copy_parameters(grpc_output.parameters, output.get("parameters"))
    return request


def outputs_of_json(outputs: list[dict], binary: bytes) -> Outputs:
    """An HTTP answer's outputs (its JSON ``outputs``, the binary tensors after the header)
    as the shadow compares them: (name, datatype, raw bytes)."""
    result, cursor = [], 0
    for output in outputs:
        size = (output.get("parameters") or {}).get("binary_data_size")
        if size is not None:
            raw = binary[cursor:cursor + size]
            cursor += size
        else:
            raw = json_tensor_bytes(output["datatype"], output.get("data", []))
        result.append((output["name"], output["datatype"], raw))
    return result


def primary_outputs(out: dict, binary: bytes) -> Callable[[], Outputs]:
    """The primary's outputs, converted when called (in the shadow's analysis thread).  The
    output entries are copied now: the answer's JSON is changed before it is sent
    (shared-memory outputs lose their parameters)."""
    return partial(outputs_of_json, [dict(o) for o in out.get("outputs", ())], binary)


def shadow_request(parsed: InferRequest, target: Target) -> Callable[[], bytes] | None:
    """The HTTP request ``parsed`` (its shared-memory inputs inlined) as the ModelInferRequest
    the shadow at ``target`` gets, built when the mirror is sent; None for a raw binary
    request, which names no input."""
    if parsed.header_length == 0:
        return None
    return partial(_serialized_request, parsed.doc, parsed.body, parsed.header_length,
                   target.model, target.parameters)


def _serialized_request(doc: dict, body: bytes, header_length: int, model_name: str,
                        parameters: dict[str, str]) -> bytes:
    binary = body[header_length:] if header_length else b""  # None: a JSON-only request
    return grpc_request(doc, binary, model_name, parameters).SerializeToString()
