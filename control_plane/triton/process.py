"""Start, watch and stop a real ``tritonserver`` as a child process.

The child gets PR_SET_PDEATHSIG=SIGTERM: if the control plane dies, even by SIGKILL, Triton
goes with it and no orphan keeps GPU memory.  It runs in its own session, so a Ctrl-C in the
terminal reaches only the control plane, which stops Triton after draining.  ``stop`` sends
SIGTERM, then SIGKILL after a timeout.

What it is launched with (flags, environment, backend directory, the exec wrapper) is in
``control_plane.triton.launch``; the Triton of a previous life of the same state directory
(adopted or ended) in ``control_plane.triton.previous_life``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import time
from pathlib import Path

import requests

from control_plane.triton.launch import (
    _PDEATHSIG_EXEC,
    RESTRICTED_KEY_HEADER,
    TRITON_ENV_NAMES,
    TRITON_ENV_PREFIXES,
    TritonLaunchConfig,
    build_backend_dir,
    free_port,
    printable_command,
    pytriton_root,
    stub_environment,
    triton_args,
    triton_environment,
    which_tritonserver,
    with_parent_death_signal,
)
from control_plane.triton.previous_life import PreviousLife, _shm_regions_of, process_start_ticks
from domain.errors import TritonUnavailable

# Names imported from here since before the launch arguments and the previous life had
# modules of their own.
__all__ = ["TRITON_ENV_NAMES", "TRITON_ENV_PREFIXES", "_PDEATHSIG_EXEC", "TritonLaunchConfig",
           "TritonProcess", "build_backend_dir", "free_port", "process_start_ticks",
           "pytriton_root", "stub_environment", "triton_args", "triton_environment",
           "which_tritonserver", "with_parent_death_signal"]

log = logging.getLogger(__name__)

# Seconds a tritonserver that has unloaded every model gets to exit after SIGTERM (it takes
# about one; a GPU's teardown a few); past that it waits for an instance whose
# python-backend process died, which never unloads, and is ended.
UNLOADED_EXIT_S = 5.0


def end_leftovers(pid: int) -> None:
    """SIGKILL what is left of the process group of a tritonserver ``pid`` that died without
    a clean exit (SIGKILL, a crash): its python-backend stubs, each holding its model's
    memory, outlive it otherwise.  The group is the dead server's own (it was started in a
    session of its own, whose id is its pid), so nothing else is in it."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


