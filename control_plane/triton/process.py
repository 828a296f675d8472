"""Start, watch and stop a real ``tritonserver`` as a child process.

The binary comes from the ``nvidia-pytriton`` wheel (the NGC container is the production
runtime, see docker/).  The wheel's python-backend folder has no stub, so a backend
directory is assembled outside site-packages with symlinks and the stub built for the
running interpreter.

The child gets PR_SET_PDEATHSIG=SIGTERM: if the control plane dies, even by SIGKILL, Triton
goes with it and no orphan keeps GPU memory.  It runs in its own session, so a Ctrl-C in the
terminal reaches only the control plane, which stops Triton after draining.  ``stop`` sends
SIGTERM, then SIGKILL after a timeout.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import requests

from control_plane.domain.errors import InvalidInput, TritonUnavailable

log = logging.getLogger(__name__)

# Runs in a fresh interpreter between Popen and tritonserver: set the parent-death signal,
# then exec (the pid, and so the signal, carry over).  Setting it in the forked child instead
# (preexec_fn) can deadlock a parent that has threads, as the control plane does.  The kernel
# sends the signal when the *thread* that forked exits, so Popen runs on a long-lived thread;
# a parent that is gone before prctl would never signal, hence the getppid check.
_PDEATHSIG_EXEC = """\
import ctypes, os, signal, sys
if ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM) != 0:  # 1 = PR_SET_PDEATHSIG
    sys.exit("prctl(PR_SET_PDEATHSIG) failed: errno %d" % ctypes.get_errno())
if os.getppid() != int(sys.argv[1]):
    sys.exit("the control plane exited before tritonserver started")
os.execv(sys.argv[2], sys.argv[2:])
"""


# What reaches tritonserver, and through it every model's python stub (tenant code): only
# what Triton, CUDA, the allocators and torch read.  Never S3 keys, AWS_*, MMS_S3_*, admin
# tokens or anything else the control plane holds; a model that needs a setting gets it
# through TritonLaunchConfig.env.
TRITON_ENV_NAMES = frozenset({
    "PATH", "HOME", "USER", "LOGNAME", "HOSTNAME", "LANG", "LANGUAGE", "TZ", "TMPDIR",
    "LD_LIBRARY_PATH", "LD_PRELOAD", "MALLOC_CONF", "MALLOC_ARENA_MAX",
})
TRITON_ENV_PREFIXES = ("LC_", "CUDA_", "NVIDIA_", "NCCL_", "OMP_", "MKL_", "OPENBLAS_",
                       "PYTORCH_", "TORCH_", "TCMALLOC_", "JE_MALLOC_")
# Refused even under an allowed prefix: a name that says it holds a secret.
_SECRET_MARKERS = ("SECRET", "TOKEN", "PASSWORD", "PASSWD", "CREDENTIAL", "PRIVATE", "API_KEY",
                   "ACCESS_KEY", "AUTH")


def triton_environment(source: Mapping[str, str], extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The allow-listed part of ``source``, the stub environment, then ``extra`` (explicit)."""
    env = {
        name: value for name, value in source.items()
        if (name in TRITON_ENV_NAMES or name.startswith(TRITON_ENV_PREFIXES))
        and not any(marker in name.upper() for marker in _SECRET_MARKERS)
    }
    env.update(stub_environment())
    env.update(extra or {})
    return env


def with_parent_death_signal(cmd: list[str]) -> list[str]:
    """``cmd`` run so that it gets SIGTERM when this process (its forking thread) dies."""
    return [sys.executable, "-I", "-S", "-c", _PDEATHSIG_EXEC, str(os.getpid()), *cmd]


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago (the kernel picks it); good enough for tests."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def pytriton_root() -> Path:
    try:
        import pytriton  # optional until a local Triton is started
    except ImportError as exc:  # pragma: no cover - install hint
        raise InvalidInput(
            "the local Triton launcher needs the nvidia-pytriton wheel: run `make setup` "
            "(or pip install nvidia-pytriton), or attach to a running Triton with --triton-url"
        ) from exc
    return Path(pytriton.__file__).parent / "tritonserver"


def build_backend_dir(dest: Path) -> Path:
    """Create ``dest/python`` = the wheel's python backend + the stub for this interpreter."""
    root = pytriton_root()
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = root / "python_backend_stubs" / version / "triton_python_backend_stub"
    if not stub.exists():
        raise InvalidInput(
            f"nvidia-pytriton has no python-backend stub for Python {version} (looked for {stub})"
        )
    python_dir = dest / "python"
    python_dir.mkdir(parents=True, exist_ok=True)
    for src in [*(root / "backends" / "python").glob("*.*"), stub]:
        if src.name == "__pycache__":
            continue
        link = python_dir / src.name
        if link.is_symlink() or link.exists():
            if link.is_symlink() and os.readlink(link) == str(src):
                continue
            link.unlink()
        link.symlink_to(src)
    return dest


def stub_environment() -> dict[str, str]:
    """What the python-backend stubs need to import this environment's packages (numpy, torch).

    The stub embeds libpython in isolated mode, so PYTHONPATH and PYTHONHOME are ignored.  It
    still finds its prefix the way ``python3`` does: the first ``python3`` on PATH and a
    ``pyvenv.cfg`` beside it.  So Triton runs with this interpreter's environment active, as
    ``bin/activate`` would make it (the python backend uses "the libraries in the current
    virtualenv or conda environment"), and a model written for Triton imports what the
    product has without touching ``sys.path``.  The stub's Python minor version matches this
    interpreter's (``build_backend_dir`` picks it), which is what the packages need.
    """
    bin_dir = Path(sys.executable).parent  # not resolved: a venv's bin holds symlinks
    if not (bin_dir / "python3").exists():
        log.warning("no python3 in %s: python-backend models will see the system Python's "
                    "packages, not this environment's", bin_dir)
    env = {"PATH": os.pathsep.join([str(bin_dir), os.environ.get("PATH") or os.defpath])}
    if sys.prefix != sys.base_prefix:
        env["VIRTUAL_ENV"] = sys.prefix
    return env


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


