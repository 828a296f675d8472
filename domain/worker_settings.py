"""A router worker's settings, declared once (``domain.settings``).

``mmctl router`` takes the user-facing ones as options; ``mmctl up`` shares the public
ports, request size, load timeout and log level with the same declarations (its
``--router-host`` is this ``--host``); the worker process parses them back
(``python -m router.worker``).  A light module: mmctl imports it for its options,
without the router's serving code.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from domain.settings import (
    ADMIN_TOKEN,
    DATAPLANE_TOKEN,
    LOG_LEVEL,
    TRACE_EXPORTER,
    file_path,
    parse_argv,
    setting,
)
from domain.sizes import parse_size, size_text

PROG = "python -m router.worker"
DESCRIPTION = ("One router worker process: the public gRPC and HTTP ports, serving from the "
               "control plane's snapshot.")


@dataclass
class WorkerConfig:
    control_url: str | None = setting(
        None, "The control plane's admin API; several comma-separated (a leader and its "
        "standbys) are tried in turn.", flag="--control-url", required=True,
        aliases=("MMCTL_CONTROL_URL",))
    worker: str | None = setting(
        None, "This worker's name (default: the host name).", flag="--name",
        env="MMS_ROUTER_NAME", old_flags=("--worker",))
    host: str = setting(
        "127.0.0.1", "Address of the public ports (0.0.0.0 to serve other machines).",
        flag="--host", env="MMS_ROUTER_HOST")
    grpc_port: int = setting(8001, "Public Triton gRPC port.", flag="--grpc-port", parse=int,
                             env="MMS_ROUTER_GRPC_PORT")
    http_port: int = setting(8000, "Public KServe v2 HTTP port (also /metrics).",
                             flag="--http-port", parse=int, env="MMS_ROUTER_HTTP_PORT")
    max_request_bytes: int = setting(
        16 * 1024 * 1024, "Largest inference request the router accepts.",
        flag="--max-request-bytes", parse=parse_size, show=size_text, metavar="SIZE")
    load_timeout_s: float = setting(120.0, "Seconds a request waits for its model to load.",
                                  flag="--load-timeout", parse=float)
    miss_budget: float = setting(
        2.0, "Misses (requests that wait for their model to load or a slot to fill) one client "
        "may cause a second in each router worker, and 10 s of them at once; past it the client "
        "gets RESOURCE_EXHAUSTED / 429 before anything is loaded or evicted for it. A client is "
        "its peer address (an IPv6 one by its /64; loopback peers are not counted) or "
        "--client-header. 0: no budget.",
        flag="--miss-budget", parse=float)
    client_header: str | None = setting(
        None, "Header that names the client for the miss budget, set by a proxy you trust "
        "(e.g. X-Forwarded-For): the last comma-separated entry of all its lines; calls "
        "without it count against their peer address (IPv6 by /64).",
        flag="--client-header")
    token_file: Path | None = setting(
        None, "File holding the data-plane token, read when neither MMS_DATAPLANE_TOKEN nor "
        "MMS_ADMIN_TOKEN (or MMCTL_TOKEN) is set.", flag="--token-file", parse=file_path, metavar="PATH",
        env="MMS_ROUTER_TOKEN_FILE")
    # The data-plane token (environment only: argv is visible); a worker configured with the
    # admin token instead (a deployment from before the data-plane token) still works.
    dataplane_token: str | None = DATAPLANE_TOKEN.field()
    admin_token: str | None = ADMIN_TOKEN.field()
    log_level: str = LOG_LEVEL.field()
    trace_exporter: str | None = TRACE_EXPORTER.field()
    # Plumbing from mmctl up's supervisor: files and folders in its run directory.
    shadow_log_dir: Path | None = setting(
        None, "Where shadow comparisons are written.", flag="--shadow-log-dir", parse=Path,
        internal=True)
    shared_memory_dir: Path | None = setting(
        None, "Clients' system shared-memory registrations, shared with the other workers of "
        "this host (default: this worker's own).", flag="--shared-memory-dir", parse=Path,
        internal=True)
    ready_file: Path | None = setting(
        None, "Written once the ports are bound (the supervisor waits for it).",
        flag="--ready-file", parse=Path, internal=True)


def parse_worker_argv(argv: list[str] | None = None) -> WorkerConfig:
    return parse_argv(WorkerConfig, argv, PROG, DESCRIPTION)
