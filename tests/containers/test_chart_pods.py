"""The Helm chart's pods, started: the chart rendered by the real helm with the values for a
machine without GPUs (deploy/helm/mmserve/ci/podman-cpu-values.yaml), its Triton, control
plane and router pods run by `podman kube play` from the images `make images` builds, beside
a PostgreSQL pod (the chart expects the user's database).  A model registered as an operator
would (its folder copied into the control plane's pod, `mmctl registry add` run there) is
served through the router's port to Triton's own gRPC and HTTP clients, every answer checked
against the model's weights; what kube play cannot run is listed, and was validated only
(tests/unit/test_deploy_chart.py).  See tests/containers/kube_play.py for what becomes what."""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import yaml

from control_plane.triton.launch import free_port
from tests.containers.engine import podman
from tests.containers.kube_play import CHART, play, render
from tests.helm import helm_binary
from tests.reference import expected_scores, scores_match

pytestmark = [pytest.mark.containers, pytest.mark.timeout(1800)]

ROOT = Path(__file__).resolve().parents[2]
POSTGRES_IMAGE = "localhost/mms-test-postgres:15"
VALUES = CHART / "ci" / "podman-cpu-values.yaml"
MODELS = ["cust001", "cust002"]
READY_TIMEOUT_S = 300


@pytest.fixture(scope="module")
def postgres_image(images):
    podman("build", "-t", POSTGRES_IMAGE, str(ROOT / "tests" / "containers" / "postgres"), timeout=900)
    return POSTGRES_IMAGE


def postgres_pod(name: str, password: str) -> dict:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
            "spec": {"containers": [{"name": "postgres", "image": POSTGRES_IMAGE, "env": [
                {"name": "POSTGRES_USER", "value": "mms"},
                {"name": "POSTGRES_PASSWORD", "value": password}]}]}}


def wait_ready(url: str, what, timeout_s: float = READY_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if requests.get(url, timeout=2).status_code == 200:
                return
        except requests.RequestException:
            pass
        assert time.monotonic() < deadline, f"{url} was not ready in {timeout_s}s:\n{what()}"
        time.sleep(1)


@pytest.fixture(scope="module")
def chart(images, postgres_image, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("chart")
    release = f"mmt{uuid.uuid4().hex[:6]}"
    password = uuid.uuid4().hex
    database = f"{release}-postgres"
    overrides = workdir / "values.yaml"
    overrides.write_text(yaml.safe_dump(
        {"postgres": {"url": f"postgresql://mms:{password}@{database}:5432/mms"}}))
    docs = render(helm_binary(), release, "default", [VALUES, overrides])
    ports = {"http": free_port(), "grpc": free_port(), "admin": free_port()}
    played = play(docs, "default", f"{release}-net", workdir,
                  extra=[postgres_pod(database, password)],
                  publish={f"{release}-router": {"http": ports["http"], "grpc": ports["grpc"]},
                           f"{release}-admin": {"admin": ports["admin"]}})
    try:
        def logs() -> str:
            return "\n".join(played.logs(pod, name, 30) for pod, name in (
                (f"{release}-admin", "control-plane"), (f"{release}-router", "router"),
                (f"{release}-triton-0.{release}-triton.default.svc", "triton")))

        wait_ready(f"http://127.0.0.1:{ports['http']}/v2/health/ready", logs)
        yield played, release, ports, logs
    finally:
        played.down()


def register(played, release: str, source: Path, model: str) -> None:
    """As an operator with kubectl: the folder copied into the control plane's pod, then
    `mmctl registry add` there (the pod's admin token is in its environment)."""
    container = played.container(f"{release}-admin", "control-plane")
    podman("cp", str(source / model), f"{container}:/tmp/{model}")
    out = podman("exec", container, "mmctl", "registry", "add", model, "--from-dir", f"/tmp/{model}", "--json")
    assert json.loads(out.stdout)["stage"] == "production", out.stdout


def test_the_charts_pods_serve_a_registered_model_to_tritons_clients(chart, tmp_path):
    from control_plane.demo import write_demo_repository

    played, release, ports, logs = chart
    assert played.validated_only == sorted(
        [f"NetworkPolicy {release}-{c}" for c in ("control-plane", "router", "triton")]
        + [f"Service {release}-{s}" for s in ("admin", "router", "triton")]
        + [f"ServiceAccount {release}-control-plane"])
    source = tmp_path / "models"
    write_demo_repository(source, len(MODELS), layout="models")
    for model in MODELS:
        register(played, release, source, model)

    grpc = grpcclient.InferenceServerClient(f"127.0.0.1:{ports['grpc']}")
    http = httpclient.InferenceServerClient(f"127.0.0.1:{ports['http']}", network_timeout=120)
    for seed, model in enumerate(MODELS * 2):
        x = np.random.default_rng(seed).standard_normal((2, 64)).astype(np.float32)
        want = expected_scores(source, model, x, layout="models")
        g = grpcclient.InferInput("FEATURES", list(x.shape), "FP32")
        g.set_data_from_numpy(x)
        h = httpclient.InferInput("FEATURES", list(x.shape), "FP32")
        h.set_data_from_numpy(x)
        try:
            by_grpc = grpc.infer(model, [g], client_timeout=120).as_numpy("SCORES")
        except Exception as exc:
            raise AssertionError(f"{model} over gRPC: {exc}\n{logs()}") from exc
        by_http = http.infer(model, [h]).as_numpy("SCORES")
        assert scores_match(by_grpc, want), f"{model} over gRPC: not its weights' answer"
        assert scores_match(by_http, want), f"{model} over HTTP: not its weights' answer"

    # The admin API answers with the token only; nothing but the router's ports and the
    # admin port's stand-in for a port-forward is published, and those on loopback only.
    admin = f"http://127.0.0.1:{ports['admin']}"
    assert requests.get(admin + "/v1/status", timeout=5).status_code == 401
    published = set()
    for pod in played.pods:
        out = podman("pod", "inspect", "--format", "{{range .Containers}}{{.Name}} {{end}}", pod).stdout
        for container in out.split():
            published |= set(podman("port", container, check=False).stdout.split("\n")) - {""}
    assert published == {f"{p}/tcp -> 127.0.0.1:{ports[name]}" for name, p in
                         (("http", 8000), ("grpc", 8001), ("admin", 8090))}, published


def test_down_leaves_no_pod_volume_or_secret(chart):
    played, release = chart[0], chart[1]
    played.down()
    assert podman("pod", "ps", "-q", "--filter", f"name={release}").stdout.strip() == ""
    volumes = podman("volume", "ls", "--format", "{{.Name}}").stdout.split()
    assert not [v for v in volumes if v.startswith(release)]
    secrets = podman("secret", "ls", "--format", "{{.Name}}").stdout.split()
    assert not [s for s in secrets if s.startswith(release)]
