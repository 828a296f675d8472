"""``MappedFiles``: the variants' weights files mapped into the family process, and kept
mapped from one fill to the next.

A fill copies a variant's bytes out of the host-DRAM warm tier (tmpfs).  Read with
``preadv``, the kernel copies them page by page at well under half a memcpy's speed on the
CPU machines (``python -m bench.slot_fill``); out of a mapping whose pages are mapped
already, the copy is a memcpy, and parts of it run in parallel threads.  The first copy out
of a new mapping pays its page faults (about what a read costs), so each mapping is kept for
the next fill of the same file, up to ``max_bytes`` mapped in all (the least recently used
is unmapped first; the page tables cost about 0.2% of the bytes mapped).

A mapped file shares the warm tier's memory: nothing is copied to keep it, and the
process's resident set counts its pages as shared (``RssShmem``), not as its own.

A file replaced by a rename (as the control plane and its warm tier write them) is mapped
anew: each use compares the path's inode, size and modification time with the mapping's.
A mapping keeps the memory of a file removed meanwhile until it is unmapped, so each use,
and a sweep every ``SWEEP_S``, unmaps those whose file is gone or was replaced.  A file
truncated in place while a copy reads it faults the process (SIGBUS), as it would any
reader of a mapped file: weights files are replaced by renaming a complete file over them.

Each mapping records whether its file lives in host RAM (tmpfs or ramfs, the default warm
tier): on CPU a slot then reads the mapping in place instead of copying it (slots.py).
"""

from __future__ import annotations

import ctypes
import mmap
import os
import threading
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

# Page tables for this much mapped memory take 128 MiB at most; a warm tier is smaller on
# most hosts, so every variant of a family usually stays mapped.
DEFAULT_MAX_BYTES = 64 << 30
SWEEP_S = 5.0
# statfs f_type of the file systems whose files are host RAM (linux/magic.h).
RAM_FILE_SYSTEMS = {0x01021994: "tmpfs", 0x858458F6: "ramfs"}


@dataclass
class MappedFile:
    identity: tuple[int, int, int, int]  # st_dev, st_ino, st_size, st_mtime_ns
    array: np.ndarray  # uint8 over the whole file; unmapped once nothing holds it
    in_memory: bool  # the file is host RAM (tmpfs, ramfs), never read from a disk


class MappedFiles:
    """Read-only mappings of weights files by path.  Thread-safe."""

    def __init__(self, max_bytes: int = DEFAULT_MAX_BYTES, sweep_s: float | None = SWEEP_S,
                 on_keep=None, on_forget=None):
        """``on_keep(array)`` / ``on_forget(array)``: told, under this object's lock, of each
        mapping as it is kept and as it is forgotten (in that order for any one mapping); a
        GPU slot bank registers its mappings with CUDA through them (pinned_mappings.py)."""
        self.max_bytes = max_bytes
        self._on_keep = on_keep
        self._on_forget = on_forget
        self._mappings: OrderedDict[str, MappedFile] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self._closed = threading.Event()
        if sweep_s:
            threading.Thread(target=self._sweep_every, args=(sweep_s,), name="mapped-files-sweep",
                             daemon=True).start()

    @property
    def mapped_bytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._mappings)

    def view(self, path: str | os.PathLike) -> np.ndarray:
        """The file at ``path`` as read-only bytes (uint8), from its kept mapping when the
        file is the one mapped.  Raises OSError when it cannot be opened or mapped (an empty
        file cannot be mapped: ``ValueError``)."""
        return self.open(path).array

    def open(self, path: str | os.PathLike) -> MappedFile:
        """``view``, with what is known of the mapping."""
        path = os.fspath(path)
        identity = _identity(os.stat(path))
        with self._lock:
            kept = self._mappings.get(path)
            if kept is not None:
                if kept.identity == identity:
                    self._mappings.move_to_end(path)
                    return kept
                self._forget(path)
        fd = os.open(path, os.O_RDONLY)
        try:
            identity = _identity(os.fstat(fd))  # the file mapped, should the path move on
            mapped = MappedFile(identity, np.frombuffer(
                mmap.mmap(fd, identity[2], mmap.MAP_SHARED, mmap.PROT_READ), dtype=np.uint8),
                file_system_of(fd) in RAM_FILE_SYSTEMS)
        finally:
            os.close(fd)
        size = identity[2]
        with self._lock:
            if path not in self._mappings and size <= self.max_bytes:
                while self._mappings and self._bytes + size > self.max_bytes:
                    self._forget(next(iter(self._mappings)))
                self._mappings[path] = mapped
                self._bytes += size
                if self._on_keep is not None:
                    self._on_keep(mapped.array)
        return mapped

    def sweep(self) -> int:
        """Unmap the files that are gone or were replaced; how many."""
        with self._lock:
            stale = []
            for path, kept in self._mappings.items():
                try:
                    if _identity(os.stat(path)) != kept.identity:
                        stale.append(path)
                except OSError:
                    stale.append(path)
            for path in stale:
                self._forget(path)
        return len(stale)

    def close(self) -> None:
        self._closed.set()
        with self._lock:
            for path in list(self._mappings):
                self._forget(path)

    def _forget(self, path: str) -> None:
        # The mapping itself goes when the last array over it does (a copy may still read it).
        kept = self._mappings.pop(path)
        self._bytes -= kept.identity[2]
        if self._on_forget is not None:
            self._on_forget(kept.array)

    def _sweep_every(self, every_s: float) -> None:
        while not self._closed.wait(every_s):
            self.sweep()


def _identity(st: os.stat_result) -> tuple[int, int, int, int]:
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


_libc = ctypes.CDLL(None, use_errno=True)


def file_system_of(fd: int) -> int | None:
    """The statfs ``f_type`` of the file system holding the open file ``fd`` (Linux; its first
    field, a C long), or None where it cannot be read."""
    fstatfs = getattr(_libc, "fstatfs", None)
    buffer = ctypes.create_string_buffer(256)  # struct statfs is 120 bytes on 64-bit Linux
    if fstatfs is None or fstatfs(fd, buffer) != 0:
        return None
    return ctypes.c_long.from_buffer(buffer).value
