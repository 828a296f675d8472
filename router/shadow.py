"""Shadow traffic: mirror a fraction of a route's requests to a shadow model.

Mirrors are offered *after* the primary response is ready and go through a bounded queue:
when the shadow falls behind the mirror is dropped and counted, never queued without bound.
Shadow results, errors and timeouts never reach a client.  Each comparison (diverged or
not, max absolute difference, latency delta) is appended to a JSONL log and to metrics.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Awaitable, Callable

import numpy as np
from tritonclient.utils import triton_to_np_dtype

log = logging.getLogger(__name__)


@dataclass
class ShadowItem:
    route: str
    shadow_model: str
    request: object  # ModelInferRequest, already re-addressed to the shadow model
    primary_outputs: list[tuple[str, str, bytes]]  # (name, datatype, raw bytes)
    primary_latency_ms: float


@dataclass
class ShadowReport:
    mirrored: int = 0
    dropped: int = 0
    errors: int = 0
    timeouts: int = 0
    compared: int = 0
    diverged: int = 0
    latency_delta_ms_sum: float = 0.0
    last: list = field(default_factory=list)

    def to_dict(self) -> dict:
        return {
            "mirrored": self.mirrored, "dropped": self.dropped, "errors": self.errors,
            "timeouts": self.timeouts, "compared": self.compared, "diverged": self.diverged,
            "divergence_rate": round(self.diverged / self.compared, 6) if self.compared else None,
            "mean_latency_delta_ms": round(self.latency_delta_ms_sum / self.compared, 3)
            if self.compared else None,
        }


def outputs_of(response) -> list[tuple[str, str, bytes]]:
    return [(o.name, o.datatype, raw) for o, raw in zip(response.outputs, response.raw_output_contents)]


def compare_outputs(primary, shadow, rtol=1e-3, atol=1e-5) -> tuple[bool, float | None]:
    """(diverged, max absolute difference) between two lists of (name, datatype, bytes)."""
    if [(n, d) for n, d, _ in primary] != [(n, d) for n, d, _ in shadow]:
        return True, None
    max_diff = 0.0
    diverged = False
    for (_, dtype, a), (_, _, b) in zip(primary, shadow):
        np_dtype = triton_to_np_dtype(dtype) if dtype != "BYTES" else None
        if np_dtype is None or len(a) != len(b):
            diverged |= a != b
            continue
        x = np.frombuffer(a, dtype=np_dtype).astype(np.float64)
        y = np.frombuffer(b, dtype=np_dtype).astype(np.float64)
        if x.size:
            max_diff = max(max_diff, float(np.max(np.abs(x - y))))
        diverged |= not np.allclose(x, y, rtol=rtol, atol=atol)
    return diverged, max_diff


class ShadowMirror:
    def __init__(self, send: Callable[[str, object, float], Awaitable[object]], log_dir: Path | None,
                 queue_size: int = 64, workers: int = 2, timeout_s: float = 5.0, metrics=None):
        self.send = send
        self.log_dir = log_dir
        self.queue_size = queue_size
        # One bounded queue (and its workers) per route: a slow shadow on one route never
        # starves the mirrors of another.
        self.queues: dict[str, asyncio.Queue[ShadowItem]] = {}
        self.workers = workers
        self.timeout_s = timeout_s
        self.metrics = metrics
        self.reports: dict[str, ShadowReport] = defaultdict(ShadowReport)
        self._tasks: list[asyncio.Task] = []

    def start(self) -> None:
        """Workers start lazily, per route, on the first mirror."""

    def _queue(self, route: str) -> asyncio.Queue:
        queue = self.queues.get(route)
        if queue is None:
            queue = self.queues[route] = asyncio.Queue(maxsize=self.queue_size)
            loop = asyncio.get_running_loop()
            self._tasks += [loop.create_task(self._worker(queue)) for _ in range(self.workers)]
        return queue

    async def stop(self) -> None:
        # Cancel until done: a cancel that lands as a send completes can be absorbed.
        pending = set(self._tasks)
        while pending:
            for t in pending:
                t.cancel()
            _, pending = await asyncio.wait(pending, timeout=0.1)

    def offer(self, item: ShadowItem) -> bool:
        """Queue a mirror; drop (and count) it if the shadow is behind.  Never blocks."""
        report = self.reports[item.route]
        try:
            self._queue(item.route).put_nowait(item)
        except asyncio.QueueFull:
            report.dropped += 1
            if self.metrics:
                self.metrics.shadow_dropped.labels(item.route).inc()
            return False
        report.mirrored += 1
        return True

    async def _worker(self, queue: asyncio.Queue) -> None:
        while True:
            item = await queue.get()
            try:
                await self._mirror(item)
            except Exception:  # a shadow never takes the worker down
                log.exception("shadow mirror of %s failed", item.route)
            finally:
                queue.task_done()

    async def _mirror(self, item: ShadowItem) -> None:
        report = self.reports[item.route]
        start = time.perf_counter()
        record = {"at": time.time(), "route": item.route, "shadow": item.shadow_model}
        try:
            async with asyncio.timeout(self.timeout_s):
                response = await self.send(item.shadow_model, item.request, self.timeout_s)
        except asyncio.TimeoutError:
            report.timeouts += 1
            record["result"] = "timeout"
            self._count("timeout", item.route)
        except Exception as exc:
            report.errors += 1
            record.update(result="error", error=str(exc)[:300])
            self._count("error", item.route)
        else:
            latency_ms = (time.perf_counter() - start) * 1000
            diverged, max_diff = compare_outputs(item.primary_outputs, outputs_of(response))
            report.compared += 1
            report.diverged += int(diverged)
            delta = latency_ms - item.primary_latency_ms
            report.latency_delta_ms_sum += delta
            record.update(result="diverged" if diverged else "match", max_abs_diff=max_diff,
                          latency_ms=round(latency_ms, 3), latency_delta_ms=round(delta, 3))
            self._count("diverged" if diverged else "match", item.route)
        self._write(item.route, record)

    def _count(self, result: str, route: str) -> None:
        if self.metrics:
            self.metrics.shadow_results.labels(route, result).inc()

    def _write(self, route: str, record: dict) -> None:
        if self.log_dir is None:
            return
        self.log_dir.mkdir(parents=True, exist_ok=True)
        with open(self.log_dir / f"{route}.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")

    def report(self, route: str) -> dict:
        body = self.reports[route].to_dict()
        queue = self.queues.get(route)
        body["queue_depth"] = queue.qsize() if queue is not None else 0
        body["queue_size"] = self.queue_size
        if self.log_dir is not None:
            body["log"] = str(self.log_dir / f"{route}.jsonl")
        return body
