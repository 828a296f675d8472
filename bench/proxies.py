"""The reference hops bench/router_latency.py measures beside the router, as child processes.

* ``PassthroughProxy``: bench/passthrough_proxy.py, a grpc.aio generic handler forwarding
  ModelInfer bytes: the floor of any Python gRPC hop.
* ``NginxGrpcProxy``: nginx's ``grpc_pass`` (Debian ``nginx-light``): what a well-kept C
  proxy adds, the yardstick for the router's own cost.

Both start on a free loopback port, are ready when ``start()`` returns, and stop with ``stop()``.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc

from control_plane.triton.process import free_port

ROOT = Path(__file__).resolve().parent.parent
NGINX_PACKAGE = "nginx-light"
NGINX_WORKER_PROCESSES = 1
STOP_TIMEOUT_S = 10.0


def wait_ready(addr: str, proc: subprocess.Popen | None = None, timeout_s: float = 30.0) -> None:
    """Until a gRPC (HTTP/2) connection to ``addr`` opens; fails early when ``proc`` exits."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the process meant to listen on {addr} exited with {proc.returncode}")
        channel = grpc.insecure_channel(addr)
        try:
            grpc.channel_ready_future(channel).result(timeout=1)
            return
        except grpc.FutureTimeoutError:
            time.sleep(0.1)
        finally:
            channel.close()
    raise RuntimeError(f"nothing listens on {addr} after {timeout_s:.0f}s")


