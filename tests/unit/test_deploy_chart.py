"""deploy/helm/mmserve: rendered by the real helm, every manifest validated against the
Kubernetes schemas (kubernetes-validate, strict), and the properties that keep the
deployment safe and working asserted on what was rendered.  No cluster needed.

helm comes from `make setup` (deploy/install_helm.py writes it to .venv/bin/helm).
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from tests.helm import helm_binary

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "helm" / "mmserve"
PROD_VALUES = CHART / "ci" / "mig-existing-secrets-values.yaml"
CPU_VALUES = CHART / "ci" / "podman-cpu-values.yaml"  # what tests/containers/test_chart_pods.py runs
# The oldest Kubernetes the chart is checked against (Chart.yaml asks for >= 1.27; 1.30 is
# the oldest minor with upstream support when this was written).
KUBERNETES_VERSION = "1.30.0"
NAMESPACE = "serving"
POSTGRES_PASSWORD = "pw-must-stay-secret"
POSTGRES_URL = f"postgresql://mms:{POSTGRES_PASSWORD}@db.example:5432/mms"
CREDENTIAL_ENV = {"MMS_ADMIN_TOKEN", "MMS_DATAPLANE_TOKEN", "MMS_STATE_URL", "MMS_TRITON_ADMIN_KEY", "TRITON_ADMIN_KEY",
                  "MMS_S3_ACCESS_KEY_ID", "MMS_S3_SECRET_ACCESS_KEY"}


def helm(*args: str | Path, check: bool = True) -> subprocess.CompletedProcess:
    # check=False: a refusal is what some tests look for; the others fail below with stderr.
    done = subprocess.run([helm_binary(), *map(str, args)], check=False, capture_output=True,
                          text=True, timeout=60)
    if check and done.returncode != 0:
        pytest.fail(f"helm {' '.join(map(str, args))} failed:\n{done.stderr}")
    return done


def template(release: str, *values: str | Path, check: bool = True) -> subprocess.CompletedProcess:
    return helm("template", release, CHART, "--namespace", NAMESPACE,
                "--kube-version", KUBERNETES_VERSION, *values, check=check)


class Rendered:
    """One `helm template` output: the raw text and its documents."""

    def __init__(self, release: str, *values: str | Path):
        self.release = release
        self.text = template(release, *values).stdout
        self.docs = [d for d in yaml.safe_load_all(self.text) if d]

    def all(self, kind: str) -> list[dict]:
        return [d for d in self.docs if d["kind"] == kind]

    def one(self, kind: str, name: str) -> dict:
        found = [d for d in self.all(kind) if d["metadata"]["name"] == name]
        assert len(found) == 1, f"expected one {kind} {name}, found {len(found)}"
        return found[0]

    def container(self, kind: str, name: str) -> dict:
        containers = self.one(kind, name)["spec"]["template"]["spec"]["containers"]
        assert len(containers) == 1
        return containers[0]

    def workloads(self) -> list[dict]:
        return [d for d in self.docs if d["kind"] in ("Deployment", "StatefulSet", "DaemonSet")]

    def pod_labels(self, component: str) -> dict:
        [workload] = [w for w in self.workloads()
                      if w["spec"]["template"]["metadata"]["labels"].get(
                          "app.kubernetes.io/component") == component]
        return workload["spec"]["template"]["metadata"]["labels"]


@pytest.fixture(scope="module")
def default() -> Rendered:
    """The defaults, plus the one value without a default (PostgreSQL)."""
    return Rendered("mm", "--set-string", f"postgres.url={POSTGRES_URL}")


@pytest.fixture(scope="module")
def prod() -> Rendered:
    """MIG slices, HPA off, the operator's own Secrets and volume, S3, narrowed policies."""
    return Rendered("prod", "-f", PROD_VALUES)


@pytest.fixture(scope="module")
def cpu() -> Rendered:
    """One machine, no GPUs: the values the container suite plays under podman."""
    return Rendered("cpu", "-f", CPU_VALUES)


@pytest.fixture(scope="module", params=["default", "prod"])
def rendered(request) -> Rendered:
    return request.getfixturevalue(request.param)


@pytest.fixture(scope="module", params=["default", "prod", "cpu"])
def any_rendered(request) -> Rendered:
    return request.getfixturevalue(request.param)


def env_of(container: dict) -> dict[str, dict]:
    return {e["name"]: e for e in container.get("env", [])}