class TritonProcess(PreviousLife):
    """One locally launched tritonserver.  ``start`` returns once it is ready."""

    def __init__(self, cfg: TritonLaunchConfig):
        self.cfg = cfg
        self.requested_ports = [cfg.http_port, cfg.grpc_port, cfg.metrics_port]
        self.adopted: tuple[int, int] | None = None  # (pid, start ticks) of a Triton taken over
        self.proc: subprocess.Popen | None = None
        self._pick_ports()

    def _pick_ports(self) -> None:
        """Free ports for those asked for as 0.  Only picked, not held (tritonserver binds
        without SO_REUSEPORT): a process started meanwhile may be handed one, and a start
        that dies is given fresh ones (``start``)."""
        cfg = self.cfg
        taken = set(cfg.reserved_ports) | set(self.requested_ports)
        for attr, requested in zip(("http_port", "grpc_port", "metrics_port"), self.requested_ports):
            if requested == 0:
                setattr(cfg, attr, free_port(cfg.host, avoid=taken))
                taken.add(getattr(cfg, attr))
        self.log_path = cfg.work_dir / f"tritonserver-{cfg.grpc_port}.log"

    @property
    def http_url(self) -> str:
        return f"{self.cfg.host}:{self.cfg.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"{self.cfg.host}:{self.cfg.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://{self.cfg.host}:{self.cfg.metrics_port}/metrics"

    def start(self, attempts: int = 2) -> None:
        """Launch and wait until ready (stops the child if it never gets ready).

        A tritonserver that dies while starting is launched once more: its gRPC event
        engine occasionally aborts at start-up ("epoll_wait error: Bad file descriptor"),
        and a second start succeeds."""
        if self.adopt_previous():
            return
        self.end_previous()
        for attempt in range(1, attempts + 1):
            self.launch()
            try:
                self.wait_ready(self.cfg.ready_timeout_s)
                return
            except TritonUnavailable as exc:
                died = self.proc is not None and self.proc.poll() is not None  # not a timeout
                self.stop()
                if attempt == attempts or not died:
                    raise
                log.warning("tritonserver died while starting (%s); starting it again",
                            exc.message.splitlines()[0])
                self._pick_ports()  # one of them may have been taken before it bound it
            except BaseException:
                self.stop()
                raise

    @property
    def pid(self) -> int | None:
        if self.proc is not None:
            return self.proc.pid
        return self.adopted[0] if self.adopted is not None else None

    def launch(self) -> None:
        """Start the child process without waiting for it to be ready (ending what is left of
        an earlier one that died: ``end_leftovers``)."""
        if self.proc is not None and self.proc.poll() is not None:
            end_leftovers(self.proc.pid)
        cfg = self.cfg
        cfg.work_dir.mkdir(parents=True, exist_ok=True)
        binary = pytriton_root() / "bin" / "tritonserver"
        backend_dir = build_backend_dir(cfg.work_dir / "backends")
        env = triton_environment(os.environ, cfg.env)
        cmd = [str(binary), *triton_args(cfg, backend_dir, self.log_path)]
        log.info("starting tritonserver: %s", printable_command(cmd))
        with open(cfg.work_dir / f"tritonserver-{cfg.grpc_port}.out", "ab") as stdout:
            self.proc = subprocess.Popen(
                cmd if cfg.outlive_parent else with_parent_death_signal(cmd),
                stdout=stdout,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                start_new_session=True,
            )
        self.adopted = None
        self._record_pid()

    def wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        url = f"http://{self.http_url}/v2/health/ready"
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise TritonUnavailable(
                    f"tritonserver exited with code {self.proc.returncode} while starting; "
                    f"last log lines:\n{self.log_tail()}"
                )
            try:
                if requests.get(url, timeout=1).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(0.1)
        raise TritonUnavailable(
            f"tritonserver was not ready after {timeout_s:.0f}s; last log lines:\n{self.log_tail()}"
        )

    def log_tail(self, lines: int = 20) -> str:
        out = []
        for path in (self.log_path, self.cfg.work_dir / f"tritonserver-{self.cfg.grpc_port}.out"):
            try:
                out.extend(path.read_text(errors="replace").splitlines()[-lines:])
            except OSError:
                continue
        return "\n".join(out[-lines:])

    def alive(self) -> bool:
        if self.proc is None and self.adopted is not None:
            return process_start_ticks(self.adopted[0]) == self.adopted[1]
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> None:
        """Unload every model, SIGTERM, wait; a Triton launched here or adopted alike."""
        proc = self.proc
        if proc is None and self.adopted is None:
            return
        if self.alive():
            unloaded = self._unload_all()
            wait_s = min(UNLOADED_EXIT_S, self.cfg.stop_timeout_s) if unloaded else self.cfg.stop_timeout_s
            if not self._terminate(wait_s):
                if unloaded:
                    # Every model it listed is unloaded: what it waits for is an instance
                    # whose python-backend process died (Triton keeps it live and never
                    # finishes unloading it, for its whole --exit-timeout-secs).
                    log.info("tritonserver %s unloaded every model but had not exited %.0fs "
                             "after SIGTERM (an instance whose process died); ending it",
                             self.pid, wait_s)
                    self.kill_unanswering()
                else:
                    log.warning("tritonserver %s ignored SIGTERM for %ss; killing", self.pid,
                                self.cfg.stop_timeout_s)
                    self._kill_now()
        if proc is not None:
            self._forget_pid(proc)
        elif self.adopted is not None:  # gone before the stop
            self._forget_adopted()

    def _terminate(self, wait_s: float) -> bool:
        """SIGTERM, then wait ``wait_s`` at most: True when it exited (an adopted Triton is
        forgotten then)."""
        proc = self.proc
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=wait_s)
            except subprocess.TimeoutExpired:
                return False
            return True
        pid, start_ticks = self.adopted
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
        if not self._wait_gone(pid, start_ticks, wait_s):
            return False
        self._forget_adopted()
        return True

    def _kill_now(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        else:
            self._kill_adopted()

    def _unload_all(self, timeout_s: float = 10.0) -> bool:
        """Unload every loaded model, all at once, before the SIGTERM: on SIGTERM Triton
        unloads them too, but looks whether they are gone only once a second, so each stop
        took a second or two more than its models' unloads.  What fails here (a server that
        does not answer, model control restricted with a key this process was not given) is
        left to Triton's own shutdown.  True when every model was seen unloaded."""
        from concurrent.futures import ThreadPoolExecutor

        base = f"http://{self.http_url}/v2/repository"
        headers = {RESTRICTED_KEY_HEADER: self.cfg.restricted_key} if self.cfg.restricted_key else {}
        try:
            resp = requests.post(f"{base}/index", json={"ready": True}, headers=headers, timeout=2)
            if resp.status_code != 200:
                return False
            names = [m["name"] for m in resp.json()]
        except (requests.RequestException, ValueError, KeyError, TypeError):
            return False
        if not names:
            return True

        def unload(name: str) -> None:
            with contextlib.suppress(requests.RequestException):
                requests.post(f"{base}/models/{name}/unload", headers=headers, timeout=timeout_s)

        with ThreadPoolExecutor(min(8, len(names))) as pool:
            list(pool.map(unload, names))
        # The unload API answers once an unload has started: wait until each has been seen
        # gone (a control plane still attached may load one again meanwhile: not waited for).
        left = set(names)
        deadline = time.monotonic() + timeout_s
        while left and time.monotonic() < deadline:
            try:
                resp = requests.post(f"{base}/index", json={}, headers=headers, timeout=2)
                states = {m.get("name"): m.get("state") for m in resp.json()}
            except (requests.RequestException, ValueError, AttributeError):
                return False
            left = {n for n in left if states.get(n) in ("READY", "UNLOADING")}
            if left:
                time.sleep(0.05)
        return not left

    def kill_unanswering(self, wait_s: float = 10.0) -> None:
        """End a tritonserver that stopped answering (SIGSTOP, a hung GPU, a stuck backend):
        it never exits on its own, and SIGKILL ends a stopped process too.  The python-backend
        shared memory it would have freed on a clean exit is removed for it.  Blocking (waits
        for the exit, ``wait_s`` at most): run it off the event loop.  A ``launch`` meanwhile
        is left alone: the process is taken once, here."""
        proc, adopted = self.proc, self.adopted
        pid = proc.pid if proc is not None else (adopted[0] if adopted is not None else None)
        if pid is None or not self.alive():
            return
        shm = _shm_regions_of(pid)
        if proc is not None:
            proc.kill()
            try:
                proc.wait(timeout=wait_s)
            except subprocess.TimeoutExpired:
                log.error("tritonserver %d did not exit %.0fs after SIGKILL", pid, wait_s)
                return
        else:
            self._kill_adopted()
        end_leftovers(pid)
        for path in shm:
            Path(path).unlink(missing_ok=True)

    def kill(self) -> None:
        """Simulate a crash (tests)."""
        if self.proc is None and self.adopted is not None:
            self._kill_adopted()
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