@dataclass
class TritonLaunchConfig:
    repository: Path
    work_dir: Path
    host: str = "127.0.0.1"
    http_port: int = 0  # 0 = pick a free port
    grpc_port: int = 0
    metrics_port: int = 0
    ready_timeout_s: float = 60.0
    stop_timeout_s: float = 15.0
    log_verbose: int = 0
    extra_args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    # Where this server's pid is kept, so that a start after a crash finds the Triton of the
    # previous life (same state directory) and waits for it to let go of its ports.  One file
    # per server: servers that share a work_dir need distinct files.  None: not tracked.
    pid_file: Path | None = None
    # How long a start waits for that previous Triton to finish its graceful shutdown (it got
    # SIGTERM when its control plane died) before killing it.
    previous_exit_grace_s: float = 5.0
    # Supervised (router workers): Triton outlives a crash of its control plane, whose
    # next life adopts it (``adopt_previous``); ``mmctl up``'s supervisor reaps it.
    outlive_parent: bool = False


def triton_args(cfg: TritonLaunchConfig, backend_dir: Path, log_path: Path) -> list[str]:
    """The flags every Triton of the product runs with (docker/ uses the same set)."""
    return [
        f"--model-repository={cfg.repository}",
        "--model-control-mode=explicit",
        "--disable-auto-complete-config",
        "--strict-readiness=true",
        "--exit-on-error=false",
        f"--backend-directory={backend_dir}",
        f"--http-address={cfg.host}",
        f"--http-port={cfg.http_port}",
        f"--grpc-address={cfg.host}",
        f"--grpc-port={cfg.grpc_port}",
        "--allow-metrics=true",
        f"--metrics-address={cfg.host}",
        f"--metrics-port={cfg.metrics_port}",
        f"--log-file={log_path}",
        f"--log-verbose={cfg.log_verbose}",
        "--exit-timeout-secs=10",
        *cfg.extra_args,
    ]


class TritonProcess:
    """One locally launched tritonserver.  ``start`` returns once it is ready."""

    def __init__(self, cfg: TritonLaunchConfig):
        self.cfg = cfg
        self.requested_ports = [cfg.http_port, cfg.grpc_port, cfg.metrics_port]
        self.adopted: tuple[int, int] | None = None  # (pid, start ticks) of a Triton taken over
        for attr in ("http_port", "grpc_port", "metrics_port"):
            if getattr(cfg, attr) == 0:
                setattr(cfg, attr, free_port(cfg.host))
        self.log_path = cfg.work_dir / f"tritonserver-{cfg.grpc_port}.log"
        self.proc: subprocess.Popen | None = None

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
            except BaseException:
                self.stop()
                raise

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

    @property
    def pid(self) -> int | None:
        if self.proc is not None:
            return self.proc.pid
        return self.adopted[0] if self.adopted is not None else None

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

    def launch(self) -> None:
        """Start the child process without waiting for it to be ready."""
        cfg = self.cfg
        cfg.work_dir.mkdir(parents=True, exist_ok=True)
        binary = pytriton_root() / "bin" / "tritonserver"
        backend_dir = build_backend_dir(cfg.work_dir / "backends")
        env = triton_environment(os.environ, cfg.env)
        cmd = [str(binary), *triton_args(cfg, backend_dir, self.log_path)]
        log.info("starting tritonserver: %s", " ".join(cmd))
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

    def _stop_adopted(self, sig: int = signal.SIGTERM) -> None:
        """An adopted Triton is not our child: signal it by pid, wait for it by start time."""
        pid, start_ticks = self.adopted
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass
        if not self._wait_gone(pid, start_ticks, self.cfg.stop_timeout_s if sig == signal.SIGTERM else 10.0):
            log.warning("tritonserver %s ignored SIGTERM for %ss; killing", pid, self.cfg.stop_timeout_s)
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self._wait_gone(pid, start_ticks, 10.0)
        if self.cfg.pid_file is not None:
            self.cfg.pid_file.unlink(missing_ok=True)
        self.adopted = None

    def stop(self) -> None:
        proc = self.proc
        if proc is None:
            if self.adopted is not None:
                self._stop_adopted()
            return
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=self.cfg.stop_timeout_s)
            except subprocess.TimeoutExpired:
                log.warning("tritonserver %s ignored SIGTERM for %ss; killing", proc.pid,
                            self.cfg.stop_timeout_s)
                proc.kill()
                proc.wait(timeout=10)
        self._forget_pid(proc)

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

    def kill(self) -> None:
        """Simulate a crash (tests)."""
        if self.proc is None and self.adopted is not None:
            self._stop_adopted(signal.SIGKILL)
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)


def which_tritonserver() -> str | None:
    """A tritonserver binary on PATH (NGC container) or from the wheel, if any."""
    found = shutil.which("tritonserver")
    if found:
        return found
    try:
        binary = pytriton_root() / "bin" / "tritonserver"
    except InvalidInput:
        return None
    return str(binary) if binary.exists() else None
