"""A fixed-rate open loop of requests per model: each model's requests evenly spaced at its
rate, with a phase drawn at random, sent whether or not the earlier ones were answered (a
closed loop would slow down with the server and hide its queue).  The benchmarks give the
one request; this sends them on time and collects ``(model, sent, finished, outcome)``."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import numpy as np

Result = tuple[str, float, float, str]  # (model, sent, finished, outcome)


def outcome_of(exc: BaseException) -> str:
    """A failed request's outcome: timeout (DEADLINE_EXCEEDED, or the client gave up),
    refused (RESOURCE_EXHAUSTED: a rate limit, a deadline, a fair share), or error: ..."""
    if isinstance(exc, TimeoutError):
        return "timeout"
    text = str(exc)
    return ("timeout" if "DEADLINE_EXCEEDED" in text
            else "refused" if "RESOURCE_EXHAUSTED" in text else f"error: {exc}")


async def open_loop(rates: dict[str, float], seconds: float, rng: np.random.Generator,
                    one: Callable[[str], Awaitable[str]]) -> list[Result]:
    """``rates[model]`` requests/s of each model for ``seconds``; ``one(model)`` sends one
    and returns its outcome (ok, wrong, or ``outcome_of`` its failure)."""
    start = time.monotonic() + 0.1
    plan = sorted((start + (i + offset) / rate, model)
                  for model, rate in rates.items() if rate > 0
                  for offset in [rng.random()]
                  for i in range(int(rate * seconds)))
    results: list[Result] = []

    async def timed(model: str) -> None:
        sent = time.monotonic()
        outcome = await one(model)
        results.append((model, sent, time.monotonic(), outcome))

    tasks = []
    for due, model in plan:
        delay = due - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.ensure_future(timed(model)))
    await asyncio.gather(*tasks)
    return results
