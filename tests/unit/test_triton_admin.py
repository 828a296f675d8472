"""TritonAdmin's translation of tritonclient errors (a fake client: no sockets)."""

from __future__ import annotations

import pytest
from tritonclient.utils import InferenceServerException

from control_plane.triton.admin import TritonAdmin, TritonModelState
from domain.errors import (
    ControlPlaneError,
    ModelLoadFailed,
    OperationTimeout,
    TritonUnavailable,
)
from tests.conftest import run


class RaisingClient:
    """Every model-control call fails with the given InferenceServerException."""

    def __init__(self, exc: InferenceServerException):
        self.exc = exc

    async def unload_model(self, *args, **kwargs):
        raise self.exc

    async def load_model(self, *args, **kwargs):
        raise self.exc

    async def close(self):
        pass


def admin_raising(msg: str, status: str) -> TritonAdmin:
    admin = TritonAdmin("127.0.0.1:1")
    admin._client = RaisingClient(InferenceServerException(msg, status=status))
    return admin


@pytest.mark.parametrize("op", ["load", "unload"])
@pytest.mark.parametrize("status, error", [
    ("StatusCode.INTERNAL", ModelLoadFailed),
    ("StatusCode.UNAVAILABLE", TritonUnavailable),
    ("StatusCode.DEADLINE_EXCEEDED", OperationTimeout),
])
def test_model_control_errors_are_translated_once(op, status, error):
    admin = admin_raising("failed to unload 'm1': stub crashed", status)
    with pytest.raises(error) as caught:
        run(getattr(admin, op)("m1"))
    assert isinstance(caught.value, ControlPlaneError)
    assert "m1" in caught.value.message


def test_unload_of_a_model_that_is_not_loaded_is_success():
    admin = admin_raising("failed to unload 'm1', unknown model", "StatusCode.INTERNAL")
    assert run(admin.unload("m1")) is None


# --------------------------------------------------------------------------- warm-up
PICKY = """
name: "picky"
backend: "python"
max_batch_size: 0
input [
  { name: "INPUT0" data_type: TYPE_INT32 dims: [ 16 ] },
  { name: "INPUT1" data_type: TYPE_STRING dims: [ -1 ] }
]
output [ { name: "OUTPUT0" data_type: TYPE_INT32 dims: [ 16 ] } ]
"""
OWN_WARMUP = """
model_warmup [ {
  name: "random"
  batch_size: 1
  inputs { key: "INPUT0" value { data_type: TYPE_INT32 dims: [ 16 ] random_data: true } }
} ]
"""
OFF = 'parameters { key: "mms_warmup" value: { string_value: "false" } }'


def parsed(text: str):
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    return text_format.Parse(text, model_config_pb2.ModelConfig())


def test_warmup_plan_follows_the_models_config():
    from control_plane.triton.admin import warmup_plan

    plain = warmup_plan(parsed(PICKY))
    assert plain.model_samples == 0 and plain.synthetic_enabled
    assert [(i.name, i.shape, i.datatype) for i in plain.inputs] == [
        ("INPUT0", (16,), "INT32"), ("INPUT1", (1,), "BYTES")]
    assert warmup_plan(parsed(PICKY + OWN_WARMUP)).model_samples == 1
    assert not warmup_plan(parsed(PICKY + OFF)).synthetic_enabled
    batched = warmup_plan(parsed(PICKY.replace("max_batch_size: 0", "max_batch_size: 8")))
    assert batched.inputs[0].shape == (1, 16)


class WarmupClient:
    """get_model_config answers from a config; infer refuses like a picky model."""

    def __init__(self, config_text: str):
        self.config = parsed(config_text)

    async def get_model_config(self, model, *args, **kwargs):
        from tritonclient.grpc import service_pb2

        return service_pb2.ModelConfigResponse(config=self.config)

    async def infer(self, model, inputs, *args, **kwargs):
        raise InferenceServerException("all-zero input is not a valid request",
                                       status="StatusCode.INTERNAL")

    async def close(self):
        pass


def test_failed_synthetic_warmup_says_what_it_sent_and_how_to_turn_it_off():
    admin = TritonAdmin("127.0.0.1:1")
    admin._client = WarmupClient(PICKY)
    with pytest.raises(ModelLoadFailed) as caught:
        run(admin.warmup("picky"))
    message = caught.value.message
    for needle in ("all-zero input", "INPUT0", "[16]", "INT32", "INPUT1", "BYTES",
                   "model_warmup", 'key: "mms_warmup"', 'string_value: "false"'):
        assert needle in message, (needle, message)


def test_hidden_folders_in_the_repository_are_not_models():
    from tritonclient.grpc import service_pb2

    asked = []

    class IndexStub:
        async def RepositoryIndex(self, request, **_kwargs):
            asked.append(request.ready)
            return service_pb2.RepositoryIndexResponse(models=[
                service_pb2.RepositoryIndexResponse.ModelIndex(name="cust001", state="READY"),
                service_pb2.RepositoryIndexResponse.ModelIndex(name=".mms-staging"),
                service_pb2.RepositoryIndexResponse.ModelIndex(name=".cust002.tmp")])

    admin = TritonAdmin("127.0.0.1:1")
    admin._stub = IndexStub()
    assert set(run(admin.index())) == {"cust001"}
    assert run(admin.index(ready_only=True))["cust001"].state == TritonModelState.READY
    assert asked == [False, True]  # only the loaded models, when that is all a pass needs
