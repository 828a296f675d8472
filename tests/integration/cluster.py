"""Processes of a product spread past one machine, on loopback: control planes started as
`mmctl control-plane` (leader and standbys on one state database) and router workers as
`mmctl router`, each logging to a file of its own."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import requests

from control_plane.triton.process import free_port
from tests.waiting import wait_for


class ControlPlane:
    """One `mmctl control-plane` process; ``token`` opens its admin API."""

    def __init__(self, name: str, root: Path, args: list[str], env: dict, token: str):
        self.name = name
        self.token = token
        self.port = free_port("127.0.0.1")
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = root / f"{name}.log"
        cmd = [sys.executable, "-m", "mmctl", "control-plane", *args,
               "--state-dir", str(root / name), "--admin-port", str(self.port),
               "--instance-name", name]
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)

    def ready(self) -> bool:
        return self.answers("/readyz") == 200

    def answers(self, path: str) -> int | None:
        try:
            return requests.get(self.url + path, timeout=2).status_code
        except requests.RequestException:
            return None

    def call(self, method: str, path: str, body: dict | None = None) -> requests.Response:
        return requests.request(method, self.url + path, json=body if method != "GET" else None,
                                headers={"Authorization": f"Bearer {self.token}"}, timeout=120)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def log_tails(logs: list[Path]):
    return lambda: "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}"
                             for p in logs if p.exists())


class RouterWorkers:
    """`mmctl router` workers sharing one public gRPC and one HTTP port (SO_REUSEPORT), each
    knowing every control plane in ``control_urls``."""

    def __init__(self, names: list[str], root: Path, control_urls: list[str], env: dict):
        self.grpc_port, self.http_port = free_port("127.0.0.1"), free_port("127.0.0.1")
        self.grpc = f"127.0.0.1:{self.grpc_port}"
        self.http = f"http://127.0.0.1:{self.http_port}"
        self.logs = [root / f"{name}.log" for name in names]
        self.procs = []
        for name, log in zip(names, self.logs, strict=True):
            with open(log, "wb") as out:
                self.procs.append(subprocess.Popen(
                    [sys.executable, "-m", "mmctl", "router", "--control-url",
                     ",".join(control_urls), "--name", name, "--grpc-port", str(self.grpc_port),
                     "--http-port", str(self.http_port)],
                    stdout=out, stderr=subprocess.STDOUT, env=env))

    def ready(self) -> bool:
        try:
            return requests.get(self.http + "/v2/health/ready", timeout=2).ok
        except requests.RequestException:
            return False

    def wait_ready(self, other_logs: list[Path]) -> None:
        wait_for(self.ready, 60, "the router workers did not get ready",
                 log_tails(other_logs + self.logs))

    def stop(self) -> None:
        for proc in self.procs:
            proc.send_signal(signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
