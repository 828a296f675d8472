"""Control operations of the adapter cache: load, pin/unpin, unload, disable/enable, and
applying the control plane's manifest.

``CacheControl`` is a part of ``AdapterCache`` (cache.py), kept apart from the data path:
it works on the state ``AdapterCache.__init__`` sets up and takes the same ``lock``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from concurrent.futures import Future

from .errors import AdapterCapacityExhausted, AdapterNotFound, InvalidRequest, LoraError
from .leases import AdapterStats, done_future, future_error
from .manifest import RESIDENCY_CONTROL_PLANE, Manifest
from .names import validate_adapter_name

# The control operations log as the cache they are part of.
log = logging.getLogger(f"{__package__}.cache")


class CacheControl:
    """Load, pin, unload, disable and manifest operations of ``AdapterCache``."""

    # Works on the state AdapterCache.__init__ sets up, under its ``lock``, and calls its
    # data-path methods (_ensure_host, _swap_in, _evict_device).

    def load(self, name: str, evict: Iterable[str] = ()) -> Future:
        """Bring ``name`` into a device slot now (from disk if needed), in the background.
        The Future fails with the reason when the adapter is unknown, refused or no slot
        can be freed.  ``evict``: adapters whose slots it may take (the control plane's
        victims), freed only once ``name`` is in host memory, so they serve until then;
        a pinned one is kept."""
        try:
            validate_adapter_name(name)
            evict = [validate_adapter_name(v) for v in evict if v != name]
            with self.lock:
                if name in self._disabled:
                    raise AdapterNotFound(f"adapter {name!r} is disabled on {self.base_name}")
                self._forget_if_replaced(name)
                if name in self._slot_of:
                    self.device_tier.touch(name)
                    return done_future()
                refusal = self._refusal(name)  # not read again while its files are the same
                if refusal is not None:
                    raise refusal
                if name not in self._host and name not in self._loading and not self.source.exists(name):
                    raise AdapterNotFound(
                        f"adapter {name!r} not found for {self.base_name}: no "
                        f"{self.source.path(name)} directory; stage it first"
                    )
                host = self._ensure_host(name)
        except LoraError as exc:
            return done_future(error=exc)
        result: Future = Future()

        def to_device(done: Future) -> None:
            error = future_error(done)
            if error is None:
                try:
                    with self.lock:
                        if name not in self._slot_of:
                            if name not in self._host:
                                raise LoraError(f"adapter {name!r} left host memory before its swap-in; retry")
                            for victim in evict:
                                if victim in self._slot_of and victim not in self._pinned:
                                    # write() overwrites a slot whole: no clearing first
                                    self._free_slots.append(self._evict_device(victim, clear=False))
                            if self.managed:  # the control plane's fill is what a miss is now
                                self._stats.setdefault(name, AdapterStats()).misses += 1
                            if self._swap_in(name) is None:  # pragma: no cover - no batch holds slots here
                                raise AdapterCapacityExhausted(f"no device slot free for {name!r}")
                except LoraError as exc:
                    error = exc
            if error is None:
                result.set_result(None)
            else:
                result.set_exception(error)

        host.add_done_callback(to_device)
        return result

    def pin(self, name: str) -> Future:
        """Keep ``name`` in a device slot for good (loads it if needed)."""
        with self.lock:
            if name not in self._pinned and len(self._pinned) >= self.bank.num_slots:
                return done_future(error=AdapterCapacityExhausted(
                    f"cannot pin {name!r}: all {self.bank.num_slots} device slots of "
                    f"{self.base_name} are already pinned ({', '.join(sorted(self._pinned))})"
                ))
            self._pinned.add(name)
            if name in self._slot_of:
                self.device_tier.pin(name)
        future = self.load(name)

        def release_failed_pin(done: Future) -> None:
            if future_error(done) is not None:  # a pin that cannot load holds no capacity
                self.unpin(name)

        future.add_done_callback(release_failed_pin)
        return future

    def unpin(self, name: str) -> None:
        with self.lock:
            self._pinned.discard(name)
            self.device_tier.unpin(name)

    def unload(self, name: str) -> bool:
        """Drop ``name`` from device and host memory (the directory copy stays); a refusal
        is forgotten too.  Refuses pinned adapters.  True if anything was dropped."""
        validate_adapter_name(name)
        with self.lock:
            if name in self._pinned:
                raise InvalidRequest(f"adapter {name!r} is pinned on {self.base_name}; unpin it first")
            return self._drop(name)

    def _drop(self, name: str) -> bool:
        dropped = False
        if name in self._slot_of:
            self._free_slots.append(self._evict_device(name))
            dropped = True
        if name in self._host:
            del self._host[name]
            self.host_tier.remove(name)
            dropped = True
        dropped = self._refused.pop(name, None) is not None or dropped
        return dropped

    def disable(self, name: str) -> None:
        with self.lock:
            self._disabled.add(name)
            self._pinned.discard(name)
            self._drop(name)

    def enable(self, name: str) -> None:
        with self.lock:
            self._disabled.discard(name)

    def apply_manifest(self, manifest: Manifest) -> list[Future]:
        """Make the cache match ``manifest`` (idempotent).  Pins and preloads load in the
        background; their Futures are returned, failures also show in ``status()``."""
        futures = []
        with self.lock:
            for name in set(self._disabled) - set(manifest.disabled):
                self.enable(name)
            for name in manifest.disabled:
                self.disable(name)
            for name in set(self._pinned) - set(manifest.pinned):
                self.unpin(name)
            self.manifest_generation = manifest.generation
            self.managed = manifest.residency == RESIDENCY_CONTROL_PLANE
            for name in manifest.pinned:
                self._control_errors.pop(name, None)
            for name in manifest.preload:
                self._control_errors.pop(name, None)
        for name in manifest.pinned:
            futures.append(self._track(name, "pin", self.pin(name)))
        for name in manifest.preload:
            if name not in manifest.pinned:
                futures.append(self._track(name, "preload", self.load(name)))
        return futures

    def _track(self, name: str, what: str, future: Future) -> Future:
        def record(done: Future) -> None:
            error = future_error(done)
            if error is not None:
                message = getattr(error, "message", str(error))
                log.error("%s of adapter %s failed: %s", what, name, message)
                with self.lock:
                    self._control_errors[name] = f"{what} failed: {message}"

        future.add_done_callback(record)
        return future
