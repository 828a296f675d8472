"""The settings of a Router and of the parts it is built from (``router.assembly``).

Those a user sets are the router worker's declarations (``domain.worker_settings``), held
here by ``same_as``: a worker (``router.worker``) and ``mmctl up``'s in-process router fill
them with ``shared_values`` from their own settings, under one name each."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from domain.settings import same_as
from domain.worker_settings import WorkerConfig


@dataclass
class RouterConfig:
    load_timeout_s: float = same_as(WorkerConfig, "load_timeout_s")
    request_timeout_s: float = 60.0
    max_request_bytes: int = same_as(WorkerConfig, "max_request_bytes")
    shadow_queue_size: int = 64
    shadow_workers: int = 2
    shadow_timeout_s: float = 5.0
    shadow_log_dir: Path | None = same_as(WorkerConfig, "shadow_log_dir")
    canary_interval_s: float = 1.0  # 0: canaries are judged elsewhere (the control plane)
    # Shared-memory registrations, shared by the router workers of one host (None: this
    # process's own, in a temporary directory).
    shared_memory_dir: Path | None = same_as(WorkerConfig, "shared_memory_dir")
    # Misses one client may cause a second (miss_budget.MissBudget; 0: no budget), and the
    # trusted header that names clients (None: their peer address).
    miss_budget: float = same_as(WorkerConfig, "miss_budget")
    client_header: str | None = same_as(WorkerConfig, "client_header")
