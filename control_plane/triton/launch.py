"""How a tritonserver of the product is launched: its configuration and flags, the
allow-listed environment it gets, the python-backend directory it loads models with, and the
exec wrapper that ties its life to the control plane's.

The binary comes from the ``nvidia-pytriton`` wheel (the NGC container is the production
runtime, see docker/).  The wheel's python-backend folder has no stub, so a backend
directory is assembled outside site-packages with symlinks and the stub built for the
running interpreter.
"""

from __future__ import annotations

import errno
import importlib.util
import logging
import os
import shutil
import socket
import sys
import time
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from domain.errors import InvalidInput

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


# Triton's APIs that only the control plane may call, behind a key (Triton's restricted-API
# options): model control runs the code of any model it is pointed at; shared memory, trace
# and log settings read or write the server's memory and files.  Inference, metadata, health,
# model configuration and statistics stay open to the router workers.
RESTRICTED_APIS = ("model-repository", "shared-memory", "trace", "logging")
RESTRICTED_KEY_HEADER = "admin-key"  # HTTP header; gRPC metadata triton-grpc-protocol-admin-key


def restricted_api_args(key: str | None) -> list[str]:
    """The flags that put RESTRICTED_APIS behind ``key`` on both of Triton's protocols."""
    if not key:
        return []
    spec = f"{','.join(RESTRICTED_APIS)}:{RESTRICTED_KEY_HEADER}={key}"
    return [f"--grpc-restricted-protocol={spec}", f"--http-restricted-api={spec}"]


def printable_command(cmd: list[str]) -> str:
    """``cmd`` for a log line, with the restricted-API key replaced by ``***``."""
    marker = f":{RESTRICTED_KEY_HEADER}="
    return " ".join(arg.split(marker, 1)[0] + marker + "***" if arg.startswith(
        ("--grpc-restricted-protocol=", "--http-restricted-api=")) and marker in arg else arg
        for arg in cmd)


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


def free_port(host: str = "127.0.0.1", avoid: Collection[int] = ()) -> int:
    """A port that was free a moment ago (the kernel picks it), and not one of ``avoid``:
    ports handed out for processes that have not bound them yet (the kernel may hand a
    released port out again)."""
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
        if port not in avoid:
            return port


def hold_port(host: str, port: int = 0, wait_s: float = 10.0, option: str = "") -> socket.socket:
    """A socket bound to ``host:port`` (``port`` 0: one the kernel picks) and never listening,
    held so that no other process is handed that port while the servers that will listen on
    it are still starting (a port that is only picked can be taken in between).  It is
    bound with SO_REUSEPORT, so those servers bind the same port beside it when they set it
    too; only listening sockets are given connections, so it never takes one.

    A given port must have no listener first (SO_REUSEPORT would otherwise share it with
    whatever listens there, a previous life's server still stopping included): waited for
    up to ``wait_s``, then refused, naming ``option`` (the setting that gave the port)."""
    family, _, _, _, address = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM,
                                                  flags=socket.AI_PASSIVE)[0]
    deadline = time.monotonic() + wait_s
    while port:
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT is no listener
            try:
                probe.bind(address)
                break
            except OSError as exc:
                if exc.errno != errno.EADDRINUSE or time.monotonic() >= deadline:
                    raise _port_refused(host, port, exc, option) from None
        time.sleep(0.2)
    held = socket.socket(family, socket.SOCK_STREAM)
    held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        held.bind(address)
    except OSError as exc:
        held.close()
        raise _port_refused(host, port, exc, option) from None
    return held


def _port_refused(host: str, port: int, exc: OSError, option: str) -> InvalidInput:
    return InvalidInput(f"port {port} on {host or 'all addresses'} cannot be used ({exc.strerror}): "
                        f"stop what listens there or choose another {option or 'port'}")


def pytriton_root() -> Path:
    """The tritonserver tree inside the nvidia-pytriton wheel.  Found without importing the
    package: ``import pytriton`` loads its own Python client (gevent and more), which only
    costs start-up time and dependencies here."""
    spec = importlib.util.find_spec("pytriton")  # optional until a local Triton is started
    if spec is None or not spec.submodule_search_locations:
        raise InvalidInput(
            "the local Triton launcher needs the nvidia-pytriton wheel: run `make setup` "
            "(or pip install nvidia-pytriton), or attach to a running Triton with --attach")
    return Path(next(iter(spec.submodule_search_locations))) / "tritonserver"


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
    # Ports other processes of the product bind after this Triton starts (the admin API,
    # the router's public ports): a port picked for this Triton is never one of them.
    reserved_ports: tuple[int, ...] = ()
    # The key of Triton's restricted APIs (RESTRICTED_APIS); None: they are open to anyone
    # who reaches its ports (tests that drive a bare Triton; the product always sets one).
    restricted_key: str | None = field(default=None, repr=False)


def triton_args(cfg: TritonLaunchConfig, backend_dir: Path, log_path: Path | None) -> list[str]:
    """The flags every Triton of the product runs with, in a child process of ``mmctl up``
    or in its container (``control_plane.runtime.triton_container``).  ``log_path``: None logs
    to stdout."""
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
        *([f"--log-file={log_path}"] if log_path is not None else []),
        f"--log-verbose={cfg.log_verbose}",
        "--exit-timeout-secs=10",
        *restricted_api_args(cfg.restricted_key),
        *cfg.extra_args,
    ]


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
