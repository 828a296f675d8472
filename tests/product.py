"""`mmctl up` as a child process on free ports: the product as a person runs it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import requests

from control_plane.triton.process import free_port
from domain.settings import ADMIN_TOKEN
from tests.conftest import pid_alive

MMCTL = [sys.executable, "-m", "mmctl"]


class Product:
    """One `mmctl up` process on free ports, with its own state directory."""

    def __init__(self, state_dir: Path, repository: Path | None, *extra: str,
                 code_dir: Path | None = None):
        """``code_dir``: a checkout whose code the product runs (its processes start there,
        and ``python -m`` finds their modules there first): a benchmark's baseline."""
        self.state_dir = state_dir
        self.repository = repository
        self.extra = list(extra)
        self.code_dir = code_dir
        self.admin_port = free_port()
        self.url = f"http://127.0.0.1:{self.admin_port}"
        self.proc: subprocess.Popen | None = None

    def start(self) -> Product:
        args = [*MMCTL, "up", "--state-dir", str(self.state_dir), "--admin-port", str(self.admin_port),
                "--triton-http-port", "0", "--triton-grpc-port", "0", "--triton-metrics-port", "0",
                "--reconcile-interval", "0.5",
                # None: no --repository, the product's default warm tier (tmpfs when it can)
                *(["--repository", str(self.repository)] if self.repository is not None else []),
                "--router-http-port", "0", "--router-grpc-port", "0", *self.extra]
        with open(self.state_dir.parent / f"mmctl-up-{self.admin_port}.log", "ab") as log:
            self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, cwd=self.code_dir)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.log_text()
            try:
                if (requests.get(self.url + "/v1/fleet", headers=self.admin_headers(),
                                 timeout=1).status_code == 200 and self.workers_ready()):
                    return self
            except requests.RequestException:
                pass
            time.sleep(0.2)
        raise AssertionError("mmctl up did not come up:\n" + self.log_text())

    @property
    def supervised(self) -> bool:
        """Router workers run beside the control plane (the default of mmctl up)."""
        if "--no-router" in self.extra:
            return False
        if "--router-workers" in self.extra:
            return self.extra[self.extra.index("--router-workers") + 1] != "0"
        return True

    def processes(self) -> dict:
        """The supervisor's list of the product's processes (processes.json)."""
        return json.loads((self.state_dir / "processes.json").read_text())

    def workers_ready(self) -> bool:
        if not self.supervised:
            return True
        try:
            return bool(self.processes().get("ready"))
        except (OSError, ValueError):
            return False

    def log_text(self) -> str:
        return (self.state_dir.parent / f"mmctl-up-{self.admin_port}.log").read_text(errors="replace")

    @property
    def token_file(self) -> Path:
        """Where `mmctl up` keeps the admin API's bearer token (mode 0600)."""
        return self.state_dir / "admin.token"

    def admin_headers(self) -> dict[str, str]:
        """Headers for calling the admin API directly (the token, once `mmctl up` wrote it)."""
        try:
            return {"Authorization": f"Bearer {self.token_file.read_text().strip()}"}
        except FileNotFoundError:
            return {}

    def triton_key_headers(self) -> dict[str, str]:
        """gRPC metadata that opens the restricted APIs of this product's Tritons (the key
        `mmctl up` keeps in its state directory)."""
        from control_plane.triton.admin import admin_key_headers

        return admin_key_headers((self.state_dir / "triton.key").read_text().strip())

    def client_env(self) -> dict[str, str]:
        """What a shell needs to drive this product with mmctl: its admin API and token."""
        env = {"MMS_URL": self.url, "MMS_TOKEN_FILE": str(self.token_file)}
        for name in ADMIN_TOKEN.env_names:  # would win over the token file
            if name in os.environ:
                env[name] = ""
        return env

    def mmctl(self, *args: str) -> subprocess.CompletedProcess:
        env = dict(os.environ, **self.client_env())
        return subprocess.run([*MMCTL, *args], capture_output=True, text=True, env=env, timeout=300,
                              check=False)

    def json(self, *args: str):
        out = self.mmctl(*args, "--json")
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout)

    def triton_pids(self) -> list[int]:
        """tritonserver processes serving this product's repository (found via /proc)."""
        pids = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if "tritonserver" in cmd and str(self.state_dir.resolve()) in cmd and pid_alive(int(entry.name)):
                pids.append(int(entry.name))
        return pids

    def stop(self, sig=signal.SIGINT) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def assert_no_triton_left(self, timeout_s: float = 20.0) -> None:
        """After stop(): every tritonserver this product started exits within ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while self.triton_pids() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not self.triton_pids(), "a tritonserver was left behind"
