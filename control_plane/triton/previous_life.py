"""The Triton of a previous life of the same state directory, found through its pid file:
adopted when it was launched to outlive its control plane (supervised), otherwise waited for
and ended so that the new one can bind the ports.  A pid file names pid *and* start time, so
a pid reused by an unrelated process is never signalled.  Mixed into
``control_plane.triton.process.TritonProcess``."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import time
from pathlib import Path

import requests

from domain.errors import TritonUnavailable

log = logging.getLogger(__name__)


def process_start_ticks(pid: int) -> int | None:
    """The kernel's start time of ``pid`` (clock ticks since boot), or None when no live
    process has that pid.  A pid plus its start time names one process: a reused pid has
    another start time.  A zombie counts as gone: it holds no ports."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) "; comm may hold spaces
    if fields[0] in ("Z", "X"):
        return None
    return int(fields[19])  # field 22 of proc(5), counted from "state" = field 3


def _shm_regions_of(pid: int) -> set[str]:
    """Python-backend shared-memory files that ``pid`` has mapped (freed by a clean exit only)."""
    try:
        maps = Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return set()
    return {line.split()[-1] for line in maps.splitlines()
            if "/dev/shm/triton_python_backend_shm_region_" in line}


class PreviousLife:
    """Needs ``cfg`` (TritonLaunchConfig), ``requested_ports``, ``adopted``, ``proc``,
    ``log_path``, ``grpc_url`` and ``http_url``."""

    def adopt_previous(self) -> bool:
        """Take over the Triton of this server's previous control plane, if it outlived it.

        Only a Triton launched to outlive its parent (supervised), for the same repository
        and the same requested ports, alive and ready, is adopted: its loaded models keep
        serving (the manager's reconcile adopts them).  Anything else is for end_previous."""
        cfg = self.cfg
        if not cfg.outlive_parent or cfg.pid_file is None:
            return False
        try:
            record = json.loads(cfg.pid_file.read_text())
            pid, start_ticks = int(record["pid"]), int(record["start_ticks"])
            ports = [int(p) for p in record["ports"]]
        except (OSError, ValueError, KeyError, TypeError):
            return False
        if (not record.get("outlives") or record.get("repository") != str(cfg.repository)
                or record.get("requested") != self.requested_ports
                or process_start_ticks(pid) != start_ticks):
            return False
        try:
            ready = requests.get(f"http://{cfg.host}:{ports[0]}/v2/health/ready", timeout=2).status_code == 200
        except requests.RequestException:
            ready = False
        if not ready:
            return False
        cfg.http_port, cfg.grpc_port, cfg.metrics_port = ports
        self.log_path = cfg.work_dir / f"tritonserver-{cfg.grpc_port}.log"
        self.adopted = (pid, start_ticks)
        log.info("adopted tritonserver %d at %s from the previous control plane", pid, self.grpc_url)
        return True

    def end_previous(self) -> None:
        """Wait until the tritonserver recorded in ``pid_file`` by a previous life is gone.

        After a crash of the control plane its Triton gets SIGTERM (parent-death signal) and
        shuts down gracefully, holding its ports meanwhile; a start that does not wait fails
        to bind them.  That Triton serves nobody any more, so it gets ``previous_exit_grace_s``
        to finish, then SIGKILL; the python-backend shared memory it would have freed on a
        clean exit is removed for it.  The pid file names pid and start time, so a pid reused
        by an unrelated process is never signalled."""
        pid_file = self.cfg.pid_file
        if pid_file is None:
            return
        try:
            record = json.loads(pid_file.read_text())
            pid, start_ticks = int(record["pid"]), int(record["start_ticks"])
        except FileNotFoundError:
            return
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.warning("ignoring unreadable Triton pid file %s: %s", pid_file, exc)
            pid_file.unlink(missing_ok=True)
            return
        if process_start_ticks(pid) != start_ticks:  # gone already, or the pid was reused
            pid_file.unlink(missing_ok=True)
            return
        log.warning("tritonserver %d of a previous run of this state directory is still "
                    "running; waiting up to %.0fs for it to exit", pid, self.cfg.previous_exit_grace_s)
        shm = _shm_regions_of(pid)
        try:
            os.kill(pid, signal.SIGTERM)  # a no-op for a Triton that is already stopping
        except ProcessLookupError:
            pass
        if not self._wait_gone(pid, start_ticks, self.cfg.previous_exit_grace_s):
            log.warning("tritonserver %d did not exit in %.0fs; killing it", pid,
                        self.cfg.previous_exit_grace_s)
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            if not self._wait_gone(pid, start_ticks, 10.0):
                raise TritonUnavailable(
                    f"tritonserver {pid} from a previous run still holds this state directory "
                    f"after SIGKILL; stop it (kill -9 {pid}) and start again")
            for path in shm:  # a killed Triton leaves them behind; the stubs exit on their own
                Path(path).unlink(missing_ok=True)
        pid_file.unlink(missing_ok=True)

    @staticmethod
    def _wait_gone(pid: int, start_ticks: int, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while process_start_ticks(pid) == start_ticks:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)
        return True

    def _record_pid(self) -> None:
        if self.cfg.pid_file is None or self.proc is None:
            return
        cfg = self.cfg
        record = {"pid": self.proc.pid, "start_ticks": process_start_ticks(self.proc.pid),
                  "grpc": self.grpc_url, "http": self.http_url,
                  "ports": [cfg.http_port, cfg.grpc_port, cfg.metrics_port],
                  "requested": self.requested_ports, "repository": str(cfg.repository),
                  "outlives": cfg.outlive_parent}
        tmp = self.cfg.pid_file.with_name(self.cfg.pid_file.name + ".tmp")
        tmp.write_text(json.dumps(record))
        os.replace(tmp, self.cfg.pid_file)

    def _kill_adopted(self) -> None:
        """An adopted Triton is not our child: SIGKILL it by pid, wait for it by start time."""
        pid, start_ticks = self.adopted
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        if not self._wait_gone(pid, start_ticks, 10.0):
            log.error("tritonserver %d did not exit 10s after SIGKILL", pid)
        self._forget_adopted()

    def _forget_adopted(self) -> None:
        """The adopted Triton is gone: no pid file names it, nothing is adopted."""
        if self.cfg.pid_file is not None:
            self.cfg.pid_file.unlink(missing_ok=True)
        self.adopted = None

    def _forget_pid(self, proc: subprocess.Popen) -> None:
        """Remove the pid file if it still names ``proc`` (gone: nothing to wait for)."""
        pid_file = self.cfg.pid_file
        if pid_file is None:
            return
        try:
            if json.loads(pid_file.read_text()).get("pid") == proc.pid:
                pid_file.unlink(missing_ok=True)
        except (OSError, ValueError, AttributeError):
            pass
