"""TritonAdmin's translation of tritonclient errors (a fake client: no sockets)."""

from __future__ import annotations

import pytest
from tritonclient.utils import InferenceServerException

from control_plane.errors import ControlPlaneError, ModelLoadFailed, OperationTimeout, TritonUnavailable
from control_plane.triton_admin import TritonAdmin
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
