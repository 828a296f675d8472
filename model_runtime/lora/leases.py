"""What the adapter cache hands out: a batch's ``Lease``, Futures for background loads,
and per-adapter statistics."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field

from .errors import LoraError, RuntimeClosing


@dataclass
class AdapterStats:
    """Counts of the slow paths.  Requests whose adapter was already in a device slot, and
    when each adapter was last used, the cache counts in bulk (``AdapterCache.status`` adds
    them in)."""

    requests: int = 0
    device_hits: int = 0
    host_hits: int = 0
    misses: int = 0  # requests that waited for a cold load
    cold_loads: int = 0
    load_time_s: float | None = None  # last cold load: read + validate, disk -> host
    swap_in_s: float | None = None  # last host -> device copy into a slot


@dataclass
class Lease:
    """What ``AdapterCache.lease`` decided for each distinct adapter name of a batch."""

    slots: dict[str | None, int] = field(default_factory=dict)  # ready: name -> bank slot
    errors: dict[str, LoraError] = field(default_factory=dict)  # fail these requests
    pending: dict[str, Future] = field(default_factory=dict)  # cold: done when in host memory
    overflow: set[str] = field(default_factory=set)  # no free slot in this batch: next wave


def future_error(future: Future) -> BaseException | None:
    """The Future's exception; a cancelled Future (the model is unloading) counts as one."""
    if future.cancelled():
        return RuntimeClosing("the model is being unloaded")
    return future.exception()


def done_future(result=None, error: BaseException | None = None) -> Future:
    """A Future that is already done: with ``result``, or failed with ``error``."""
    future: Future = Future()
    if error is None:
        future.set_result(result)
    else:
        future.set_exception(error)
    return future