def secret_ref(container: dict, name: str) -> tuple[str, str]:
    entry = env_of(container)[name]
    assert "value" not in entry, f"{name} must come from a Secret, not a literal value"
    ref = entry["valueFrom"]["secretKeyRef"]
    return ref["name"], ref["key"]


def selects(selector: dict, labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in selector["matchLabels"].items())


def check_service_monitor(monitor: dict, rendered: Rendered) -> None:
    """kubernetes-validate has no schemas for CRDs: the fields Prometheus' operator reads,
    and that each one scrapes a named port of a Service of this release."""
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    spec = monitor["spec"]
    assert set(spec) <= {"namespaceSelector", "selector", "endpoints", "jobLabel"}, spec.keys()
    assert spec["namespaceSelector"] == {"matchNames": [NAMESPACE]}
    services = [s for s in rendered.all("Service") if selects(spec["selector"], s["metadata"]["labels"])]
    assert len(services) == 1, f"{monitor['metadata']['name']} selects {len(services)} Services"
    port_names = {p["name"] for p in services[0]["spec"]["ports"]}
    assert spec["endpoints"], "a ServiceMonitor without endpoints scrapes nothing"
    for endpoint in spec["endpoints"]:
        assert set(endpoint) <= {"port", "path", "interval", "relabelings"}, endpoint.keys()
        assert endpoint["port"] in port_names
        assert endpoint["path"] == "/metrics"
        assert endpoint["interval"][-1] in "smh" and endpoint["interval"][:-1].isdigit()
        for rule in endpoint.get("relabelings", []):
            assert set(rule) <= {"sourceLabels", "regex", "action", "targetLabel", "replacement"}
            assert rule.get("action", "replace") in ("replace", "keep", "drop")


def check_prometheus_rule(rule: dict) -> None:
    """No schema for this CRD either: the operator's fields, and the rules of the file."""
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    assert set(rule["spec"]) == {"groups"}
    assert rule["spec"] == yaml.safe_load((CHART / "files" / "prometheus-alerts.yaml").read_text())
    for group in rule["spec"]["groups"]:
        assert set(group) <= {"name", "interval", "rules"}
        for r in group["rules"]:
            assert set(r) <= {"alert", "record", "expr", "for", "labels", "annotations"}, r.keys()


def test_every_manifest_validates_against_the_kubernetes_schemas(any_rendered):
    rendered = any_rendered
    kinds, problems = set(), []
    for doc in rendered.docs:
        kinds.add(doc["kind"])
        if doc["kind"] == "ServiceMonitor":
            check_service_monitor(doc, rendered)
            continue
        if doc["kind"] == "PrometheusRule":
            check_prometheus_rule(doc)
            continue
        try:
            kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            where = ".".join(map(str, exc.path))
            problems.append(f"{doc['kind']}/{doc['metadata']['name']}: {where}: {exc.message}")
        except kubernetes_validate.SchemaNotFoundError as exc:
            problems.append(exc.message)  # an unknown kind or API version is a failure too
    if problems:  # every one at once, without the whole schema in the traceback
        pytest.fail("\n".join(problems), pytrace=False)
    assert {"StatefulSet", "Deployment", "Service", "ConfigMap", "NetworkPolicy"} <= kinds
    # The control plane needs no Kubernetes API (leader election is in PostgreSQL).
    assert not kinds & {"Role", "RoleBinding", "ClusterRole", "ClusterRoleBinding"}


def test_service_monitors_cover_router_control_plane_and_triton(default, prod):
    by_component = {m["metadata"]["labels"]["app.kubernetes.io/component"]: m["spec"]["endpoints"]
                    for m in default.all("ServiceMonitor")}
    assert {c: [e["port"] for e in eps] for c, eps in by_component.items()} == {
        "router": ["http"], "control-plane": ["admin"], "triton": ["metrics"]}
    # A standby answers 503 on /metrics: only the ready (leading) control plane is scraped.
    dropped = [r for r in by_component["control-plane"][0]["relabelings"] if r["action"] == "drop"]
    assert {r["regex"] for r in dropped} == {"false"} and len(dropped) == 2
    assert prod.all("ServiceMonitor") == []  # metrics.serviceMonitor.enabled: false


