"""Background loops that cannot die silently.

Every periodic job of the product (reconcile, publish, canary judgement, adapter refresh)
runs through ``run_periodically``: a step that raises is logged with its traceback and
counted (``failures``, a Counter labelled ``loop``), and the next step runs on time.  A loop
ended by one exception would stop reconciling, publishing or judging for good while the
process looked healthy.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Awaitable, Callable

from prometheus_client import Counter

log = logging.getLogger(__name__)

Step = Callable[[], "Awaitable[None] | None"]


async def guarded_step(name: str, step: Step, failures: Counter | None = None) -> bool:
    """Run one step (sync or async); False when it raised (logged and counted)."""
    try:
        result = step()
        if inspect.isawaitable(result):
            await result
        return True
    except asyncio.CancelledError:
        raise
    except Exception:  # the loop outlives any step's failure
        log.exception("background loop %s: a step failed; the next one runs as planned", name)
        if failures is not None:
            failures.labels(name).inc()
        return False


async def run_periodically(name: str, step: Step, interval_s: float | Callable[[], float],
                           failures: Counter | None = None) -> None:
    """``step`` every ``interval_s`` (a number, or read anew before each wait) until
    cancelled, whatever a step raises."""
    while True:
        await asyncio.sleep(interval_s() if callable(interval_s) else interval_s)
        await guarded_step(name, step, failures)


def loop_failures_counter(prefix: str, registry) -> Counter:
    """``<prefix>_loop_failures_total{loop}`` in ``registry``."""
    return Counter(f"{prefix}_loop_failures_total",
                   "Steps of a background loop that raised (logged; the loop went on)", ["loop"],
                   registry=registry)
