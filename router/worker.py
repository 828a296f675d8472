"""One router worker process: the public gRPC and HTTP ports (shared with the other workers
through SO_REUSEPORT), serving from the control plane's snapshot and nothing else.

Started by ``mmctl up`` (``control_plane.runtime.supervisor``), one per ``--router-workers``,
and by ``mmctl router``:

    python -m router.worker --control-url http://127.0.0.1:8090 --name w0 \\
        --grpc-port 8001 --http-port 8000

Its settings are declared once, in ``domain.worker_settings``; the admin token comes
from ``MMS_ADMIN_TOKEN`` (or ``MMCTL_TOKEN``) or ``--token-file``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
from dataclasses import asdict

from aiohttp import web

from domain import tracing
from domain.settings import shared_values
from domain.worker_settings import WorkerConfig, parse_worker_argv
from router.assembly import Router, RouterConfig
from router.frontends.grpc_frontend import start_grpc
from router.frontends.http_frontend import make_http_app
from router.frontends.http_site import STOP_GRACE_S, HalfCloseTCPSite
from router.serving.granted_limits import GrantedLimiter
from router.serving.metrics import RouterMetrics
from router.serving.state_client import RemoteState

log = logging.getLogger("router.worker")


def parse_args(argv: list[str] | None = None) -> WorkerConfig:
    """The worker's settings from its command line and environment (worker_settings)."""
    args = parse_worker_argv(argv)
    if args.worker is None:
        args.worker = socket.gethostname()
    return args


def read_token(args: WorkerConfig) -> str:
    """The credential this worker sends to the control plane: the data-plane token, which
    opens /v1/dataplane/* only (the admin token of an older deployment also works)."""
    token = (args.dataplane_token or args.admin_token or "").strip()
    if not token and args.token_file is not None:
        token = args.token_file.read_text().strip()
    if not token:
        raise SystemExit("router worker: no data-plane token (MMS_DATAPLANE_TOKEN, or "
                         "--token-file naming the control plane's <state-dir>/dataplane.token)")
    return token


async def serve(args: WorkerConfig) -> None:
    tracing.configure(args.trace_exporter, "mms-router")
    metrics = RouterMetrics()
    # The state's reports read the router, made once the first snapshot is in (below).
    router: Router | None = None

    def refreshed() -> None:  # a newer snapshot: route by its table and names
        if router is not None:
            router.table, router.names = state.table, state.names

    def outstanding() -> dict[str, int]:
        return router.sender.queues.outstanding_by_model() if router is not None else {}

    def shadow_counts() -> dict:
        return {} if router is None else {
            route: {k: v for k, v in asdict(report).items() if k != "last"}
            for route, report in router.shadow.reports.items()}

    state = RemoteState(args.control_url, read_token(args), args.worker,
                        request_timeout_s=args.load_timeout_s + 10, on_snapshot=refreshed,
                        outstanding=outstanding, shadow_counts=shadow_counts,
                        loop_failures=metrics.loop_failures)
    await state.start()
    limiter = GrantedLimiter(state, on_limited=lambda n: metrics.rate_limited.labels(n).inc())
    # Outcomes are judged by the control plane, over every worker: they go to it in reports.
    router = Router(state, state.table, RouterConfig(
        **shared_values(args, RouterConfig), canary_interval_s=0),
        names=state.names, metrics=metrics, stats=state, limiter=limiter)
    await router.start()
    grpc_server, grpc_port = await start_grpc(router, args.host, args.grpc_port, args.max_request_bytes,
                                              reuse_port=True)
    runner = web.AppRunner(make_http_app(router), access_log=None,
                           shutdown_timeout=STOP_GRACE_S)
    await runner.setup()
    await HalfCloseTCPSite(runner, args.host, args.http_port, reuse_port=True).start()
    log.info("router worker %s (pid %d): gRPC %s:%d, HTTP %s:%d, snapshot %d", args.worker, os.getpid(),
             args.host, grpc_port, args.host, args.http_port, state.version)
    if args.ready_file is not None:
        args.ready_file.write_text(str(os.getpid()))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await grpc_server.stop(grace=STOP_GRACE_S)
    await runner.cleanup()
    await router.stop()
    await state.stop()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format=f"%(asctime)s %(levelname)s router.{args.worker}: %(message)s")
    asyncio.run(serve(args))


if __name__ == "__main__":
    main()
