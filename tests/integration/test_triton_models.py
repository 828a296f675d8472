"""Models written for Triton load in the launcher's tritonserver with no edits.

The fixture ``tests/fixtures/models/simple`` is Triton's add_sub shape: ``import numpy`` and
``triton_python_backend_utils``, no path set-up, its own ``model_warmup``.  Its packages come
from the environment the product runs in (a virtualenv here), which the python-backend stub
only sees because the launcher gives it that environment.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from control_plane.triton_process import TritonLaunchConfig, TritonProcess, which_tritonserver

tritonclient_grpc = pytest.importorskip("tritonclient.grpc")
tritonclient_http = pytest.importorskip("tritonclient.http")

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(which_tritonserver() is None, reason="no tritonserver binary"),
]

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "models"


@pytest.fixture(scope="module")
def simple_triton(tmp_path_factory):
    root = tmp_path_factory.mktemp("simple")
    repository = root / "repository"
    shutil.copytree(FIXTURES / "simple", repository / "simple", ignore=shutil.ignore_patterns("README.md"))
    triton = TritonProcess(TritonLaunchConfig(repository=repository, work_dir=root / "work"))
    triton.start()
    try:
        yield triton
    finally:
        triton.stop()
        assert not triton.alive(), "tritonserver was left running"


def _inputs(module, a, b):
    inputs = [module.InferInput("INPUT0", [16], "INT32"), module.InferInput("INPUT1", [16], "INT32")]
    inputs[0].set_data_from_numpy(a)
    inputs[1].set_data_from_numpy(b)
    return inputs


def test_plain_numpy_model_loads_unchanged_and_answers(simple_triton):
    a = np.arange(16, dtype=np.int32)
    b = np.full(16, 3, dtype=np.int32)
    grpc = tritonclient_grpc.InferenceServerClient(simple_triton.grpc_url)
    grpc.load_model("simple")  # raised "No module named 'numpy'" before the stub got the environment
    assert grpc.is_model_ready("simple")
    # Triton ran the model's own model_warmup during the load: one execution, no client yet.
    stats = grpc.get_inference_statistics("simple", as_json=True)["model_stats"][0]
    assert stats["execution_count"] == "1", stats

    result = grpc.infer("simple", _inputs(tritonclient_grpc, a, b))
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), a + b)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), a - b)

    http = tritonclient_http.InferenceServerClient(simple_triton.http_url)
    result = http.infer("simple", _inputs(tritonclient_http, a, b))
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), a + b)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), a - b)
