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
import tritonclient.grpc as tritonclient_grpc
import tritonclient.http as tritonclient_http

from control_plane.triton.process import TritonLaunchConfig, TritonProcess

pytestmark = [
    pytest.mark.integration,
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


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    return dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item)


def _children(pid: int) -> list[int]:
    kids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat[stat.rindex(")") + 2 :].split()[1]) == pid:
                kids.append(int(entry.name))
    return kids


def test_no_secret_reaches_triton_or_the_model_stubs(tmp_path, monkeypatch):
    secrets = {"AWS_SECRET_ACCESS_KEY": "aws-secret-value", "AWS_ACCESS_KEY_ID": "AKIAEXAMPLE",
               "MMS_S3_SECRET_ACCESS_KEY": "mms-secret-value", "MMCTL_TOKEN": "admin-token-value"}
    for name, value in secrets.items():
        monkeypatch.setenv(name, value)
    repository = tmp_path / "repository"
    shutil.copytree(FIXTURES / "simple", repository / "simple", ignore=shutil.ignore_patterns("README.md"))
    triton = TritonProcess(TritonLaunchConfig(repository=repository, work_dir=tmp_path / "work"))
    triton.start()
    try:
        tritonclient_grpc.InferenceServerClient(triton.grpc_url).load_model("simple")
        stubs = [pid for pid in _children(triton.proc.pid)
                 if b"triton_python_backend_stub" in Path(f"/proc/{pid}/cmdline").read_bytes()]
        assert stubs, "the model's stub process was not found"
        for pid in [triton.proc.pid, *stubs]:
            env = _environ(pid)
            assert not set(secrets) & set(env), (pid, sorted(set(secrets) & set(env)))
            assert not any(value in env.values() for value in secrets.values())
    finally:
        triton.stop()
