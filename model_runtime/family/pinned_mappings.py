"""``PinnedMappings``: on a GPU, the warm tier's files that a family keeps mapped are
registered with CUDA as page-locked host memory, so that a fill is one device copy (DMA)
straight out of the mapping: no staging copy through a pinned buffer in host memory.

Without it a GPU fill copies each part of the file from its mapping into a pinned staging
buffer (a host memcpy) and from there to the device, the device copies overlapping the
host copies after them: the fill takes at least the host memcpy's time.  Registered, the
file's own pages (tmpfs: the host-DRAM warm tier, no copy kept anywhere else) are what the
GPU's copy engine reads.

* A mapping is registered once, when ``MappedFiles`` keeps it (the first fill of that file:
  registering pins its pages, which costs about what mapping them did), read-only
  (``cudaHostRegisterReadOnly``: the mappings are ``PROT_READ``) and for every CUDA context
  (``cudaHostRegisterPortable``), and stays registered while it is kept.
* A mapping ``MappedFiles`` forgets (least recently used beyond its bound, its file replaced
  or gone, the bank closed) is unregistered at the start of the bank's next fill, or when the
  bank closes: never while a copy may still read it (a fill waits for its copies before it
  returns, and fills run one at a time).  This object holds the mapping's array until then,
  so the memory is not unmapped while registered.
* A registration that fails (a driver without read-only registration, a host out of
  lockable memory) turns registration off for the bank, says why once in the log, and the
  fills use the staging buffer as before.  Registration and unregistration run on a thread
  of their own: a failed CUDA call leaves the runtime's last error set in the thread that
  made it, where torch's checks after its own kernel launches would report it as theirs.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np

log = logging.getLogger(__name__)

# cudaHostRegisterPortable | cudaHostRegisterReadOnly: pinned for every CUDA context of the
# process (the registering thread's current device need not be the slots'), and read-only, as
# the mappings are.
REGISTER_FLAGS = 0x01 | 0x08


def _address(array: np.ndarray) -> int:
    return int(array.__array_interface__["data"][0])


class PinnedMappings:
    """Which kept mappings are registered with CUDA.  Thread-safe."""

    def __init__(self, cudart: Callable[[], object] | None = None):
        """``cudart``: returns the CUDA runtime's bindings (``torch.cuda.cudart`` unless
        given), called on first use."""
        self._cudart_of = cudart
        self._cudart = None
        self._pinned: dict[int, np.ndarray] = {}  # address -> the mapping, held while registered
        self._forgotten: list[int] = []
        self._lock = threading.Lock()
        self.disabled: str | None = None  # why registration is off, once it failed
        self._calls = ThreadPoolExecutor(1, thread_name_prefix="slot-pin")

    def __len__(self) -> int:
        return len(self._pinned)

    def holds(self, array: np.ndarray) -> bool:
        """Whether ``array`` (a kept mapping) is registered: a fill may copy straight out of it."""
        with self._lock:
            return self._pinned.get(_address(array)) is array

    def keep(self, array: np.ndarray) -> None:
        """Register a mapping ``MappedFiles`` keeps (its ``on_keep``)."""
        with self._lock:
            if self.disabled is not None:
                return
            address = _address(array)
            failure = self._calls.submit(self._register, address, array.nbytes).result()
            if failure is None:
                self._pinned[address] = array
                return
            self.disabled = failure
        log.warning("GPU fills copy through a staging buffer: the warm tier's mappings cannot be "
                    "registered with CUDA (%s)", failure)

    def forget(self, array: np.ndarray) -> None:
        """A mapping ``MappedFiles`` forgot (its ``on_forget``): unregistered by the next
        ``release_forgotten``, when no copy reads it."""
        with self._lock:
            address = _address(array)
            if self._pinned.get(address) is array:
                self._forgotten.append(address)

    def release_forgotten(self) -> int:
        """Unregister the forgotten mappings; how many.  The caller makes sure no copy reads
        them (between fills)."""
        with self._lock:
            forgotten, self._forgotten = self._forgotten, []
            for address in forgotten:
                failure = self._calls.submit(self._unregister, address).result()
                if failure is not None:  # its pages stay locked until the process ends
                    log.warning("could not unregister a mapped weights file from CUDA: %s", failure)
                self._pinned.pop(address, None)  # the mapping goes with its last array
        return len(forgotten)

    def close(self) -> None:
        """Unregister every mapping (the caller makes sure no copy reads them)."""
        with self._lock:
            self._forgotten = list(self._pinned)
        self.release_forgotten()
        self._calls.shutdown(wait=True)

    # ------------------------------------------------------------------ on the "slot-pin" thread
    def _runtime(self):
        if self._cudart is None:
            if self._cudart_of is None:
                import torch

                self._cudart_of = torch.cuda.cudart
            self._cudart = self._cudart_of()
        return self._cudart

    def _register(self, address: int, nbytes: int) -> str | None:
        try:
            cudart = self._runtime()
            error = cudart.cudaHostRegister(address, nbytes, REGISTER_FLAGS)
        except Exception as exc:  # noqa: BLE001  (no CUDA runtime to ask: the staging path)
            return f"{type(exc).__name__}: {exc}"
        return None if error == cudart.cudaError.success else _describe(cudart, error)

    def _unregister(self, address: int) -> str | None:
        try:
            cudart = self._runtime()
            error = cudart.cudaHostUnregister(address)
        except Exception as exc:  # noqa: BLE001
            return f"{type(exc).__name__}: {exc}"
        return None if error == cudart.cudaError.success else _describe(cudart, error)


def _describe(cudart, error) -> str:
    try:
        return f"{cudart.cudaGetErrorString(error)} (cudaError {int(error)})"
    except Exception:  # noqa: BLE001
        return f"cudaError {error}"
