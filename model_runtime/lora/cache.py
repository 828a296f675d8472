"""The adapter cache inside a LoRA model: device slots, host memory, adapter directory.

Tiers, fastest first:

* **device**: ``max_device_adapters`` slots of the ``LoraBank`` (GPU memory on a GPU
  instance).  A batch can only use adapters in a slot.  LRU; pinned adapters never leave.
* **host**: up to ``max_host_adapters`` validated adapters in host memory (pinned memory on a
  GPU instance, so the swap-in is one async copy).  LRU.
* **cold**: the adapter directory (``<adapter_dir>/<name>/``, PEFT layout), which the control
  plane fills like any other artifact (copied from the object store into the warm tier).

How a request's adapter gets to a slot (``lease``):

* in a slot: used as is (device hit);
* in host memory: copied into a free slot, or into the least recently used unpinned slot
  that the batch is not using (host hit; the copy is the "swap-in");
* only on disk: read and validated on the loader thread (cold miss) while the lease
  answers "pending" with a Future.  Disk reads never happen under the lock, so a cold load
  never blocks a batch whose adapters are resident; it costs it at most one swap-in copy.
* unknown, disabled, or refused earlier: an error for the requests that named it only.

Where the control plane decides (``managed``: the manifest's ``residency`` is
``control_plane``), only the first case serves: an adapter in host memory or on disk is
``AdapterNotLoaded`` (NOT_FOUND) for its requests, and a slot changes hands only by a
``load`` control command naming the adapters it evicts; the cache never picks a victim.
The host tier stays as the adapters' warm copy, so a slot filled again after an eviction is
one device copy.

Thread safety: one ``RLock`` guards all of the cache's state and the bank.  ``lease`` holds
it for the batch's forward pass too, so a slot cannot be rewritten while a batch reads it.
The loader thread takes it only to insert a finished adapter.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from contextlib import contextmanager
from itertools import compress

from .bank import LoraBank
from .cache_control import CacheControl
from .errors import (
    AdapterCapacityExhausted,
    AdapterNotFound,
    AdapterNotLoaded,
    AdapterRefused,
    InvalidRequest,
    LoraError,
)
from .leases import AdapterStats, Lease, done_future, future_error
from .names import validate_adapter_name
from .peft import CONFIG_FILE, LoraAdapter, adapter_signature, read_adapter
from .policy import LruTier
from .source import AdapterSource

__all__ = ["AdapterCache", "AdapterSource", "AdapterStats", "Lease", "future_error"]

log = logging.getLogger(__name__)


class AdapterCache(CacheControl):
    def __init__(
        self,
        bank: LoraBank,
        source: AdapterSource,
        *,
        max_host_adapters: int = 64,
        base_name: str = "base",
        all_linear_excluded: Iterable[str] = (),
        loader: Executor | None = None,
        reader: Callable[..., LoraAdapter] = read_adapter,
        load_delay_s: float = 0.0,
        clock: Callable[[], float] = time.perf_counter,
        wall_clock: Callable[[], float] = time.time,
    ):
        self.bank = bank
        self.source = source
        self.base_name = base_name
        self.all_linear_excluded = tuple(all_linear_excluded)
        self.device_tier = LruTier(bank.num_slots, "device")
        self.host_tier = LruTier(max_host_adapters, "host")
        self.lock = threading.RLock()
        self._owns_loader = loader is None
        self._loader = loader or ThreadPoolExecutor(max_workers=1, thread_name_prefix="lora-load")
        self._reader = reader
        self._load_delay_s = load_delay_s  # test hook: makes a cold load observably slow
        self._clock = clock
        self._wall_clock = wall_clock
        self._pin_host = bank.device.type == "cuda"

        self._host: dict[str, LoraAdapter] = {}
        self._slot_of: dict[str, int] = {}
        self._free_slots = list(range(bank.num_slots, 0, -1))  # pop() gives slot 1 first
        self._loading: dict[str, Future] = {}
        self._refused: dict[str, tuple[AdapterRefused, tuple]] = {}
        self._pinned: set[str] = set()
        self._disabled: set[str] = set()
        self._stats: dict[str, AdapterStats] = {}
        # The hot path's statistics (requests whose adapter was already in a slot, and when
        # each adapter was last used), kept apart from AdapterStats so that a batch counts
        # them with C loops (Counter.update, dict.update): a Python update of a hundred
        # AdapterStats objects, cold after the rest of the process's work, took a 100-adapter
        # batch's lease from about 40 to about 55 us (measured).
        self._resident_requests: Counter[str] = Counter()
        self._last_used: dict[str, float] = {}
        self._meta: dict[str, tuple[int, int]] = {}  # name -> (rank, bytes) once loaded
        self._control_errors: dict[str, str] = {}  # pin/preload failures, for status
        # The control plane decides which adapters hold the slots (the manifest says so).
        self.managed = False
        self.manifest_generation: int | None = None
        self.manifest_error: str | None = None
        self._closed = False

    # ------------------------------------------------------------------ data path

    @contextmanager
    def lease(
        self, names: Iterable[str | None], count: Iterable[bool] | None = None
    ) -> Iterator[Lease]:
        """Put the adapters of one batch into device slots and hold the lock until the block
        ends (run the forward inside it).  ``names`` has one entry per request (None = base).
        ``count`` (parallel to ``names``, default all True) says which requests enter the
        statistics, so a request retried after a cold load or in a later wave counts once."""
        names = list(names)
        counted = names if count is None else list(compress(names, count))
        with self.lock:
            yield self._assign(names, counted)

    def _assign(self, names: list[str | None], counted: list[str | None]) -> Lease:
        lease = Lease()
        distinct = dict.fromkeys(names)
        now = self._wall_clock()
        base_rows = None in distinct
        distinct.pop(None, None)
        # Adapters already in a slot go first, so they are protected before any swap-in of
        # this batch picks a victim.  They are the hot path (validated when admitted): one
        # dict lookup each, and their statistics in bulk, since a batch can name a hundred.
        slot_of = self._slot_of
        resident: dict[str, int] = {}
        elsewhere = []
        for name in distinct:
            slot = slot_of.get(name)
            if slot is None:
                elsewhere.append(name)
            else:
                resident[name] = slot
        if resident:
            self.device_tier.touch_all(resident)
            served = counted
            if elsewhere:  # count only the requests served from a slot here
                served = [name for name in counted if name in resident]
            self._resident_requests.update(served)
            self._resident_requests.pop(None, None)  # base rows
            self._last_used.update(dict.fromkeys(resident, now))
        if base_rows:
            lease.slots[None] = 0
        lease.slots.update(resident)
        counts = Counter(counted) if elsewhere else Counter()
        for name in elsewhere:
            try:
                slot, hit = self._ready_slot(name, protect=lease.slots.keys())
            except (AdapterNotFound, InvalidRequest) as exc:
                lease.errors[name] = exc  # no statistics for names that are not adapters
                continue
            except LoraError as exc:
                lease.errors[name] = exc
                hit = None
                slot = 0
            stats = self._stats.setdefault(name, AdapterStats())
            stats.requests += counts[name]
            self._last_used[name] = now
            if hit == "device":
                stats.device_hits += counts[name]
            elif hit == "host":
                stats.host_hits += counts[name]
            if name in lease.errors:
                continue
            if slot is None:
                lease.overflow.add(name)
            elif slot < 0:
                stats.misses += counts[name]
                lease.pending[name] = self._ensure_host(name)
            else:
                lease.slots[name] = slot
        return lease

    def _ready_slot(self, name: str, protect) -> tuple[int | None, str | None]:
        """(slot, "device"|"host") when the adapter is in a slot now; (-1, None) if it must
        come from disk first; (None, None) if every slot is in use by this batch.  Raises
        for disabled, unknown or refused adapters."""
        validate_adapter_name(name)
        if name in self._disabled:
            raise AdapterNotFound(f"adapter {name!r} is disabled on {self.base_name}")
        slot = self._slot_of.get(name)
        if slot is not None:
            self.device_tier.touch(name)
            self.host_tier.touch(name)
            return slot, "device"
        if self.managed:
            if name not in self._host and not self.source.exists(name):
                raise AdapterNotFound(f"adapter {name!r} not found for {self.base_name}: no "
                                      f"{self.source.path(name)} directory with {CONFIG_FILE}")
            raise AdapterNotLoaded(
                f"Request for unknown model: adapter {name!r} of {self.base_name} is not in a "
                "device slot; the control plane loads it for requests sent through the router "
                f"(or: mmctl adapter load {self.base_name} {name})")
        if name in self._host:
            self.host_tier.touch(name)
            slot = self._swap_in(name, protect)
            return slot, ("host" if slot is not None else None)
        refusal = self._refusal(name)
        if refusal is not None:
            raise refusal
        if name not in self._loading and not self.source.exists(name):
            raise AdapterNotFound(
                f"adapter {name!r} not found for {self.base_name}: no {self.source.path(name)} "
                f"directory with {CONFIG_FILE}; stage it first"
            )
        return -1, None

    def _refusal(self, name: str) -> LoraError | None:
        """Why ``name`` was refused, while its files are the ones refused (re-staged since:
        forgotten, read again).  Call with the lock held."""
        refused = self._refused.get(name)
        if refused is None:
            return None
        error, signature = refused
        if signature == adapter_signature(self.source.path(name)):
            return error
        del self._refused[name]
        return None

    def _forget_if_replaced(self, name: str) -> None:
        """Drop the host copy (and slot) of ``name`` when its files changed since it was read
        (``mmctl adapter add --replace``): the next load reads the new ones.  Call with the
        lock held (no batch reads a slot meanwhile)."""
        held = self._host.get(name)
        if (held is None or not held.signature  # not read from files: nothing to compare
                or held.signature == adapter_signature(self.source.path(name))):
            return
        log.info("adapter %s was replaced on disk; reading it again", name)
        if name in self._slot_of:
            self._free_slots.append(self._evict_device(name))
        del self._host[name]
        self.host_tier.remove(name)

    def _swap_in(self, name: str, protect=()) -> int | None:
        """Copy a host-tier adapter into a slot, evicting the LRU unpinned adapter that is
        not in ``protect``.  None when every slot is in use by ``protect``."""
        if self._free_slots:
            slot = self._free_slots.pop()
        elif self.managed:
            raise AdapterCapacityExhausted(
                f"cannot load adapter {name!r}: all {self.bank.num_slots} device slots of "
                f"{self.base_name} hold adapters and the control plane named none of them to "
                "evict")
        else:
            victim = self.device_tier.victim(protect)
            if victim is None:
                if self.device_tier.all_pinned():
                    raise AdapterCapacityExhausted(
                        f"cannot load adapter {name!r}: all {self.bank.num_slots} device slots "
                        f"of {self.base_name} hold pinned adapters "
                        f"({', '.join(sorted(self.device_tier.pinned))}); unpin one or raise "
                        "max_device_adapters"
                    )
                return None
            slot = self._evict_device(victim, clear=False)  # write() overwrites the slot whole
        started = self._clock()
        self.bank.write(slot, self._host[name])
        self.bank.synchronize()
        self._stats.setdefault(name, AdapterStats()).swap_in_s = self._clock() - started
        self._slot_of[name] = slot
        self.device_tier.add(name)
        if name in self._pinned:
            self.device_tier.pin(name)
        return slot

    def _evict_device(self, name: str, clear: bool = True) -> int:
        slot = self._slot_of.pop(name)
        self.device_tier.remove(name)
        self.device_tier.unpin(name)
        if clear:
            self.bank.clear(slot)
        log.info("evicted adapter %s from device slot %d", name, slot)
        return slot

    def _ensure_host(self, name: str) -> Future:
        """A Future that completes once ``name`` is in host memory (one load per adapter;
        late callers share it).  Fails with the loader's LoraError."""
        with self.lock:
            if name in self._host:
                return done_future()
            future = self._loading.get(name)
            if future is None:
                if self._closed:
                    return done_future(error=InvalidRequest("the adapter cache is closed"))
                future = self._loader.submit(self._load_cold, name)
                self._loading[name] = future
            return future

    def _load_cold(self, name: str) -> None:
        started = self._clock()
        path = self.source.path(name)
        try:
            if self._load_delay_s:
                time.sleep(self._load_delay_s)
            adapter = self._reader(
                path,
                self.bank.targets,
                name=name,
                max_rank=self.bank.max_rank,
                dtype=self.bank.dtype,
                all_linear_excluded=self.all_linear_excluded,
                base_name=self.base_name,
            )
            if self._pin_host:
                adapter = adapter.to("cpu", pin_memory=True)
        except AdapterRefused as exc:
            log.error("%s", exc.message)
            with self.lock:
                self._loading.pop(name, None)
                self._refused[name] = (exc, adapter_signature(path))
            raise
        except LoraError:
            with self.lock:
                self._loading.pop(name, None)
            raise
        except Exception as exc:
            log.exception("loading adapter %s failed", name)
            with self.lock:
                self._loading.pop(name, None)
            raise LoraError(f"loading adapter {name!r} failed: {exc}") from exc
        with self.lock:
            self._loading.pop(name, None)
            if name in self._disabled:
                raise AdapterNotFound(f"adapter {name!r} was disabled on {self.base_name} while loading")
            self._insert_host(name, adapter)
            stats = self._stats.setdefault(name, AdapterStats())
            stats.cold_loads += 1
            stats.load_time_s = self._clock() - started
            log.info("loaded adapter %s (rank %d, %d bytes) in %.3fs", name, adapter.rank,
                     adapter.nbytes, stats.load_time_s)

    def _insert_host(self, name: str, adapter: LoraAdapter) -> None:
        if name not in self.host_tier and self.host_tier.full:
            victim = self.host_tier.victim()
            if victim is not None:
                self.host_tier.remove(victim)
                self._host.pop(victim, None)
        self._host[name] = adapter
        self.host_tier.add(name)
        self._meta[name] = (adapter.rank, adapter.nbytes)

    # ------------------------------------------------------------------ inspection

    def tier_of(self, name: str) -> str:
        with self.lock:
            if name in self._disabled:
                return "disabled"
            if name in self._slot_of:
                return "device"
            if name in self._host:
                return "host"
            if name in self._loading:
                return "loading"
            if name in self._refused:
                return "refused"
            return "cold" if self.source.exists(name) else "missing"

    def resident(self) -> list[str]:
        """Adapters in device slots, least recently used first."""
        with self.lock:
            return list(self.device_tier)

    def slot_status(self) -> dict:
        """The device slots alone (``partial``): what the control plane needs after a fill, in
        time that does not grow with the adapters on disk."""
        with self.lock:
            return {
                "base": self.base_name,
                "partial": True,
                "device": str(self.bank.device),
                "max_device_adapters": self.bank.num_slots,
                "device_slots_used": len(self._slot_of),
                "residency": "control_plane" if self.managed else "model",
                "adapters": [{"name": name, "tier": "device", "slot": slot,
                              "pinned": name in self._pinned}
                             for name, slot in sorted(self._slot_of.items())],
            }

    def status(self) -> dict:
        """Everything ``mmctl adapter list`` shows, as plain JSON-able data."""
        with self.lock:
            names = set(self.source.names()) | set(self._stats) | set(self._host) | set(self._slot_of)
            names |= self._pinned | self._disabled | set(self._refused) | set(self._control_errors)
            adapters = []
            for name in sorted(names):
                stats = self._stats.get(name, AdapterStats())
                resident_requests = self._resident_requests[name]
                rank, nbytes = self._meta.get(name, (None, None))
                refused = self._refused.get(name)
                adapters.append({
                    "name": name,
                    "tier": self.tier_of(name),
                    "pinned": name in self._pinned,
                    "slot": self._slot_of.get(name),
                    "rank": rank,
                    "bytes": nbytes,
                    "requests": stats.requests + resident_requests,
                    "device_hits": stats.device_hits + resident_requests,
                    "host_hits": stats.host_hits,
                    "misses": stats.misses,
                    "cold_loads": stats.cold_loads,
                    "load_time_s": stats.load_time_s,
                    "swap_in_s": stats.swap_in_s,
                    "last_used_unix": self._last_used.get(name),
                    "error": refused[0].message if refused else self._control_errors.get(name),
                })
            return {
                "base": self.base_name,
                "device": str(self.bank.device),
                "max_device_adapters": self.bank.num_slots,
                "max_host_adapters": self.host_tier.capacity,
                "max_lora_rank": self.bank.max_rank,
                "device_slots_used": len(self._slot_of),
                "host_adapters": len(self._host),
                "bank_bytes": self.bank.nbytes,
                "host_bytes": sum(a.nbytes for a in self._host.values()),
                "adapter_dir": str(self.source.root),
                "manifest_generation": self.manifest_generation,
                "manifest_error": self.manifest_error,
                "residency": "control_plane" if self.managed else "model",
                "adapters": adapters,
            }

    def close(self) -> None:
        with self.lock:
            self._closed = True
        if self._owns_loader:
            self._loader.shutdown(wait=True, cancel_futures=True)