def test_alert_rules_and_the_dashboard_ship_with_the_chart(default, prod):
    """One copy of each (the chart's files/, which deploy/monitoring/ links to), inserted
    as it is: the {{ $labels }} of the alerts and {{server}} of the dashboard are not
    Helm's."""
    [rule] = default.all("PrometheusRule")
    assert "{{ $labels.route }}" in json.dumps(rule)
    dashboards = [c for c in default.all("ConfigMap") if c["metadata"]["name"] == "mm-grafana-dashboard"]
    assert len(dashboards) == 1 and dashboards[0]["metadata"]["labels"]["grafana_dashboard"] == "1"
    shipped = (CHART / "files" / "grafana-dashboard.json").read_text()
    assert json.loads(dashboards[0]["data"]["mmserve.json"]) == json.loads(shipped)
    assert prod.all("PrometheusRule") == []  # metrics.prometheusRule.enabled: false
    [prod_dashboard] = [c for c in prod.all("ConfigMap") if c["metadata"]["name"].endswith("grafana-dashboard")]
    assert prod_dashboard["metadata"]["annotations"] == {"grafana_folder": "Serving"}
    for name in ("grafana-dashboard.json", "prometheus-alerts.yaml"):
        link = ROOT / "deploy" / "monitoring" / name
        assert link.resolve() == (CHART / "files" / name).resolve(), f"{link} must link to the chart's copy"


def test_control_plane_runs_a_leader_and_a_standby(rendered):
    name = f"{rendered.release}-control-plane"
    deployment = rendered.one("Deployment", name)
    assert deployment["spec"]["replicas"] == 2
    # Only the leader is ever ready: a rollout that waited for ready standbys would stall.
    assert deployment["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == "100%"
    container = rendered.container("Deployment", name)
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "admin"}
    assert container["livenessProbe"]["httpGet"] == {"path": "/livez", "port": "admin"}
    assert {"name": "admin", "containerPort": 8090} in container["ports"]
    args = container["args"]
    assert args[0] == "control-plane"
    pairs = dict(zip(args[1::2], args[2::2]))
    assert pairs["--servers-file"] == "/etc/mmserve/servers.json"
    assert pairs["--repository"] == "/models"
    assert pairs["--state-dir"] == "/state"
    assert (pairs["--admin-host"], pairs["--admin-port"]) == ("0.0.0.0", "8090")
    assert "--state-url" not in args  # from env MMS_STATE_URL: argv would show the password
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
    assert volumes[mounts["/etc/mmserve"]]["configMap"]["name"] == f"{rendered.release}-servers"
    assert "emptyDir" in volumes[mounts["/state"]]
    # The control plane writes the repository the Tritons load from: one claim for both.
    triton = rendered.one("StatefulSet", f"{rendered.release}-triton")["spec"]["template"]["spec"]
    triton_mounts = {m["mountPath"]: m for m in triton["containers"][0]["volumeMounts"]}
    triton_volumes = {v["name"]: v for v in triton["volumes"]}
    assert triton_mounts["/models"]["readOnly"] is True
    assert (triton_volumes[triton_mounts["/models"]["name"]]["persistentVolumeClaim"]
            == volumes[mounts["/models"]]["persistentVolumeClaim"])


def test_admin_service_stays_inside_the_cluster_and_reaches_the_leader(rendered):
    admin = rendered.one("Service", f"{rendered.release}-admin")
    assert admin["spec"]["type"] == "ClusterIP"
    assert admin["spec"]["ports"] == [{"name": "admin", "port": 8090, "targetPort": "admin"}]
    assert selects({"matchLabels": admin["spec"]["selector"]}, rendered.pod_labels("control-plane"))
    router = rendered.container("Deployment", f"{rendered.release}-router")
    pairs = dict(zip(router["args"][1::2], router["args"][2::2]))
    assert router["args"][0] == "router"
    assert pairs["--control-url"] == f"http://{rendered.release}-admin:8090"
    # The admin API refuses Host names it was not told of (DNS rebinding): the routers' one.
    control = rendered.container("Deployment", f"{rendered.release}-control-plane")["args"]
    allowed = [control[i + 1] for i, a in enumerate(control) if a == "--admin-allowed-host"]
    assert f"{rendered.release}-admin" in allowed
    # Routers hold the data-plane token, from the Secret the control plane reads it from, and
    # nothing that opens model control: not the admin token, not Triton's key.
    control_plane = rendered.container("Deployment", f"{rendered.release}-control-plane")
    assert secret_ref(router, "MMS_DATAPLANE_TOKEN") == secret_ref(control_plane, "MMS_DATAPLANE_TOKEN")
    assert secret_ref(router, "MMS_DATAPLANE_TOKEN") != secret_ref(control_plane, "MMS_ADMIN_TOKEN")
    assert not {"MMS_ADMIN_TOKEN", "MMCTL_TOKEN", "MMS_TRITON_ADMIN_KEY"} & set(env_of(router))


