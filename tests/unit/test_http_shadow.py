"""HTTP inferences mirrored to a shadow (router/frontends/http_shadow.py): the HTTP body as
the gRPC request tritonclient would build for the same inputs, the HTTP answer as the raw
outputs the shadow compares.  Pure, no sockets."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.grpc import _utils as grpc_utils
from tritonclient.grpc import service_pb2
from tritonclient.utils import serialize_byte_tensor

from model_runtime.family.protocol import VARIANT_PARAMETER
from router.frontends.http_request import parse_infer_request
from router.frontends.http_shadow import (
    grpc_request,
    outputs_of_json,
    primary_outputs,
    shadow_request,
)
from router.rollouts.shadow import outputs_of
from router.serving.inference_pipeline import InferencePipeline, Target

FEATURES = np.arange(6, dtype=np.float32).reshape(2, 3) / 7
TEXT = np.array([b"hello", "h\u00e9llo".encode(), b""], dtype=np.object_)


def http_body(binary: bool, **options) -> tuple[bytes, str | None]:
    """The body tritonclient.http sends for FEATURES (FP32) and TEXT (BYTES)."""
    x = httpclient.InferInput("FEATURES", list(FEATURES.shape), "FP32")
    x.set_data_from_numpy(FEATURES, binary_data=binary)
    t = httpclient.InferInput("TEXT", list(TEXT.shape), "BYTES")
    t.set_data_from_numpy(TEXT, binary_data=binary)
    outputs = [httpclient.InferRequestedOutput("SCORES", binary_data=binary),
               httpclient.InferRequestedOutput("LABELS", class_count=2)]
    body, json_size = httpclient.InferenceServerClient.generate_request_body([x, t], outputs, **options)
    return body, None if json_size is None else str(json_size)


def tritonclient_grpc_request(model: str, **options) -> service_pb2.ModelInferRequest:
    """What tritonclient.grpc builds for the same inputs."""
    x = grpcclient.InferInput("FEATURES", list(FEATURES.shape), "FP32")
    x.set_data_from_numpy(FEATURES)
    t = grpcclient.InferInput("TEXT", list(TEXT.shape), "BYTES")
    t.set_data_from_numpy(TEXT)
    outputs = [grpcclient.InferRequestedOutput("SCORES"),
               grpcclient.InferRequestedOutput("LABELS", class_count=2)]
    args = {"request_id": "", "sequence_id": 0, "sequence_start": False, "sequence_end": False,
            "priority": 0, "timeout": None, "parameters": None} | options
    return grpc_utils._get_inference_request(model, [x, t], "", outputs=outputs, **args)


def converted(binary: bool, model: str = "shadow", **options) -> service_pb2.ModelInferRequest:
    body, header_length = http_body(binary, **options)
    parsed = parse_infer_request(body, header_length)
    rest = parsed.body[parsed.header_length:] if parsed.header_length else b""
    return grpc_request(parsed.doc, rest, model)


def test_a_json_body_converts_to_the_request_tritonclient_grpc_builds():
    options = {"request_id": "r-1", "priority": 3, "timeout": 2000, "parameters": {"tag": "a", "n": 4}}
    body, header_length = http_body(False, **options)
    assert header_length is None and b'"data"' in body  # the tensors travel as JSON
    assert converted(False, **options) == tritonclient_grpc_request("shadow", **options)


def test_nested_json_data_is_read_row_major():
    doc = {"inputs": [{"name": "FEATURES", "shape": [2, 3], "datatype": "FP32",
                       "data": FEATURES.tolist()},
                      {"name": "TEXT", "shape": [3], "datatype": "BYTES",
                       "data": [v.decode() for v in TEXT]}],
           "outputs": [{"name": "SCORES"}, {"name": "LABELS", "parameters": {"classification": 2}}]}
    parsed = parse_infer_request(json.dumps(doc).encode(), None)
    assert grpc_request(parsed.doc, b"", "shadow") == tritonclient_grpc_request("shadow")


def test_a_binary_tensor_body_converts_to_the_request_tritonclient_grpc_builds():
    body, header_length = http_body(True, sequence_id=9, sequence_start=True)
    assert header_length is not None and int(header_length) < len(body)
    expected = tritonclient_grpc_request("shadow", sequence_id=9, sequence_start=True)
    assert converted(True, sequence_id=9, sequence_start=True) == expected
    assert expected.raw_input_contents[1] == serialize_byte_tensor(TEXT).item()


def test_http_answers_become_the_outputs_the_shadow_compares():
    scores = np.array([0.25, -1.5, 3.0], np.float32)
    ids = np.array([[1, 2], [3, 4]], np.int64)
    labels = np.array([b"0.9:1:cat", b"0.1:0:dog"], dtype=np.object_)
    expected = [("SCORES", "FP32", scores.tobytes()), ("IDS", "INT64", ids.tobytes()),
                ("LABELS", "BYTES", serialize_byte_tensor(labels).item())]
    as_json = [{"name": "SCORES", "datatype": "FP32", "shape": [3], "data": scores.tolist()},
               {"name": "IDS", "datatype": "INT64", "shape": [2, 2], "data": ids.ravel().tolist()},
               {"name": "LABELS", "datatype": "BYTES", "shape": [2], "data": ["0.9:1:cat", "0.1:0:dog"]}]
    assert outputs_of_json(as_json, b"") == expected
    binary = [dict(o, parameters={"binary_data_size": len(raw)}) for o, (_, _, raw) in zip(as_json, expected)]
    for o in binary:
        del o["data"]
    assert outputs_of_json(binary, b"".join(raw for _, _, raw in expected)) == expected
    mixed = [binary[0], as_json[1], binary[2]]
    assert outputs_of_json(mixed, expected[0][2] + expected[2][2]) == expected


def test_the_shadow_request_is_addressed_to_its_target_and_built_when_sent():
    pipeline = InferencePipeline(SimpleNamespace(carrier_of=lambda m: "family" if m == "v2" else None),
                                 decider=None, sender=None, shadow=None)
    body, header_length = http_body(True)
    parsed = parse_infer_request(body, header_length)
    build = shadow_request(parsed, pipeline.target("v2", "", "ad"))
    assert callable(build)  # converted only when the mirror is sent
    request = service_pb2.ModelInferRequest.FromString(build())
    assert request.model_name == "family" and request.model_version == ""
    assert request.parameters[VARIANT_PARAMETER].string_param == "v2"
    assert request.parameters["adapter"].string_param == "ad"
    assert list(request.raw_input_contents) == list(tritonclient_grpc_request("x").raw_input_contents)


def test_the_primary_is_converted_later_from_outputs_copied_now():
    scores = np.array([1.0, 2.0], np.float32)
    out = {"outputs": [{"name": "SCORES", "datatype": "FP32", "shape": [2],
                        "parameters": {"binary_data_size": 8}}]}
    primary = primary_outputs(out, scores.tobytes())
    out["outputs"][0].pop("parameters")  # as the shared-memory delivery does before answering
    assert callable(primary)
    assert outputs_of(primary) == [("SCORES", "FP32", scores.tobytes())]


def test_a_raw_binary_request_is_not_mirrored():
    raw = parse_infer_request(b"\0" * 8, "0")
    assert shadow_request(raw, Target("s", "", {})) is None
