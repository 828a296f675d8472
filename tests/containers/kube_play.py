"""The Helm chart's pods on one machine: the chart rendered by the real helm with a values file,
then what `podman kube play` (4.3) can run of it, run.

What becomes what:

* Deployments and StatefulSets become their replicas' Pods, each named by the DNS name the
  other pods use for it (podman's network resolves pod names): a StatefulSet's pod N is
  ``<name>-N.<service>.<namespace>.svc`` (the names of the control plane's servers.json);
  the first replica of a Deployment a Service selects is named after that Service (the
  routers' ``--control-url`` names the admin Service).
* Secrets become podman secrets, which ``secretKeyRef``s read; ConfigMaps and
  PersistentVolumeClaims (named volumes, shared by the pods that claim them) are played as
  they are, a claim owned by the user and ``fsGroup`` of the pod that writes it (kube play
  has no ``fsGroup``: podman's volume annotations stand in).
* What kube play leaves to Kubernetes is done here: ``$(VAR)`` references in args and env
  values are expanded, ``fieldRef: status.podIP`` becomes the pod's name (which resolves to
  its address), an ``emptyDir`` becomes a host directory of mode 0777 as Kubernetes makes
  it (kube play's would copy the image's folder, owner and mode: /dev/shm root's, 0755),
  in /dev/shm for ``medium: Memory`` (its ``sizeLimit`` is not enforced).
* kube play 4.3 publishes every ``containerPort`` on all of the host's addresses, where
  Kubernetes publishes none: only the ports named in ``publish`` are kept, with a host port
  on 127.0.0.1 (the stand-in for a port-forward or a LoadBalancer); the probes' port names
  become numbers first.
* Services, NetworkPolicies, HorizontalPodAutoscalers, ServiceAccounts and the Prometheus
  operator's objects do not run under kube play: they are validated against the schemas
  only (tests/unit/test_deploy_chart.py), and listed in ``Played.validated_only``.
"""

from __future__ import annotations

import base64
import copy
import json
import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from tests.containers.engine import podman

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "helm" / "mmserve"
WORKLOADS = ("Deployment", "StatefulSet")
PLAYED = ("ConfigMap", "PersistentVolumeClaim")
_REFERENCE = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def render(helm: str, release: str, namespace: str, values: list[Path]) -> list[dict]:
    """The chart's manifests, as `helm install` would send them."""
    cmd = [helm, "template", release, str(CHART), "--namespace", namespace]
    for path in values:
        cmd += ["-f", str(path)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=True).stdout
    return [doc for doc in yaml.safe_load_all(out) if doc]


def secret_values(secret: dict) -> dict[str, str]:
    values = {k: base64.b64decode(v).decode() for k, v in (secret.get("data") or {}).items()}
    values.update(secret.get("stringData") or {})
    return values


def _selects(service: dict, labels: dict) -> bool:
    selector = service.get("spec", {}).get("selector") or {}
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def pod_names(workload: dict, services: list[dict], namespace: str) -> list[str]:
    name, spec = workload["metadata"]["name"], workload["spec"]
    replicas = int(spec.get("replicas", 1))
    if workload["kind"] == "StatefulSet":
        return [f"{name}-{i}.{spec['serviceName']}.{namespace}.svc" for i in range(replicas)]
    labels = spec["template"]["metadata"].get("labels", {})
    fronting = [s["metadata"]["name"] for s in services if _selects(s, labels)
                and s["spec"].get("clusterIP") != "None"]
    first = fronting[0] if len(fronting) == 1 else f"{name}-0"
    return [first, *(f"{name}-{i}" for i in range(1, replicas))]