def test_rendered_commands_are_ones_mmctl_accepts(rendered):
    """The pods' args parsed by mmctl's own command line (nothing runs): a renamed or
    removed option fails here, not in a crash-looping pod."""
    import click

    from mmctl.main import cli

    for name in ("control-plane", "router"):
        args = rendered.container("Deployment", f"{rendered.release}-{name}")["args"]
        command = cli.get_command(click.Context(cli), args[0])
        assert command is not None, f"mmctl has no command {args[0]!r}"
        try:
            command.make_context(f"mmctl {args[0]}", list(args[1:]))
        except click.UsageError as exc:
            pytest.fail(f"mmctl {args[0]} refuses the chart's args: {exc.format_message()}")


def test_triton_runs_explicit_model_control_behind_an_admin_key_from_a_secret(rendered):
    name = f"{rendered.release}-triton"
    triton = rendered.container("StatefulSet", name)
    args = triton["args"]
    assert args[0] == "tritonserver"
    for flag in ("--model-repository=/models", "--model-control-mode=explicit",
                 "--disable-auto-complete-config", "--strict-readiness=true",
                 "--http-port=8000", "--grpc-port=8001", "--metrics-port=8002",
                 "--grpc-restricted-protocol=model-repository,shared-memory,trace,logging:admin-key=$(TRITON_ADMIN_KEY)",
                 "--http-restricted-api=model-repository,shared-memory,trace,logging:admin-key=$(TRITON_ADMIN_KEY)"):
        assert flag in args
    key = secret_ref(triton, "TRITON_ADMIN_KEY")
    control = rendered.container("Deployment", f"{rendered.release}-control-plane")
    assert secret_ref(control, "MMS_TRITON_ADMIN_KEY") == key
    # Routers reach the same ports for inference and must not be able to load or unload.
    router = rendered.container("Deployment", f"{rendered.release}-router")
    assert all(e.get("valueFrom", {}).get("secretKeyRef", {}).get("name") != key[0]
               for e in router.get("env", []))
    # In explicit mode Triton is "ready" with no model and strict readiness turns a failed
    # load into "not ready": liveness is what says the server answers.
    assert triton["readinessProbe"]["httpGet"]["path"] == "/v2/health/live"
    service = rendered.one("Service", name)
    statefulset = rendered.one("StatefulSet", name)
    assert statefulset["spec"]["serviceName"] == name
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"]


def test_one_gpu_or_one_mig_slice_per_triton_pod(default, prod, cpu):
    assert not [r for r in cpu.container("StatefulSet", "cpu-triton")["resources"]["limits"]
                if r.startswith("nvidia.com/")]  # gpuResource "": Tritons on CPU
    limits = default.container("StatefulSet", "mm-triton")["resources"]["limits"]
    assert limits["nvidia.com/gpu"] == 1
    spec = default.one("StatefulSet", "mm-triton")["spec"]["template"]["spec"]
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"]

    statefulset = prod.one("StatefulSet", "prod-triton")
    assert statefulset["spec"]["replicas"] == 7
    limits = prod.container("StatefulSet", "prod-triton")["resources"]["limits"]
    assert limits["nvidia.com/mig-1g.10gb"] == 1 and "nvidia.com/gpu" not in limits
    assert statefulset["spec"]["template"]["spec"]["nodeSelector"] == {
        "nvidia.com/mig.config": "all-1g.10gb"}


