"""The production shape, run: `make images` builds the two images with podman (the base made
by debootstrap where no registry answers) and docker/compose.yaml serves the demo fleet from
them, as `make up-docker` does.  Triton's own clients talk to the router's published ports
over gRPC and HTTP, every answer checked against the variant's weights in the models
volume; the admin API answers `compose exec control-plane mmctl` and nothing outside; a
Triton killed as a crash kills it comes back and its models are served again; Ctrl-C leaves
no container.

The images are built once per machine and then taken from the engine's cache (unchanged
sources give the same wheels, the same layers)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from control_plane.triton.launch import free_port
from tests.containers.engine import engine_env, podman
from tests.reference import expected_scores, scores_match

# The images' first build on a machine takes minutes (pip byte-compiles torch), more where
# the rest of the suite runs beside it: past pytest's default limit.
pytestmark = [pytest.mark.containers, pytest.mark.timeout(1800)]

ROOT = Path(__file__).resolve().parents[2]
FLEET = ["cust001", "cust002", "cust003", "cust004"]
READY_TIMEOUT_S = 240
BACK_WITHIN_S = 90  # the bound on a killed Triton's comeback


def features(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((2, 64)).astype(np.float32)


class Compose:
    """docker/compose.yaml under its own project name, ports and fleet size."""

    def __init__(self, project: str, env: dict[str, str]):
        self.project = project
        self.env = dict(engine_env(), **env)
        self.up: subprocess.Popen | None = None  # docker/compose_up.py, as make up-docker runs it
        self.up_log = None

    @property
    def command(self) -> list[str]:
        return [str(Path(sys.executable).parent / "podman-compose"), "-p", self.project,
                "-f", str(ROOT / "docker" / "compose.yaml")]

    def __call__(self, *args: str, timeout: float = 300, check: bool = True) -> subprocess.CompletedProcess:
        result = subprocess.run([*self.command, *args], capture_output=True, text=True, env=self.env,
                                timeout=timeout, check=False)
        if check and result.returncode != 0:
            raise AssertionError(f"{' '.join(args)} failed ({result.returncode}):\n"
                                 f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
        return result

    def containers(self) -> list[str]:
        out = podman("ps", "-a", "--filter", f"label=io.podman.compose.project={self.project}",
                     "--format", "{{.Names}}").stdout
        return out.split()

    def container(self, service: str) -> str:
        (name,) = [n for n in self.containers() if n.startswith(f"{self.project}_{service}_")]
        return name

    def logs(self, service: str) -> str:
        result = podman("logs", "--tail", "60", self.container(service), check=False)
        return result.stdout + result.stderr


@pytest.fixture(scope="module")
def stack(images, tmp_path_factory):
    project = f"mmstest{uuid.uuid4().hex[:8]}"
    http_port, grpc_port = free_port(), free_port()
    compose = Compose(project, {"MMS_HTTP_PORT": str(http_port), "MMS_GRPC_PORT": str(grpc_port),
                                "MMS_FLEET_SIZE": str(len(FLEET)), "MMS_MAX_LOADED": "3"})
    # In the foreground as `make up-docker` runs it (docker/compose_up.py), in a session of
    # its own: the last test sends it the terminal's Ctrl-C.
    log = open(tmp_path_factory.mktemp("compose") / "up.log", "w+")  # noqa: SIM115 - read by the tests
    compose.up = subprocess.Popen([sys.executable, str(ROOT / "docker" / "compose_up.py"), *compose.command],
                                  env=compose.env, stdout=log, stderr=subprocess.STDOUT,
                                  start_new_session=True)
    compose.up_log = log
    try:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while True:
            try:
                if requests.get(f"http://127.0.0.1:{http_port}/v2/health/ready", timeout=2).status_code == 200:
                    break
            except requests.RequestException:
                pass
            assert time.monotonic() < deadline, (
                f"the router was not ready in {READY_TIMEOUT_S}s:\n" + compose.logs("control-plane")
                + "\n" + compose.logs("triton"))
            time.sleep(1)
        models = Path(podman("volume", "inspect", "--format", "{{.Mountpoint}}", f"{project}_models").stdout.strip())
        yield compose, http_port, grpc_port, models
    finally:
        if compose.up.poll() is None:
            os.killpg(compose.up.pid, signal.SIGTERM)
            compose.up.wait(300)
        compose("down", "-v", timeout=300, check=False)
        log.close()


def grpc_scores(port: int, model: str, x: np.ndarray) -> np.ndarray:
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{port}")
    tensor = grpcclient.InferInput("FEATURES", list(x.shape), "FP32")
    tensor.set_data_from_numpy(x)
    return client.infer(model, [tensor], client_timeout=60).as_numpy("SCORES")


def http_scores(port: int, model: str, x: np.ndarray) -> np.ndarray:
    client = httpclient.InferenceServerClient(f"127.0.0.1:{port}", network_timeout=60)
    tensor = httpclient.InferInput("FEATURES", list(x.shape), "FP32")
    tensor.set_data_from_numpy(x)
    return client.infer(model, [tensor]).as_numpy("SCORES")


def assert_served(stack, seed: int) -> None:
    _compose, http_port, grpc_port, models = stack
    for i, model in enumerate(FLEET):
        x = features(seed + i)
        want = expected_scores(models, model, x)
        for name, answer in (("grpc", grpc_scores(grpc_port, model, x)),
                             ("http", http_scores(http_port, model, x))):
            assert scores_match(answer, want), f"{model} over {name}: not the variant's answer"


def test_the_images_carry_what_each_needs_and_run_as_a_user(images):
    control_plane = podman("run", "--rm", "--entrypoint", "python3", "localhost/mmserve:latest", "-c",
                           "import importlib.util, os; print(os.getuid(), "
                           "[m for m in ('torch', 'pytriton', 'mmctl', 'router') if importlib.util.find_spec(m)])")
    assert control_plane.stdout.split(None, 1) == ["10001", "['mmctl', 'router']\n"]
    triton = podman("run", "--rm", "--entrypoint", "python3", "localhost/mmserve-triton:latest", "-c",
                    "import importlib.util, os; print(os.getuid(), "
                    "[m for m in ('torch', 'pytriton', 'safetensors') if importlib.util.find_spec(m)])")
    assert triton.stdout.split(None, 1) == ["10001", "['torch', 'pytriton', 'safetensors']\n"]
    for image in ("localhost/mmserve:latest", "localhost/mmserve-triton:latest"):
        compilers = podman("run", "--rm", "--entrypoint", "sh", image, "-c",
                           "command -v gcc cc c++ clang || true").stdout.strip()
        assert compilers == "", f"{image} carries a compiler: {compilers}"


def test_compose_serves_the_demo_fleet_and_a_killed_triton_comes_back(stack):
    compose, http_port = stack[0], stack[1]
    assert_served(stack, seed=1)

    # The admin API: in the control-plane container (its loopback), with the token of the
    # state volume; not on the router's published ports.
    status = compose("exec", "-T", "control-plane", "mmctl", "status", "--json")
    body = json.loads(status.stdout)
    models = body["models"] if isinstance(body, dict) else body
    loaded = {m["model"] for m in models if m["state"].upper() == "READY"}
    assert loaded & set(FLEET), status.stdout
    assert requests.get(f"http://127.0.0.1:{http_port}/v1/status", timeout=5).status_code in (403, 404)

    # A crash: Triton's process killed from outside (not `podman kill`, which podman counts
    # as a stop by hand and never restarts).
    triton = compose.container("triton")
    pid = int(podman("inspect", "--format", "{{.State.Pid}}", triton).stdout)
    os.kill(pid, signal.SIGKILL)
    killed = time.monotonic()
    while True:
        try:
            assert_served(stack, seed=7)
            break
        except (InferenceServerException, AssertionError) as exc:
            assert time.monotonic() - killed < BACK_WITHIN_S, (
                f"not served again {BACK_WITHIN_S}s after Triton was killed: {exc}\n" + compose.logs("triton"))
            time.sleep(2)
    restarts = int(podman("inspect", "--format", "{{.RestartCount}}", triton).stdout)
    assert restarts >= 1
    print(f"served again {time.monotonic() - killed:.1f}s after Triton was killed")


def test_an_adapter_added_in_the_control_plane_container_is_served_with_its_weights(stack, tmp_path):
    """The control-plane image has no torch: `mmctl adapter add` there checks a PEFT folder
    against its base's layers, refuses one made for another base with the reason, and the
    router serves the one it took with the base's weights and the adapter's update."""
    from safetensors.torch import load_file

    from control_plane.demo.lora import write_demo_adapter
    from model_runtime.lora.base_layers import linear_layers
    from model_runtime.lora.peft import merged_state_dict, read_adapter
    from tests.reference import mlp_scores

    compose, grpc_port, models = stack[0], stack[2], stack[3]
    base_file = models / "recommender_lora" / "1" / "weights.safetensors"
    folder = write_demo_adapter(tmp_path / "right", "recommender_lora", "extra", rank=4)
    wrong = ROOT / "tests" / "fixtures" / "adapters" / "acme"  # a tinylm adapter
    container = compose.container("control-plane")
    podman("cp", str(folder), f"{container}:/tmp/extra")
    podman("cp", str(wrong), f"{container}:/tmp/wrong")

    added = compose("exec", "-T", "control-plane", "mmctl", "adapter", "add", "extra",
                    "--base", "recommender_lora", "--path", "/tmp/extra", "--json")
    row = json.loads(added.stdout)
    assert (row["name"], row["rank"]) == ("extra", 4), added.stdout
    refused = compose("exec", "-T", "control-plane", "mmctl", "adapter", "add", "wrong",
                      "--base", "recommender_lora", "--path", "/tmp/wrong", check=False)
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert "name no linear layer of recommender_lora" in refused.stdout + refused.stderr

    adapter = read_adapter(folder, linear_layers(base_file))
    for seed in (21, 22):
        x = features(seed)
        want = mlp_scores(merged_state_dict(load_file(str(base_file)), adapter), x)
        answer = grpc_scores(grpc_port, "recommender_lora:extra", x)
        assert scores_match(answer, want), "recommender_lora:extra: not the adapted weights' answer"


def test_ctrl_c_removes_every_container_before_it_returns(stack):
    """`make up-docker`'s Ctrl-C: the terminal's SIGINT to the whole foreground group (compose
    and its podman processes too); once it has returned, no container is left."""
    compose = stack[0]
    assert len(compose.containers()) == 2  # triton, control-plane
    os.killpg(compose.up.pid, signal.SIGINT)
    code = compose.up.wait(300)
    left = compose.containers()
    compose.up_log.seek(0)
    said = compose.up_log.read()
    assert left == [], f"left after Ctrl-C: {left}\n{said[-3000:]}"
    assert code == 128 + signal.SIGINT and "removing the stack's containers" in said, said[-3000:]
