"""The POSIX shared-memory objects clients name as their regions (``/dev/shm/<key>``): which
keys may be opened, opened so that no link, FIFO or serving process's own object is, and
the error every shared-memory answer is given in, in Triton's code and words."""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

import grpc

from domain.router_errors import UpstreamError

SHM_ROOT = Path("/dev/shm")

class SharedMemoryError(UpstreamError):
    """A shared-memory answer in Triton's code and words."""


# Objects of the serving processes themselves (Triton's python-backend stubs, PostgreSQL,
# POSIX semaphores): a client may not name them as its region.
PRIVATE_PREFIXES = ("triton_python_backend", "PostgreSQL", "sem.")


def _object_path(key: str) -> Path | None:
    """The file of POSIX shared-memory object ``key`` (shm_open's name), or None for a key
    that names no client object in /dev/shm (a path, "..", a serving process's own)."""
    name = key.removeprefix("/")
    if (not name or "/" in name or name in (".", "..") or "\0" in name
            or name.startswith(PRIVATE_PREFIXES)):
        return None
    return SHM_ROOT / name


def open_object(key: str, flags: int) -> tuple[int, int]:
    """A descriptor of shared-memory object ``key`` and its size now.  A symbolic link is
    refused (it could point at any file the router may open), and so is anything but a
    regular file (a FIFO would block the worker)."""
    path = _object_path(key)
    if path is None:
        raise SharedMemoryError(grpc.StatusCode.INTERNAL, f"Unable to open shared memory region: '{key}'")
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise SharedMemoryError(grpc.StatusCode.INVALID_ARGUMENT,
                                    f"Unable to open shared memory region: '{key}' is a symbolic link; "
                                    "register the shared-memory object itself") from None
        raise SharedMemoryError(grpc.StatusCode.INTERNAL,
                                f"Unable to open shared memory region: '{key}'") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise SharedMemoryError(grpc.StatusCode.INTERNAL, f"Unable to open shared memory region: '{key}'")
    return fd, st.st_size
