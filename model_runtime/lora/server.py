"""Serving core of a LoRA model: mixed-adapter batches, deferred cold loads, control ops.

Transport-free on purpose: the Triton model (``triton_glue``) turns each request into a
``Job`` whose ``reply`` sends that request's response, and unit tests drive the same code
with plain callbacks.  Every job is answered exactly once, now or later, with a result or a
``LoraError``; ``submit`` never raises.

``submit(jobs)``, one batch:

1. ``cache.lease`` puts the adapters of the batch into device slots.  Requests whose adapter
   is unknown, disabled or refused are answered with that error; the rest go on.
2. One forward for every ready request together: ``bank.rows(index)`` gives each row its
   slot (0 = base) and ``run(jobs)`` computes the whole batch.
3. Requests whose adapter is only on disk wait for its background load and are then served
   on the resume thread, so the batch (and the next ones) does not wait for the disk.
4. Requests that found no free slot (more distinct adapters than slots) form the next wave.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .cache import AdapterCache, future_error
from .errors import AdapterCapacityExhausted, InvalidRequest, LoraError, RuntimeClosing
from .manifest import ManifestWatcher

log = logging.getLogger(__name__)

Reply = Callable[[Any, "LoraError | None"], None]


@dataclass
class Job:
    """One request: its adapter (None = base), its parsed inputs, its reply callback, and
    ``rows``, the number of batch rows it contributes (each row gets the adapter's slot)."""

    adapter: str | None
    payload: Any
    reply: Reply
    rows: int = 1
    attempts: int = 0
    counted: bool = False  # entered the adapter statistics already


Runner = Callable[[Sequence[Job]], Sequence[Any]]


class BatchServer:
    CONTROL_OPS = ("status", "sync", "load", "unload")

    def __init__(
        self,
        cache: AdapterCache,
        run: Runner,
        *,
        watcher: ManifestWatcher | None = None,
        max_attempts: int = 3,
    ):
        """``run(jobs)`` computes one result per job; it is called inside
        ``bank.rows(index)`` under the cache lock, rows in job order."""
        self.cache = cache
        self.run = run
        self.watcher = watcher
        self.max_attempts = max_attempts
        self._resume = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lora-resume")
        self._closed = threading.Event()

    # ------------------------------------------------------------------ inference

    def submit(self, jobs: Sequence[Job]) -> None:
        remaining = list(jobs)
        if self._closed.is_set():
            self._fail(remaining, RuntimeClosing("the model is being unloaded"))
            return
        while remaining:
            ready: list[Job] = []
            results: Sequence[Any] = ()
            failure: LoraError | None = None
            waiting: dict[str, list[Job]] = {}
            overflow: list[Job] = []
            refused: list[Job] = []
            counted = [not job.counted for job in remaining]
            for job in remaining:
                job.counted = True
            with self.cache.lease([job.adapter for job in remaining], counted) as lease:
                for job in remaining:
                    if job.adapter in lease.errors:
                        refused.append(job)
                    elif job.adapter in lease.slots:
                        ready.append(job)
                    elif job.adapter in lease.pending:
                        waiting.setdefault(job.adapter, []).append(job)
                    else:
                        overflow.append(job)
                if ready:
                    # Through numpy: torch.tensor on a list of ints cost 12 us a batch of 128
                    # (it looks at every element for its type), this 3.
                    index = torch.from_numpy(np.array([lease.slots[job.adapter] for job in ready],
                                                      dtype=np.int64))
                    if any(job.rows != 1 for job in ready):
                        index = index.repeat_interleave(torch.tensor([job.rows for job in ready]))
                    try:
                        with self.cache.bank.rows(index), torch.inference_mode():
                            results = self.run(ready)
                    except LoraError as exc:
                        failure = exc
                    except Exception as exc:  # one bad batch must not kill the model
                        log.exception("batch of %d requests failed", len(ready))
                        failure = LoraError(f"inference failed: {exc}")
                pending = dict(lease.pending)
            # Replies go out after the lock is released.
            for job in refused:
                self._reply(job, None, lease.errors[job.adapter])
            for i, job in enumerate(ready):
                self._reply(job, None if failure else results[i], failure)
            for name, group in waiting.items():
                pending[name].add_done_callback(lambda done, group=group: self._after_load(group, done))
            if overflow and not ready:  # pragma: no cover - lease guarantees progress
                self._fail(overflow, AdapterCapacityExhausted("no device slot could be freed"))
                return
            remaining = overflow

    def _after_load(self, jobs: list[Job], done: Future) -> None:
        error = future_error(done)
        if error is not None:
            if not isinstance(error, LoraError):
                error = LoraError(f"loading adapter failed: {error}")
            self._fail(jobs, error)
            return
        for job in jobs:
            job.attempts += 1
        retry = [j for j in jobs if j.attempts <= self.max_attempts]
        self._fail(
            [j for j in jobs if j.attempts > self.max_attempts],
            AdapterCapacityExhausted(
                "adapter was evicted from host memory before it could be used "
                f"{self.max_attempts} times; raise max_host_adapters"
            ),
        )
        if retry:
            try:
                self._resume.submit(self.submit, retry)
            except RuntimeError:  # executor shut down: the model is unloading
                self._fail(retry, RuntimeClosing("the model is being unloaded"))

    def _reply(self, job: Job, result: Any, error: LoraError | None) -> None:
        try:
            job.reply(result, error)
        except Exception:
            log.exception("sending a response failed")

    def _fail(self, jobs: Sequence[Job], error: LoraError) -> None:
        for job in jobs:
            self._reply(job, None, error)

    # ------------------------------------------------------------------ control

    def control(self, command: object, reply: Reply) -> None:
        """``{"op": "status"}``, ``{"op": "sync"}`` (re-read the manifest now, answer once its
        pins/preloads are done), ``{"op": "load", "adapter": n, "evict": [...]}`` (into a device slot now, taking the
        slots of ``evict`` if need be; ``"answer": "slots"``: answered with the slots alone),
        ``{"op": "unload", "adapter": n}`` (out of device and host memory).  Answers with
        ``status()`` or an error; slow work finishes on background threads."""
        try:
            if not isinstance(command, dict) or command.get("op") not in self.CONTROL_OPS:
                raise InvalidRequest(
                    f"ADAPTER_CONTROL must be a JSON object with op in {list(self.CONTROL_OPS)}, "
                    f"got {command!r}"
                )
            op = command["op"]
            if op == "status":
                reply(self.cache.status(), None)
                return
            if op == "sync":
                futures = self.sync()
            else:
                name = command.get("adapter")
                if not isinstance(name, str):
                    raise InvalidRequest(f"op {op!r} needs an 'adapter' name")
                if op == "unload":
                    self.cache.unload(name)
                    reply(self.cache.status(), None)
                    return
                evict = command.get("evict", [])
                if not isinstance(evict, list) or not all(isinstance(v, str) for v in evict):
                    raise InvalidRequest(f"op {op!r}: 'evict' is a list of adapter names, got {evict!r}")
                futures = [self.cache.load(name, evict)]
        except LoraError as exc:
            reply(None, exc)
            return
        self._reply_when_done(futures, reply, fail_on_error=(op == "load"),
                              slots_only=command.get("answer") == "slots")

    def sync(self) -> list[Future]:
        """Re-read the manifest now; the Futures of the pins and preloads it started."""
        if self.watcher is None:
            raise InvalidRequest("this model has no adapter manifest to sync")
        return list(self.watcher.sync() or [])

    def _reply_when_done(self, futures: list[Future], reply: Reply, fail_on_error: bool,
                         slots_only: bool = False) -> None:
        status = self.cache.slot_status if slots_only else self.cache.status
        remaining = [len(futures)]
        lock = threading.Lock()

        def one_done(done: Future) -> None:
            with lock:
                remaining[0] -= 1
                last = remaining[0] == 0
            if not last:
                return
            errors = [e for e in map(future_error, futures) if e is not None]
            if fail_on_error and errors:
                error = errors[0]
                reply(None, error if isinstance(error, LoraError) else LoraError(str(error)))
            else:  # sync answers with the status, which names each failed pin/preload
                reply(status(), None)

        if not futures:
            reply(status(), None)
            return
        for future in futures:
            future.add_done_callback(one_done)

    def close(self) -> None:
        self._closed.set()
        if self.watcher is not None:
            self.watcher.stop()
        # Queued resumes still run: they see the closed flag and answer their requests
        # with UNAVAILABLE, so no request is left without a response.
        self._resume.shutdown(wait=True)
        self.cache.close()
