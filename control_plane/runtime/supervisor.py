"""``mmctl up`` with router workers: a small supervisor of sibling processes.

    mmctl up (this process)
      ├─ control plane   python -m control_plane.runtime.service --config <state>/run/control-plane.json
      │    └─ tritonserver, one per GPU / MIG slice (outlive a control-plane crash)
      └─ router workers  python -m router.worker ... (share the public ports, SO_REUSEPORT)

A child that dies is started again (with backoff).  The control plane's next life adopts
the Tritons of the previous one and their loaded models; meanwhile the workers serve the
loaded models from their last snapshot.  This process is the children's subreaper, so a
Triton orphaned by a control-plane crash is reaped here, and every child gets SIGTERM if
this process dies (parent-death signal).  ``<state>/processes.json`` lists every process
with its role and pid (``mmctl endpoints``).
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import requests

log = logging.getLogger(__name__)

PROCESSES_FILE = "processes.json"
PR_SET_CHILD_SUBREAPER = 36
BACKOFF_MIN_S, BACKOFF_MAX_S = 0.5, 10.0
STABLE_AFTER_S = 30.0  # a child that ran this long restarts without backoff
WORKER_STOP_S, CONTROL_PLANE_STOP_S = 10.0, 120.0


def default_router_workers(cores: int | None = None) -> int:
    """A quarter of the cores, at least one and at most eight: Triton and its model
    instances need the rest."""
    cores = cores or os.cpu_count() or 1
    return max(1, min(8, cores // 4))


@dataclass
class Child:
    role: str  # "control-plane" | "router-worker"
    name: str
    argv: list[str]
    env: dict[str, str]
    ready_file: Path | None = None
    proc: subprocess.Popen | None = None
    started_at: float = 0.0
    restarts: int = 0
    failures: int = 0  # consecutive short lives
    restart_at: float | None = None

    def to_dict(self) -> dict:
        alive = self.proc is not None and self.proc.poll() is None
        return {"role": self.role, "name": self.name, "pid": self.proc.pid if self.proc else None,
                "alive": alive, "restarts": self.restarts, "started_at": self.started_at}


class Supervisor:
    def __init__(self, state_dir: Path, control_plane: Child, workers: list[Child], admin_url: str,
                 token: str, endpoints_line: str, ready_timeout_s: float = 600.0,
                 metrics_dir: Path | None = None):
        self.state_dir = state_dir
        self.control_plane = control_plane
        self.workers = workers
        self.admin_url = admin_url
        self.token = token
        self.endpoints_line = endpoints_line
        self.ready_timeout_s = ready_timeout_s
        self.metrics_dir = metrics_dir
        self.stopping = False
        self.ready = False
        self._last_reap = 0.0

    @property
    def children(self) -> list[Child]:
        return [self.control_plane, *self.workers]

    # ------------------------------------------------------------------ processes
    def spawn(self, child: Child) -> None:
        from control_plane.triton.process import with_parent_death_signal

        if child.ready_file is not None:
            child.ready_file.unlink(missing_ok=True)
        # stdin closed; output shared with mmctl up's terminal (one log for the product).
        child.proc = subprocess.Popen(with_parent_death_signal(child.argv), env=child.env,
                                      stdin=subprocess.DEVNULL)
        child.started_at = time.time()
        child.restart_at = None
        log.info("started %s %s (pid %d)", child.role, child.name, child.proc.pid)
        self.write_processes()

    def write_processes(self) -> None:
        body = {"ready": self.ready, "supervisor": os.getpid(), "processes": [
            {"role": "supervisor", "name": "mmctl-up", "pid": os.getpid(), "alive": True},
            *(c.to_dict() for c in self.children)]}
        path = self.state_dir / PROCESSES_FILE
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(body, indent=2))
        os.replace(tmp, path)

    def _control_plane_up(self) -> bool:
        try:
            r = requests.get(self.admin_url + "/v1/endpoints", timeout=2,
                             headers={"Authorization": f"Bearer {self.token}"})
            return r.status_code == 200 and r.json().get("pid") == self.control_plane.proc.pid
        except (requests.RequestException, ValueError):
            return False

    def _wait(self, what: str, done, children: list[Child]) -> None:
        deadline = time.monotonic() + self.ready_timeout_s
        while not done():
            for child in children:
                if child.proc.poll() is not None:
                    log.error("%s %s exited with code %s while starting; see the log above",
                              child.role, child.name, child.proc.returncode)
                    raise SystemExit(child.proc.returncode or 1)
            if self.stopping:
                raise SystemExit("stopped while starting")
            if time.monotonic() > deadline:
                raise SystemExit(f"{what} not ready after {self.ready_timeout_s:.0f}s")
            time.sleep(0.1)

    def reap_orphans(self) -> None:
        """Tritons whose control plane died are re-parented here (subreaper); reap the ones
        that exit so they do not linger as zombies."""
        mine = {c.proc.pid for c in self.children if c.proc is not None}
        me = os.getpid()
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) in mine:
                continue
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            fields = stat[stat.rindex(")") + 2:].split()
            if fields[0] == "Z" and int(fields[1]) == me:
                try:
                    os.waitpid(int(entry.name), os.WNOHANG)
                except ChildProcessError:
                    pass

    def _check(self, child: Child, now: float) -> None:
        if child.proc is None or child.proc.poll() is None:
            return
        if child.restart_at is None:  # just noticed
            lived_s = time.time() - child.started_at
            child.failures = 0 if lived_s > STABLE_AFTER_S else child.failures + 1
            delay = 0.0 if child.failures == 0 else min(BACKOFF_MAX_S, BACKOFF_MIN_S * 2 ** (child.failures - 1))
            child.restart_at = now + delay
            log.error("%s %s (pid %d) exited with code %s after %.1fs; starting it again in %.1fs",
                      child.role, child.name, child.proc.pid, child.proc.returncode, lived_s, delay)
            if child.role == "router-worker" and self.metrics_dir is not None:
                from prometheus_client.multiprocess import mark_process_dead

                mark_process_dead(child.proc.pid, str(self.metrics_dir))
            self.write_processes()
        if now >= child.restart_at:
            child.restarts += 1
            self.spawn(child)

    # ------------------------------------------------------------------ life
    def run(self) -> int:
        if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1) != 0:
            log.warning("could not become the subreaper of the product's processes (errno %d)",
                        ctypes.get_errno())
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._on_signal)
        if self.metrics_dir is not None:
            shutil.rmtree(self.metrics_dir, ignore_errors=True)  # series of a previous run
            self.metrics_dir.mkdir(parents=True)
        try:
            self.spawn(self.control_plane)
            self._wait("the control plane", self._control_plane_up, [self.control_plane])
            for worker in self.workers:
                self.spawn(worker)
            self._wait("the router workers", lambda: all(w.ready_file.exists() for w in self.workers),
                       self.children)
            self.ready = True
            self.write_processes()
            print(f"{self.endpoints_line} (Ctrl-C stops)", flush=True)
            while not self.stopping:
                time.sleep(0.1)
                now = time.monotonic()
                for child in self.children:
                    self._check(child, now)
                if now - self._last_reap > 1.0:
                    self._last_reap = now
                    self.reap_orphans()
            return 0
        finally:
            print("stopping...", flush=True)
            self.stop()

    def _on_signal(self, signum, _frame) -> None:
        self.stopping = True

    def stop(self) -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)  # a second Ctrl-C must not cut the clean stop short
        self._terminate(self.workers, WORKER_STOP_S)
        self._terminate([self.control_plane], CONTROL_PLANE_STOP_S)
        end_outliving_tritons(self.state_dir / "triton")
        self.reap_orphans()
        (self.state_dir / PROCESSES_FILE).unlink(missing_ok=True)

    @staticmethod
    def _terminate(children: list[Child], timeout_s: float) -> None:
        running = [c for c in children if c.proc is not None and c.proc.poll() is None]
        for child in running:
            child.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for child in running:
            try:
                child.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("%s %s did not stop in %.0fs; killing it", child.role, child.name, timeout_s)
                child.proc.kill()
                child.proc.wait()


def end_outliving_tritons(pid_dir: Path, timeout_s: float = 15.0) -> None:
    """Stop every Triton launched to outlive its control plane that is still running: the
    control plane stops its Tritons on a clean stop, but one stopped while it was starting
    (or killed) cannot.  A pid file names pid and start time, so a reused pid is never
    signalled."""
    from control_plane.triton.process import process_start_ticks

    for pid_file in sorted(pid_dir.glob("*.pid")):
        try:
            record = json.loads(pid_file.read_text())
            pid, start_ticks = int(record["pid"]), int(record["start_ticks"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if not record.get("outlives") or process_start_ticks(pid) != start_ticks:
            continue
        log.info("stopping tritonserver %d, left by its control plane", pid)
        for sig, wait_s in ((signal.SIGTERM, timeout_s), (signal.SIGKILL, 10.0)):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                break
            deadline = time.monotonic() + wait_s
            while process_start_ticks(pid) == start_ticks and time.monotonic() < deadline:
                time.sleep(0.1)
            if process_start_ticks(pid) != start_ticks:
                break
        pid_file.unlink(missing_ok=True)


def python_module(module: str, *args: str) -> list[str]:
    return [sys.executable, "-m", module, *args]