def _expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion: a reference to an unknown variable stays as written."""
    return _REFERENCE.sub(lambda m: env.get(m.group(1), m.group(0)), text)


def _container(container: dict, pod_name: str, secrets: dict[str, dict[str, str]],
               publish: dict[str, int]) -> dict:
    container = copy.deepcopy(container)
    env: dict[str, str] = {}
    for var in container.get("env", []):
        source = var.get("valueFrom") or {}
        if source.get("fieldRef", {}).get("fieldPath") == "status.podIP":
            var.pop("valueFrom")
            var["value"] = pod_name  # resolves to the pod's address on podman's network
        if "value" in var:
            var["value"] = env[var["name"]] = _expand(str(var["value"]), env)
        elif "secretKeyRef" in source:
            ref = source["secretKeyRef"]
            env[var["name"]] = secrets[ref["name"]][ref["key"]]
    for key in ("command", "args"):
        if key in container:
            container[key] = [_expand(str(arg), env) for arg in container[key]]
    numbers = {p["name"]: p["containerPort"] for p in container.get("ports", []) if "name" in p}
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        action = container.get(probe, {}).get("httpGet") or container.get(probe, {}).get("tcpSocket")
        if action is not None and action.get("port") in numbers:
            action["port"] = numbers[action["port"]]
    kept = [dict(p, hostPort=publish[p["name"]], hostIP="127.0.0.1")
            for p in container.get("ports", []) if p.get("name") in publish]
    if kept:
        container["ports"] = kept
    else:
        container.pop("ports", None)
    return container


def _empty_dirs(spec: dict, pod_name: str, scratch: Path) -> list[Path]:
    """The pod's emptyDir volumes as host directories (see the module's docstring)."""
    made = []
    for volume in spec.get("volumes", []):
        empty = volume.pop("emptyDir", None)
        if empty is None:
            continue
        root = Path("/dev/shm") if empty.get("medium") == "Memory" else scratch
        path = Path(tempfile.mkdtemp(prefix=f"kube-{pod_name[:40]}-{volume['name']}-", dir=root))
        path.chmod(0o777)
        volume["hostPath"] = {"path": str(path), "type": "Directory"}
        made.append(path)
    return made


def pods(docs: list[dict], namespace: str, publish: dict[str, dict[str, int]],
         scratch: Path) -> tuple[list[dict], list[Path]]:
    """The workloads' replicas as Pods (``publish``: pod name -> port name -> host port),
    and the host directories made for their emptyDirs."""
    services = [d for d in docs if d["kind"] == "Service"]
    secrets = {d["metadata"]["name"]: secret_values(d) for d in docs if d["kind"] == "Secret"}
    out, dirs = [], []
    for workload in (d for d in docs if d["kind"] in WORKLOADS):
        template = workload["spec"]["template"]
        for name in pod_names(workload, services, namespace):
            spec = copy.deepcopy(template["spec"])
            spec["containers"] = [_container(c, name, secrets, publish.get(name, {}))
                                  for c in spec["containers"]]
            dirs += _empty_dirs(spec, name, scratch)
            out.append({"apiVersion": "v1", "kind": "Pod",
                        "metadata": {"name": name, "labels": template["metadata"].get("labels", {})},
                        "spec": spec})
    return out, dirs


def owned_claims(claims: list[dict], played_pods: list[dict]) -> list[dict]:
    """``claims``, each annotated with the user and group of a pod that mounts it writable."""
    owners = {}
    for pod in played_pods:
        security = pod["spec"].get("securityContext") or {}
        if "runAsUser" not in security:
            continue
        writable = {m["name"] for c in pod["spec"]["containers"] for m in c.get("volumeMounts", [])
                    if not m.get("readOnly")}
        for volume in pod["spec"].get("volumes", []):
            claim = (volume.get("persistentVolumeClaim") or {}).get("claimName")
            if claim and volume["name"] in writable:
                owners.setdefault(claim, (security["runAsUser"],
                                          security.get("fsGroup", security.get("runAsGroup", 0))))
    out = []
    for claim in claims:
        claim = copy.deepcopy(claim)
        owner = owners.get(claim["metadata"]["name"])
        if owner is not None:
            claim["metadata"].setdefault("annotations", {}).update(
                {"volume.podman.io/uid": str(owner[0]), "volume.podman.io/gid": str(owner[1])})
        out.append(claim)
    return out


@dataclass
class Played:
    """One chart played: its pods, volumes and secrets, and how to take them down."""

    network: str
    manifest: Path
    pods: list[str]
    volumes: list[str]
    secrets: list[str]
    validated_only: list[str] = field(default_factory=list)
    host_dirs: list[Path] = field(default_factory=list)

    def container(self, pod: str, name: str) -> str:
        return f"{pod}-{name}"

    def logs(self, pod: str, name: str, lines: int = 60) -> str:
        result = podman("logs", "--tail", str(lines), self.container(pod, name), check=False)
        return result.stdout + result.stderr

    def down(self) -> None:
        podman("kube", "down", str(self.manifest), check=False)
        for pod in self.pods:
            podman("pod", "rm", "-f", pod, check=False)
        for volume in self.volumes:
            podman("volume", "rm", "-f", volume, check=False)
        for secret in self.secrets:
            podman("secret", "rm", secret, check=False)
        podman("network", "rm", "-f", self.network, check=False)
        for path in self.host_dirs:
            shutil.rmtree(path, ignore_errors=True)


def play(docs: list[dict], namespace: str, network: str, workdir: Path, *,
         extra: list[dict] = (), publish: dict[str, dict[str, int]] | None = None) -> Played:
    """Start ``docs`` (and the ``extra`` pods, e.g. a database the chart expects) on a podman
    network of their own.  The manifest holds expanded secrets: it is written private."""
    scratch = workdir / "empty-dirs"
    scratch.mkdir(exist_ok=True)
    chart_pods, host_dirs = pods(docs, namespace, publish or {}, scratch)
    played_pods = [*extra, *chart_pods]
    secrets = [d for d in docs if d["kind"] == "Secret"]
    config_maps = [d for d in docs if d["kind"] == "ConfigMap"]
    claims = owned_claims([d for d in docs if d["kind"] == "PersistentVolumeClaim"], played_pods)
    kept = [*config_maps, *claims]
    # kube play keeps each ConfigMap a pod mounts in a volume of the same name
    played = Played(network, workdir / "pods.yaml", [p["metadata"]["name"] for p in played_pods],
                    [d["metadata"]["name"] for d in kept],
                    [d["metadata"]["name"] for d in secrets],
                    sorted({f"{d['kind']} {d['metadata']['name']}" for d in docs
                            if d["kind"] not in (*WORKLOADS, *PLAYED, "Secret")}), host_dirs)
    fd, tmp = tempfile.mkstemp(dir=workdir)
    with os.fdopen(fd, "w") as f:
        yaml.safe_dump_all([*kept, *played_pods], f, sort_keys=False)
    os.replace(tmp, played.manifest)
    try:
        podman("network", "create", network)
        for secret in secrets:
            body = {k: base64.b64encode(v.encode()).decode() for k, v in secret_values(secret).items()}
            podman("secret", "create", secret["metadata"]["name"], "-", stdin=json.dumps(body))
        podman("kube", "play", "--network", network, str(played.manifest), timeout=600)
    except BaseException:
        played.down()
        raise
    return played
