"""Shadow traffic: mirror a fraction of a route's requests to a shadow model.

A shadow must never slow the primary, so only the send itself runs on the serving event
loop; everything else is off it or shed:

* mirrors are offered *after* the primary response is ready, as the bytes already at hand
  (no parse or re-serialization on the loop), into a bounded queue per route: when the
  shadow falls behind the mirror is dropped and counted, never queued without bound;
* when the serving path is busy (primaries in flight at or above ``shed_inflight``, or the
  event loop running ``shed_lag_ms`` late) mirrors are shed first, at the offer and again
  just before the send, and counted;
* parsing both responses, comparing the outputs (numpy) and logging run in one analysis
  thread, handed over in batches (one wake-up per ``LAG_PROBE_S``, not one per mirror) with
  a bounded backlog; the per-route JSONL log is rotated
  (``logging.handlers.RotatingFileHandler``: ``log_max_bytes`` x ``log_backups`` files).

Shadow results, errors and timeouts never reach a client.  Each comparison (diverged or
not, max absolute difference, latency delta) goes to the log and to metrics.
"""

from __future__ import annotations

import asyncio
import contextvars
import json
import logging
import logging.handlers
import queue
import threading
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from prometheus_client import Counter
from tritonclient.grpc import service_pb2
from tritonclient.utils import triton_to_np_dtype

from domain.shadow_reports import ShadowReport

log = logging.getLogger(__name__)

Outputs = list[tuple[str, str, bytes]]  # (name, datatype, raw bytes)

LOG_MAX_BYTES = 16 * 1024 * 1024
LOG_BACKUPS = 3
ANALYSIS_QUEUE_SIZE = 1024
# Busy: the current primary plus 3 others in flight (Triton queues them), or timers firing
# 10 ms late (the loop, or the whole machine, is short of CPU).
SHED_INFLIGHT = 4
SHED_LAG_MS = 10.0
LAG_PROBE_S = 0.05


@dataclass
class ShadowItem:
    route: str
    shadow_model: str
    # The serialized ModelInferRequest (bytes) already addressed to the shadow, or a function
    # that builds it (an HTTP request, converted only when the mirror is sent: a mirror shed
    # or dropped at the offer costs no conversion).
    request: object
    # The primary's response: serialized bytes, a ModelInferResponse, Outputs, or a function
    # that returns Outputs (an HTTP answer, converted in the analysis thread).
    primary: object
    primary_latency_ms: float
    # What the control plane places for the mirror when it is not the shadow model itself:
    # ``SHADOW:ADAPTER`` for a request that named a LoRA adapter (the adapter in a slot of the
    # shadow, loaded for the mirror as for a request).
    placed: str | None = None


def outputs_of(response) -> Outputs:
    """Outputs of a ModelInferResponse, its serialized bytes, Outputs as they are, or what a
    function returns."""
    if isinstance(response, (bytes, bytearray, memoryview)):
        response = service_pb2.ModelInferResponse.FromString(bytes(response))
    elif isinstance(response, list):
        return response
    elif callable(response):
        return response()
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


@dataclass
class _Outcome:
    """What the loop hands to the analysis thread for one mirror."""
    item: ShadowItem
    result: str  # "response" | "error" | "timeout"
    response: object = None
    error: str = ""
    latency_ms: float = 0.0
    at: float = 0.0