def test_servers_json_lists_each_triton_by_its_stable_dns_name(rendered, tmp_path):
    from control_plane.runtime.tritons import load_servers_file

    statefulset = rendered.one("StatefulSet", f"{rendered.release}-triton")
    replicas, service = statefulset["spec"]["replicas"], statefulset["spec"]["serviceName"]
    ports = {p["name"]: p["containerPort"]
             for p in statefulset["spec"]["template"]["spec"]["containers"][0]["ports"]}
    text = rendered.one("ConfigMap", f"{rendered.release}-servers")["data"]["servers.json"]
    servers = json.loads(text)["servers"]
    assert len(servers) == replicas
    for i, server in enumerate(servers):
        # A StatefulSet pod's DNS name under its headless Service: <pod>.<service>.<ns>.svc
        host = f"{statefulset['metadata']['name']}-{i}.{service}.{NAMESPACE}.svc"
        assert server["name"] == f"triton-{i}"
        assert server["grpc_url"] == f"{host}:{ports['grpc']}"
        assert server["http_url"] == f"{host}:{ports['http']}"
        assert server["metrics_url"] == f"http://{host}:{ports['metrics']}/metrics"
    # The control plane reads this very file.
    (tmp_path / "servers.json").write_text(text)
    loaded = load_servers_file(tmp_path / "servers.json")
    assert [s.name for s in loaded] == [f"triton-{i}" for i in range(replicas)]
    if rendered.release == "prod":
        assert {(s.memory_budget_bytes, s.max_loaded) for s in loaded} == {(8 * 2**30, 6)}
    else:
        assert {(s.memory_budget_bytes, s.max_loaded) for s in loaded} == {(70 * 2**30, None)}


def _peers(policy: dict, port: int) -> list[dict]:
    """Every peer an ingress rule admits to ``port`` (a rule without ports admits all)."""
    found = []
    for rule in policy["spec"]["ingress"]:
        if "ports" in rule and port not in [p["port"] for p in rule["ports"]]:
            continue
        found.extend(rule.get("from", [{}]))  # no `from`: any source
    return found


def test_network_policy_admits_only_control_plane_and_routers_to_triton(rendered):
    triton = rendered.one("NetworkPolicy", f"{rendered.release}-triton")
    assert triton["spec"]["policyTypes"] == ["Ingress"]
    assert selects(triton["spec"]["podSelector"], rendered.pod_labels("triton"))
    control, router = rendered.pod_labels("control-plane"), rendered.pod_labels("router")
    for port in (8000, 8001):
        peers = _peers(triton, port)
        assert len(peers) == 2
        assert all(set(p) == {"podSelector"} for p in peers), "no namespace, IP block or wildcard"
        admitted = [p["podSelector"] for p in peers]
        assert any(selects(s, control) for s in admitted) and any(selects(s, router) for s in admitted)
        assert not any(selects(s, rendered.pod_labels("triton")) for s in admitted)
    metrics = _peers(triton, 8002)
    assert any(selects(p["podSelector"], control) for p in metrics if "podSelector" in p)
    assert not any("podSelector" in p and selects(p["podSelector"], router) for p in metrics)
    assert {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}} in metrics
    assert _peers(triton, 9999) == []

    admin = rendered.one("NetworkPolicy", f"{rendered.release}-control-plane")
    assert selects(admin["spec"]["podSelector"], control)
    peers = _peers(admin, 8090)
    assert {} not in peers
    assert any(set(p) == {"podSelector"} and selects(p["podSelector"], router) for p in peers)
    assert not any(set(p) == {"podSelector"} and selects(p["podSelector"], rendered.pod_labels("triton"))
                   for p in peers)


def test_router_ports_are_open_unless_narrowed(default, prod):
    assert _peers(default.one("NetworkPolicy", "mm-router"), 8001) == [{}]
    narrowed = _peers(prod.one("NetworkPolicy", "prod-router"), 8001)
    assert {} not in narrowed
    assert {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "clients"}}} in narrowed
    operators = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "ops"}},
                 "podSelector": {"matchLabels": {"app": "mmctl"}}}
    assert operators in _peers(prod.one("NetworkPolicy", "prod-control-plane"), 8090)


def test_router_autoscales_on_cpu_behind_one_public_service(default, prod):
    hpa = default.one("HorizontalPodAutoscaler", "mm-router")
    assert hpa["apiVersion"] == "autoscaling/v2"
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment",
                                             "name": "mm-router"}
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (2, 10)
    [metric] = hpa["spec"]["metrics"]
    assert metric["resource"]["name"] == "cpu" and metric["resource"]["target"]["type"] == "Utilization"
    router = default.one("Deployment", "mm-router")
    assert "replicas" not in router["spec"]  # the HPA owns it; helm upgrade must not reset it
    container = default.container("Deployment", "mm-router")
    assert container["resources"]["requests"]["cpu"]  # utilisation is relative to the request
    assert container["readinessProbe"]["httpGet"] == {"path": "/v2/health/ready", "port": "http"}
    service = default.one("Service", "mm-router")
    assert service["spec"]["type"] == "ClusterIP"
    assert [(p["name"], p["port"]) for p in service["spec"]["ports"]] == [("http", 8000), ("grpc", 8001)]

    assert prod.all("HorizontalPodAutoscaler") == []
    assert prod.one("Deployment", "prod-router")["spec"]["replicas"] == 3
    assert prod.one("Service", "prod-router")["spec"]["type"] == "LoadBalancer"


