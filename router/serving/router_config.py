"""The settings of a Router and of the parts it is built from (``router.assembly``)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass
class RouterConfig:
    load_timeout_s: float = 120.0
    request_timeout_s: float = 60.0
    max_request_bytes: int = 16 * 1024 * 1024
    shadow_queue_size: int = 64
    shadow_workers: int = 2
    shadow_timeout_s: float = 5.0
    shadow_log_dir: Path | None = None
    canary_interval_s: float = 1.0  # 0: canaries are judged elsewhere (the control plane)
    # Shared-memory registrations, shared by the router workers of one host (None: this
    # process's own, in a temporary directory).
    shared_memory_dir: Path | None = None
    # Misses one client may cause a second (miss_budget.MissBudget; 0: no budget), and the
    # trusted header that names clients (None: their peer address).
    miss_budget_per_s: float = 0.0
    client_header: str | None = None