class ShadowMirror:
    def __init__(self, send: Callable[[str, object, float], Awaitable[object]], log_dir: Path | None,
                 queue_size: int = 64, workers: int = 2, timeout_s: float = 5.0, metrics=None, *,
                 primary_inflight: Callable[[], int] | None = None,
                 shed_inflight: int = SHED_INFLIGHT, shed_lag_ms: float = SHED_LAG_MS,
                 log_max_bytes: int = LOG_MAX_BYTES, log_backups: int = LOG_BACKUPS,
                 analysis_queue_size: int = ANALYSIS_QUEUE_SIZE):
        """``send(model, request, timeout_s)`` returns the shadow's response (bytes or a
        ModelInferResponse).  ``primary_inflight()``: primaries in flight now."""
        self.send = send
        self.log_dir = log_dir
        self.queue_size = queue_size
        # One bounded queue (and its workers) per route: a slow shadow on one route never
        # starves the mirrors of another.
        self.queues: dict[str, asyncio.Queue[ShadowItem]] = {}
        self.workers = workers
        self.timeout_s = timeout_s
        self.metrics = metrics
        self.primary_inflight = primary_inflight
        self.shed_inflight = shed_inflight
        self.shed_lag_ms = shed_lag_ms
        self.log_max_bytes = log_max_bytes
        self.log_backups = log_backups
        self.loop_lag_ms = 0.0  # the latest probe's lateness
        self.reports: dict[str, ShadowReport] = defaultdict(ShadowReport)
        self._shed_metric = None
        if metrics is not None:
            self._shed_metric = Counter("mmr_shadow_shed_total",
                                        "Mirrors shed because the serving path was busy",
                                        ["route"], registry=metrics.registry)
        self._tasks: list[asyncio.Task] = []
        self.analysis_queue_size = analysis_queue_size
        self._batch: list[_Outcome] = []  # loop side, handed over by the lag probe
        self._handed = 0  # outcomes handed to the thread (written by the loop only)
        self._analysed = 0  # outcomes the thread finished (written by the thread only)
        self._analysis: queue.Queue[list[_Outcome] | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._logs: dict[str, logging.Handler] = {}  # analysis thread only

    def start(self) -> None:
        """Workers start lazily, per route, on the first mirror."""

    def _queue(self, route: str) -> asyncio.Queue:
        queue_ = self.queues.get(route)
        if queue_ is None:
            queue_ = self.queues[route] = asyncio.Queue(maxsize=self.queue_size)
            if self.metrics:  # the route's drop and shed series exist (at 0) from its first mirror
                self.metrics.shadow_dropped.labels(route)
                if self._shed_metric is not None:
                    self._shed_metric.labels(route)
            loop = asyncio.get_running_loop()
            # In a context of their own: started inside the first mirrored request, they
            # would carry its context (its client, whose miss budget every shadow miss
            # would then spend).
            if not self._tasks:
                self._tasks.append(loop.create_task(self._probe_lag(), context=contextvars.Context()))
            if self._thread is None:
                self._thread = threading.Thread(target=self._analyze_forever, name="shadow-analysis",
                                                daemon=True)
                self._thread.start()
            self._tasks += [loop.create_task(self._worker(queue_), context=contextvars.Context())
                            for _ in range(self.workers)]
        return queue_

    async def stop(self) -> None:
        # Cancel until done: a cancel that lands as a send completes can be absorbed.
        pending = set(self._tasks)
        while pending:
            for t in pending:
                t.cancel()
            _, pending = await asyncio.wait(pending, timeout=0.1)
        self._tasks.clear()
        if self._thread is not None:
            thread, self._thread = self._thread, None
            self._hand_over()
            self._analysis.put(None)
            await asyncio.to_thread(thread.join, 10)

    async def drain(self, timeout_s: float = 10.0) -> None:
        """Until every mirror offered so far is sent and analysed (tests, benchmarks)."""
        async with asyncio.timeout(timeout_s):
            for queue_ in list(self.queues.values()):
                await queue_.join()
            self._hand_over()
            await asyncio.to_thread(self._analysis.join)

    # ------------------------------------------------------------------ loop side
    def busy(self) -> str | None:
        """Why the serving path is too busy for mirrors now, or None."""
        if self.primary_inflight is not None:
            inflight = self.primary_inflight()
            if inflight >= self.shed_inflight:
                return f"{inflight} primaries in flight"
        if self.loop_lag_ms >= self.shed_lag_ms:
            return f"event loop {self.loop_lag_ms:.1f} ms late"
        return None

    def _shed(self, route: str) -> None:
        self.reports[route].shed += 1
        if self._shed_metric is not None:
            self._shed_metric.labels(route).inc()

    def _drop(self, route: str) -> None:
        self.reports[route].dropped += 1
        if self.metrics:
            self.metrics.shadow_dropped.labels(route).inc()

    def offer(self, item: ShadowItem) -> bool:
        """Queue a mirror; shed it if the serving path is busy, drop it if the shadow is
        behind (both counted).  Never blocks."""
        if self.busy() is not None:
            self._shed(item.route)
            return False
        try:
            self._queue(item.route).put_nowait(item)
        except asyncio.QueueFull:
            self._drop(item.route)
            return False
        # Each mirror offered is counted once: mirrored from here (queued, sent, analysed)
        # unless it is shed or dropped after all, when it moves to that count.
        self.reports[item.route].mirrored += 1
        return True

    async def _probe_lag(self) -> None:
        """Measure how late the loop runs a timer: the loop's own measure of being busy."""
        loop = asyncio.get_running_loop()
        while True:
            due = loop.time() + LAG_PROBE_S
            await asyncio.sleep(LAG_PROBE_S)
            self.loop_lag_ms = max(0.0, (loop.time() - due) * 1000)
            self._hand_over()

    def _hand_over(self) -> None:
        if self._batch:
            batch, self._batch = self._batch, []
            self._handed += len(batch)
            self._analysis.put_nowait(batch)

    async def _worker(self, queue_: asyncio.Queue) -> None:
        while True:
            item = await queue_.get()
            try:
                if self.busy() is not None:  # it got busy while the mirror waited
                    self.reports[item.route].mirrored -= 1
                    self._shed(item.route)
                    continue
                await self._mirror(item)
            except Exception:  # a shadow never takes the worker down
                log.exception("shadow mirror of %s failed", item.route)
                self._count_loop_failure("shadow-mirror")
            finally:
                queue_.task_done()

    async def _mirror(self, item: ShadowItem) -> None:
        start = time.perf_counter()
        at = time.time()
        try:
            request = item.request() if callable(item.request) else item.request
            async with asyncio.timeout(self.timeout_s):
                response = await self.send(item.placed or item.shadow_model, request, self.timeout_s)
        except TimeoutError:
            outcome = _Outcome(item, "timeout", at=at)
        except Exception as exc:  # noqa: BLE001 - any shadow failure is its outcome
            outcome = _Outcome(item, "error", error=str(exc)[:300], at=at)
        else:
            outcome = _Outcome(item, "response", response,
                               latency_ms=(time.perf_counter() - start) * 1000, at=at)
        if self._handed - self._analysed + len(self._batch) >= self.analysis_queue_size:
            # The analysis thread is behind: drop, never queue without bound.
            self.reports[item.route].mirrored -= 1
            self._drop(item.route)
            return
        self._batch.append(outcome)

    # ------------------------------------------------------------------ analysis thread
    def _analyze_forever(self) -> None:
        try:
            while True:
                batch = self._analysis.get()
                try:
                    if batch is None:
                        return
                    for outcome in batch:
                        try:
                            self._analyze(outcome)
                        except Exception:  # one bad response never stops the analysis
                            log.exception("shadow analysis failed")
                            self._count_loop_failure("shadow-analysis")
                        self._analysed += 1
                        # Hand the GIL over between items: the serving loop never waits
                        # behind a batch (CPython would let this thread keep it for 5 ms).
                        time.sleep(0)
                finally:
                    self._analysis.task_done()
        finally:
            for handler in self._logs.values():
                handler.close()
            self._logs.clear()

    def _analyze(self, o: _Outcome) -> None:
        item = o.item
        report = self.reports[item.route]
        record = {"at": o.at, "route": item.route, "shadow": item.shadow_model}
        if o.result == "timeout":
            report.timeouts += 1
            record["result"] = "timeout"
            self._count("timeout", item.route)
        elif o.result == "error":
            report.errors += 1
            record.update(result="error", error=o.error)
            self._count("error", item.route)
        else:
            diverged, max_diff = compare_outputs(outputs_of(item.primary), outputs_of(o.response))
            report.compared += 1
            report.diverged += int(diverged)
            delta = o.latency_ms - item.primary_latency_ms
            report.latency_delta_ms_sum += delta
            record.update(result="diverged" if diverged else "match", max_abs_diff=max_diff,
                          latency_ms=round(o.latency_ms, 3), latency_delta_ms=round(delta, 3))
            self._count("diverged" if diverged else "match", item.route)
        self._write(item.route, record)

    def _count_loop_failure(self, loop: str) -> None:
        if self.metrics:
            self.metrics.loop_failures.labels(loop).inc()

    def _count(self, result: str, route: str) -> None:
        if self.metrics:
            self.metrics.shadow_results.labels(route, result).inc()

    def _log_path(self, route: str) -> Path:
        return self.log_dir / f"{route}.jsonl"

    def _write(self, route: str, record: dict) -> None:
        if self.log_dir is None:
            return
        handler = self._logs.get(route)
        if handler is None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            handler = self._logs[route] = logging.handlers.RotatingFileHandler(
                self._log_path(route), maxBytes=self.log_max_bytes, backupCount=self.log_backups,
                encoding="utf-8")
            handler.setFormatter(logging.Formatter("%(message)s"))
        # No args: the message is written as it is, '%' included.
        handler.handle(logging.makeLogRecord({"msg": json.dumps(record), "levelno": logging.INFO}))

    def report(self, route: str) -> dict:
        body = self.reports[route].to_dict()
        queue_ = self.queues.get(route)
        body["queue_depth"] = queue_.qsize() if queue_ is not None else 0
        body["queue_size"] = self.queue_size
        body["loop_lag_ms"] = round(self.loop_lag_ms, 3)
        if self.log_dir is not None:
            body["log"] = str(self._log_path(route))
        return body