def stop_process(proc: subprocess.Popen | None, sig: int = signal.SIGTERM) -> None:
    """``sig``, then SIGKILL if it has not exited within STOP_TIMEOUT_S."""
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(sig)
    try:
        proc.wait(timeout=STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def host_port(url: str) -> tuple[str, int]:
    """``"localhost:8101"`` or ``"grpc://127.0.0.1:8101"`` -> ("127.0.0.1", 8101)."""
    hostport = url.split("://", 1)[-1].rstrip("/")
    host, _, port = hostport.rpartition(":")
    return ("127.0.0.1" if host in ("", "localhost") else host), int(port)


class PassthroughProxy:
    """bench/passthrough_proxy.py in a child process."""

    def __init__(self, target: str, sync: bool = False):
        self.target = target
        self.sync = sync  # grpc's thread-pool server instead of grpc.aio
        self.label = "python pass-through (sync grpc)" if sync else "python pass-through"
        self.addr = f"127.0.0.1:{free_port()}"
        self.proc: subprocess.Popen | None = None

    def start(self) -> PassthroughProxy:
        self.proc = subprocess.Popen([sys.executable, "-m", "bench.passthrough_proxy", self.addr,
                                      self.target, *(["--sync"] if self.sync else [])], cwd=ROOT)
        wait_ready(self.addr, self.proc)
        return self

    def stop(self) -> None:
        stop_process(self.proc)


def find_nginx() -> str | None:
    # /usr/sbin is often missing from a non-root PATH
    return shutil.which("nginx") or shutil.which("nginx", path="/usr/sbin:/usr/local/sbin")


def ensure_nginx(install: bool) -> tuple[str | None, str]:
    """(path of nginx, "") or (None, why it cannot be used).  As root and with ``install``,
    installs ``nginx-light`` with apt-get first when nginx is missing."""
    nginx = find_nginx()
    if nginx is None and install and os.geteuid() == 0 and shutil.which("apt-get"):
        print(f"nginx not found: apt-get install -y {NGINX_PACKAGE} ...", flush=True)
        # Debian's policy-rc.d in containers keeps the package's own nginx service from starting;
        # elsewhere the service may start on port 80, which this benchmark does not use.
        env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
        for cmd in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", NGINX_PACKAGE]):
            done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
            if done.returncode != 0:
                return None, (f"`{' '.join(cmd)}` failed ({done.returncode}): "
                              f"{(done.stderr or done.stdout).strip()[-300:]}")
        nginx = find_nginx()
    if nginx is None:
        how = "" if install else " (--no-install given)"
        return None, (f"nginx is not installed{how}; as root: apt-get update && apt-get install -y "
                      f"{NGINX_PACKAGE}")
    if "--with-http_v2_module" not in nginx_build(nginx):
        return None, f"{nginx} was built without HTTP/2 (--with-http_v2_module), so no grpc_pass"
    return nginx, ""


def nginx_build(nginx: str) -> str:
    """``nginx -V`` (version and configure arguments; nginx writes them to stderr)."""
    done = subprocess.run([nginx, "-V"], capture_output=True, text=True, check=False)
    return done.stderr + done.stdout


def nginx_version(nginx: str) -> str:
    found = re.search(r"nginx/(\S+)", nginx_build(nginx))
    return found.group(1) if found else "unknown"


def nginx_conf(workdir: Path, listen_port: int, triton_host: str, triton_port: int) -> str:
    """An nginx.conf that only forwards gRPC from a loopback HTTP/2 listener to Triton."""
    return f"""\
worker_processes {NGINX_WORKER_PROCESSES};
daemon off;
pid {workdir}/nginx.pid;
error_log {workdir}/error.log warn;

events {{
    worker_connections 1024;
}}

http {{
    access_log off;
    client_body_temp_path {workdir}/client_body;
    proxy_temp_path {workdir}/proxy;
    client_max_body_size 16m;  # as the router's --max-request-bytes default
    # The defaults (1000 requests) would close the client's HTTP/2 connection, and every
    # kept-alive upstream one, every 1000 requests: reconnects in the tail that no router pays.
    keepalive_requests 1000000;
    keepalive_timeout 600s;

    upstream triton {{
        # Kept-alive connections to Triton, as the router keeps its channel: without them
        # nginx opens a TCP connection per request.
        server {triton_host}:{triton_port};
        keepalive 32;
        keepalive_requests 1000000;
        keepalive_timeout 600s;
    }}

    server {{
        listen 127.0.0.1:{listen_port} http2;
        location / {{
            grpc_pass grpc://triton;
        }}
    }}
}}
"""


class NginxGrpcProxy:
    """nginx in the foreground (``daemon off``) with its config, pid and logs in a temp dir."""

    label = f"nginx grpc_pass ({NGINX_WORKER_PROCESSES} worker)"
    worker_processes = NGINX_WORKER_PROCESSES

    def __init__(self, nginx: str, target: str):
        self.nginx = nginx
        self.target = target
        self.addr = f"127.0.0.1:{free_port()}"
        self.workdir = Path(tempfile.mkdtemp(prefix="bench-nginx-"))
        self.proc: subprocess.Popen | None = None

    def start(self) -> NginxGrpcProxy:
        # nginx's workers drop to an unprivileged user when started as root; they must still
        # reach the temp dirs below
        self.workdir.chmod(0o755)
        host, port = host_port(self.target)
        conf = self.workdir / "nginx.conf"
        conf.write_text(nginx_conf(self.workdir, host_port(self.addr)[1], host, port))
        # -e: the error log before the config is read (the default is /var/log/nginx, root's)
        argv = [self.nginx, "-p", f"{self.workdir}/", "-e", str(self.workdir / "error.log"),
                "-c", str(conf)]
        checked = subprocess.run([*argv, "-t", "-q"], capture_output=True, text=True, check=False)
        if checked.returncode != 0:
            raise RuntimeError(f"nginx rejected {conf}: {checked.stderr.strip()}")
        self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        try:
            wait_ready(self.addr, self.proc)
        except RuntimeError as e:
            raise RuntimeError(f"{e}\nnginx error log:\n{self.error_log()}") from None
        return self

    def error_log(self) -> str:
        try:
            return (self.workdir / "error.log").read_text(errors="replace")[-2000:]
        except FileNotFoundError:
            return "(none)"

    def stop(self) -> None:
        # SIGTERM: nginx's fast shutdown (the master stops its worker, then exits)
        stop_process(self.proc, signal.SIGTERM)
        shutil.rmtree(self.workdir, ignore_errors=True)
