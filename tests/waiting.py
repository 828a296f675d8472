"""Waiting for a condition in a test, with what to show when it never comes."""

from __future__ import annotations

import time
from collections.abc import Callable


def wait_for(predicate: Callable[[], object], timeout_s: float, what: str,
             details: Callable[[], str] = lambda: ""):
    """``predicate()``'s first true value, polled every 0.1 s; AssertionError saying ``what``
    (and ``details()``, e.g. the logs' tails) after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"{what} within {timeout_s}s\n{details()}")