def test_no_secret_is_rendered_when_the_operator_brings_them(prod):
    assert prod.all("Secret") == []
    holding_data = [d for d in prod.docs if "data" in d or "stringData" in d]
    assert sorted(d["metadata"]["name"] for d in holding_data) == ["prod-grafana-dashboard",
                                                                   "prod-servers"]
    assert prod.one("ConfigMap", "prod-grafana-dashboard")["data"].keys() == {"mmserve.json"}
    control = prod.container("Deployment", "prod-control-plane")
    assert secret_ref(control, "MMS_STATE_URL") == ("mmserve-db", "dsn")
    assert secret_ref(control, "MMS_ADMIN_TOKEN") == ("mmserve-admin", "bearer")
    assert secret_ref(control, "MMS_TRITON_ADMIN_KEY") == ("mmserve-triton-key", "key")
    assert secret_ref(control, "MMS_S3_ACCESS_KEY_ID") == ("mmserve-s3", "access-key-id")
    assert secret_ref(control, "MMS_S3_SECRET_ACCESS_KEY") == ("mmserve-s3", "secret-access-key")
    assert env_of(control)["MMS_S3_BUCKET"]["value"] == "ml-models"
    assert secret_ref(prod.container("StatefulSet", "prod-triton"), "TRITON_ADMIN_KEY") == (
        "mmserve-triton-key", "key")
    assert prod.all("PersistentVolumeClaim") == []  # existing claim; S3 instead of a cold volume


def test_credentials_reach_pods_only_through_secrets(rendered):
    for workload in rendered.workloads():
        for container in workload["spec"]["template"]["spec"]["containers"]:
            for name in CREDENTIAL_ENV & set(env_of(container)):
                secret_ref(container, name)
            assert not any(POSTGRES_PASSWORD in a for a in container.get("args", []))
    if rendered.release != "prod":
        names = {s["metadata"]["name"] for s in rendered.all("Secret")}
        assert names == {"mm-admin-token", "mm-dataplane-token", "mm-triton-admin-key", "mm-postgres"}
        assert POSTGRES_PASSWORD not in rendered.text  # only base64, inside the Secret


def test_pods_run_unprivileged_with_resources(rendered):
    for workload in rendered.workloads():
        pod = workload["spec"]["template"]["spec"]
        where = workload["metadata"]["name"]
        assert pod["automountServiceAccountToken"] is False, where
        assert pod["enableServiceLinks"] is False, where
        assert pod["securityContext"]["runAsNonRoot"] is True, where
        for container in pod["containers"]:
            security = container["securityContext"]
            assert security["allowPrivilegeEscalation"] is False, where
            assert security["readOnlyRootFilesystem"] is True, where
            assert security["capabilities"]["drop"] == ["ALL"], where
            assert container["resources"]["requests"] and container["resources"]["limits"], where


def test_chart_refuses_values_it_cannot_work_with():
    missing = template("mm", check=False)
    assert missing.returncode != 0 and "postgres.existingSecret" in missing.stderr
    both = template("mm", "--set", "postgres.existingSecret=db", "--set-string",
                    f"postgres.url={POSTGRES_URL}", check=False)
    assert both.returncode != 0 and "not both" in both.stderr
    assert POSTGRES_PASSWORD not in both.stderr
    typo = template("mm", "--set-string", f"postgres.url={POSTGRES_URL}",
                    "--set", "trition.replicas=4", check=False)
    assert typo.returncode != 0 and "trition" in typo.stderr
    not_a_gpu = template("mm", "--set-string", f"postgres.url={POSTGRES_URL}",
                         "--set", "triton.gpuResource=gpu", check=False)
    assert not_a_gpu.returncode != 0 and "gpuResource" in not_a_gpu.stderr


def test_helm_lint_is_clean():
    helm("lint", "--strict", CHART, "--set-string", f"postgres.url={POSTGRES_URL}")
    helm("lint", "--strict", CHART, "-f", PROD_VALUES)
    helm("lint", "--strict", CHART, "-f", CPU_VALUES)
