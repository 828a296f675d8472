"""How long a large JSON inference request holds up the router's event loop.

A heartbeat task sleeps 1 ms at a time on the loop and records how late it wakes up: that
lateness is what every other request on the loop waits.  Large JSON bodies (FP32 data in
JSON) are checked one after another, on the loop (``parse_infer_request``) and through
``read_infer_request`` (a worker thread above ``PARSE_IN_THREAD_BYTES``); the heartbeat's
lateness is reported for each, with the time one check takes.  No sockets: the request
checking alone, as the HTTP front end runs it.

    .venv/bin/python -m bench.http_parse_offloop [--mib 16 4 1] [--bodies 5]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time

from router.frontends.http_request import (
    PARSE_IN_THREAD_BYTES,
    parse_infer_request,
    read_infer_request,
)

HEARTBEAT_S = 0.001


def json_body(mib: float) -> bytes:
    rng = random.Random(1)
    count = int(mib * (1 << 20) / 20)  # about 20 characters per float in JSON
    doc = {"inputs": [{"name": "FEATURES", "shape": [1, count], "datatype": "FP32",
                       "data": [rng.random() for _ in range(count)]}]}
    return json.dumps(doc).encode()


async def _heartbeat(lags_s: list[float], stop: asyncio.Event) -> None:
    while not stop.is_set():
        start = time.perf_counter()
        await asyncio.sleep(HEARTBEAT_S)
        lags_s.append(time.perf_counter() - start - HEARTBEAT_S)


async def _run(body: bytes, bodies: int, threaded: bool) -> dict:
    lags_s: list[float] = []
    stop = asyncio.Event()
    beat = asyncio.create_task(_heartbeat(lags_s, stop))
    await asyncio.sleep(0.05)
    lags_s.clear()
    checks_s = []
    for _ in range(bodies):
        start = time.perf_counter()
        if threaded:
            await read_infer_request(body, None, None, len(body))
        else:
            parse_infer_request(body, None)
        checks_s.append(time.perf_counter() - start)
        await asyncio.sleep(0.02)
    stop.set()
    await beat
    lags_s.sort()
    return {"check_ms": round(statistics.median(checks_s) * 1000, 1),
            "loop_lag_max_ms": round(lags_s[-1] * 1000, 1),
            "loop_lag_p99_ms": round(lags_s[int(len(lags_s) * 0.99)] * 1000, 2),
            "heartbeats": len(lags_s)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=float, nargs="+", default=[16, 4, 1])
    parser.add_argument("--bodies", type=int, default=5)
    args = parser.parse_args()
    print(f"thread threshold: {PARSE_IN_THREAD_BYTES} bytes")
    for mib in args.mib:
        body = json_body(mib)
        for threaded in (False, True):
            result = asyncio.run(_run(body, args.bodies, threaded))
            where = "read_infer_request (thread)" if threaded else "parse_infer_request (loop)"
            print(json.dumps({"body_mib": round(len(body) / (1 << 20), 1), "where": where, **result}))


if __name__ == "__main__":
    main()
