"""The alert rules and the Grafana dashboard against a real Prometheus (Debian's) that
scrapes a running `mmctl up`: `promtool check rules` passes, Prometheus evaluates every
rule without an error, every expression of the dashboard returns data, and every series an
alert names exists (an alert's whole expression is empty while all is well; the series it
watches must not be, or a typo or a renamed metric would keep it silent for ever)."""

from __future__ import annotations

import json
import re
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient
import yaml
from tritonclient.utils import InferenceServerException

from control_plane.triton.process import free_port
from tests.product import Product
from tests.system_packages import PACKAGES, require

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
MONITORING = ROOT / "deploy" / "monitoring"
ALERTS = MONITORING / "prometheus-alerts.yaml"
DASHBOARD = MONITORING / "grafana-dashboard.json"
PROMETHEUS, PROMTOOL = PACKAGES["prometheus"]
# Grafana's variables, as a dashboard with every server selected over a short range uses them.
GRAFANA_VARIABLES = {"$__rate_interval": "1m", "$server": ".*", "${datasource}": ""}
PRODUCT_SERIES = re.compile(r"\b(?:mms|mmr|control_plane)_[a-z0-9_]+\b")


def dashboard_expressions() -> list[tuple[str, str]]:
    """(panel title, expression) of every target, rows' panels included."""
    found = []

    def walk(panels):
        for panel in panels:
            walk(panel.get("panels", []))
            for target in panel.get("targets", []):
                expr = target["expr"]
                for name, value in GRAFANA_VARIABLES.items():
                    expr = expr.replace(name, value)
                found.append((panel["title"], expr))

    walk(json.loads(DASHBOARD.read_text())["panels"])
    return found


def alert_rules() -> list[dict]:
    return [r for g in yaml.safe_load(ALERTS.read_text())["groups"] for r in g["rules"]]


@pytest.fixture(scope="module")
def product(tmp_path_factory):
    root = tmp_path_factory.mktemp("prometheus")
    p = Product(root / "state", None, "--fleet-size", "6", "--max-loaded", "2").start()
    p.endpoints = p.json("endpoints")
    yield p
    p.stop()


@pytest.fixture(scope="module")
def prometheus(product, tmp_path_factory):
    require("prometheus")
    root = tmp_path_factory.mktemp("prometheus-server")
    port = free_port()
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(ALERTS.resolve())],
        "scrape_configs": [
            {"job_name": "mmserve-control-plane",
             "static_configs": [{"targets": [product.url.removeprefix("http://")]}]},
            {"job_name": "mmserve-router",
             "static_configs": [{"targets": [product.endpoints["router_http"]]}]},
        ],
    }
    (root / "prometheus.yml").write_text(yaml.safe_dump(config))
    with open(root / "prometheus.log", "wb") as log:
        proc = subprocess.Popen(
            [PROMETHEUS, f"--config.file={root / 'prometheus.yml'}",
             f"--storage.tsdb.path={root / 'data'}", f"--web.listen-address=127.0.0.1:{port}"],
            stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            assert proc.poll() is None, (root / "prometheus.log").read_text()
            try:
                if requests.get(url + "/-/ready", timeout=1).status_code == 200:
                    break
            except requests.RequestException:
                pass
            assert time.monotonic() < deadline, (root / "prometheus.log").read_text()
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def query(prometheus: str, expr: str) -> list:
    resp = requests.get(prometheus + "/api/v1/query", params={"query": expr}, timeout=10)
    body = resp.json()
    assert resp.status_code == 200 and body["status"] == "success", (expr, body)
    return body["data"]["result"]


def infer(client, model: str, n: int = 1) -> None:
    x = grpcclient.InferInput("FEATURES", [1, 64], "FP32")
    x.set_data_from_numpy(np.ones((1, 64), np.float32))
    for _ in range(n):
        client.infer(model, [x])


def drive(product: Product) -> None:
    """What the dashboard and the alerts watch, made to happen: misses and evictions
    through the router, a pin, a shadow, a canary rolled back, a rate limit."""
    def ok(*args):
        out = product.mmctl(*args)
        assert out.returncode == 0, (args, out.stderr)

    client = grpcclient.InferenceServerClient(product.endpoints["router_grpc"])
    for model in ("cust001", "cust002", "cust003", "cust001"):  # room for 2: evictions
        infer(client, model, 2)
    ok("pin", "cust001")
    ok("shadow", "start", "cust001", "--model", "cust002", "--percent", "100")
    infer(client, "cust001", 6)
    ok("canary", "start", "cust003", "--to", "cust004", "--stages", "50,100", "--stage-seconds", "60",
       "--check-interval", "0.3", "--min-requests", "3", "--max-failed-checks", "1",
       "--max-p99-ms", "0.01")
    deadline = time.monotonic() + 60
    while product.json("canary", "status", "cust003")["status"] == "running":
        assert time.monotonic() < deadline, "the canary was never judged"
        infer(client, "cust003", 4)
    ok("limit", "set", "cust005", "--qps", "1", "--burst", "1")
    with pytest.raises(InferenceServerException):
        infer(client, "cust005", 5)


def test_promtool_checks_the_rules():
    require("prometheus")
    out = subprocess.run([PROMTOOL, "check", "rules", str(ALERTS)], capture_output=True,
                         text=True, timeout=60, check=False)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"SUCCESS: {len(alert_rules())} rules found" in out.stdout


def test_every_expression_of_the_dashboard_and_the_alerts_has_data(product, prometheus):
    drive(product)
    # Every target scraped, then a few more scrapes and rule evaluations.
    deadline = time.monotonic() + 30
    while True:
        targets = requests.get(prometheus + "/api/v1/targets", timeout=10).json()["data"]["activeTargets"]
        if len(targets) == 2 and all(t["health"] == "up" for t in targets):
            break
        assert time.monotonic() < deadline, [(t["scrapeUrl"], t["health"], t["lastError"]) for t in targets]
        time.sleep(0.5)
    time.sleep(4)

    empty = [(title, expr) for title, expr in dashboard_expressions() if not query(prometheus, expr)]
    assert empty == [], f"dashboard expressions without data: {empty}"

    rules = requests.get(prometheus + "/api/v1/rules", timeout=10).json()["data"]["groups"]
    evaluated = {r["name"]: r for g in rules for r in g["rules"]}
    assert set(evaluated) == {r["alert"] for r in alert_rules()}
    unhealthy = {n: r.get("lastError") for n, r in evaluated.items() if r["health"] != "ok"}
    assert unhealthy == {}, unhealthy
    missing = {}
    for rule in alert_rules():
        query(prometheus, rule["expr"])  # it evaluates (empty or not)
        for name in sorted(set(PRODUCT_SERIES.findall(rule["expr"]))):
            if not query(prometheus, f"count({name})"):
                missing.setdefault(rule["alert"], []).append(name)
    assert missing == {}, f"alerts watching series that do not exist: {missing}"
    # The rolled-back canary is what MmsCanaryRolledBack reports, with its route.
    firing = query(prometheus, next(r["expr"] for r in alert_rules() if r["alert"] == "MmsCanaryRolledBack"))
    assert [f["metric"]["route"] for f in firing] == ["cust003"]
