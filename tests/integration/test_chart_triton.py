"""The Helm chart's Triton command line on the real tritonserver (the wheel's Triton is the
NGC 24.10 image's release, 2.51): every flag is accepted, and model control answers only
with the admin key, on gRPC and HTTP, while inference needs none."""

from __future__ import annotations

import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from control_plane.triton.admin import admin_key_headers
from control_plane.triton.process import TritonLaunchConfig, TritonProcess, free_port
from tests.unit.test_deploy_chart import POSTGRES_URL, Rendered

pytestmark = pytest.mark.integration

KEY = "chart-admin-key"


@pytest.fixture
def chart_triton(repository, tmp_path):
    rendered = Rendered("mm", "--set-string", f"postgres.url={POSTGRES_URL}")
    args = rendered.container("StatefulSet", "mm-triton")["args"]
    assert args[0] == "tritonserver"
    ports = {"8000": free_port(), "8001": free_port(), "8002": free_port()}
    chart_args = []
    for arg in args[1:]:
        arg = arg.replace("$(TRITON_ADMIN_KEY)", KEY).replace("=/models", f"={repository}")
        flag, _, value = arg.partition("=")
        if flag in ("--http-port", "--grpc-port", "--metrics-port"):
            arg = f"{flag}={ports[value]}"
        chart_args.append(arg)
    # The launcher's own flags come first; the chart's, later on the line, take precedence.
    proc = TritonProcess(TritonLaunchConfig(repository=repository, work_dir=tmp_path / "triton",
                                            http_port=ports["8000"], grpc_port=ports["8001"],
                                            metrics_port=ports["8002"], extra_args=chart_args))
    proc.start()
    yield proc
    proc.stop()


def test_the_charts_triton_flags_start_triton_and_lock_model_control(chart_triton):
    client = grpcclient.InferenceServerClient(chart_triton.grpc_url)
    with pytest.raises(InferenceServerException, match="restricted"):
        client.load_model("identity")
    refused = requests.post(f"http://{chart_triton.http_url}/v2/repository/models/identity/load",
                            timeout=30)
    assert refused.status_code >= 400 and "restricted" in refused.text.lower()
    with pytest.raises(InferenceServerException, match="restricted"):  # the victim's memory
        client.register_system_shared_memory("r", "/mms-chart", 64)
    for path in ("/v2/logging", "/v2/trace/setting", "/v2/systemsharedmemory/status"):
        assert requests.get(f"http://{chart_triton.http_url}{path}", timeout=10).status_code in (401, 403)
    client.load_model("identity", headers=admin_key_headers(KEY))
    assert client.is_model_ready("identity")  # health and inference are not restricted
    x = grpcclient.InferInput("INPUT0", [1, 4], "FP32")
    x.set_data_from_numpy(np.ones((1, 4), np.float32))
    assert client.infer("identity", [x]).as_numpy("OUTPUT0").shape == (1, 4)
    accepted = requests.post(f"http://{chart_triton.http_url}/v2/repository/models/identity/unload",
                             headers={"admin-key": KEY}, timeout=30)
    assert accepted.status_code == 200, accepted.text
    client.close()
