"""The system shared-memory regions registered through the router, and the reads and
writes of tensors in them (``router.frontends.shared_memory`` says why each use opens the
object again, and who may use a region).

Registrations are shared by every router worker of one ``mmctl up`` through a directory:
one small file per region, created with ``link`` so a name is registered once.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import mmap
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import grpc

from router.frontends.shared_memory_objects import SharedMemoryError, open_object

log = logging.getLogger(__name__)

_SIZE_T_MAX = 2**64 - 1  # Triton adds offsets and sizes as size_t


@dataclass(frozen=True)
class Region:
    name: str
    key: str
    offset: int
    byte_size: int

    def as_json(self) -> dict:
        return {"name": self.name, "key": self.key, "offset": self.offset, "byte_size": self.byte_size}

    @classmethod
    def from_json(cls, doc) -> Region:
        """Raises ValueError for anything but the four fields of ``as_json``."""
        if not isinstance(doc, dict) or set(doc) != {"name", "key", "offset", "byte_size"}:
            raise ValueError("not a registration")
        region = cls(**doc)
        if not (isinstance(region.name, str) and isinstance(region.key, str)
                and all(type(v) is int and v >= 0 for v in (region.offset, region.byte_size))):
            raise ValueError("not a registration")
        return region


@dataclass(frozen=True)
class OutputPlace:
    """Where the client asked for one output to be written."""
    region: str
    offset: int
    byte_size: int


def check_registration(name: str, key: str, offset: int, byte_size: int, object_bytes: int) -> None:
    """Refuse region ``name`` (``byte_size`` bytes at ``offset`` of object ``key``, which has
    ``object_bytes``) as Triton refuses it: first a region that does not lie within the
    object, ``offset + byte_size`` summed in size_t as Triton sums it; then one that Triton's
    ``mmap`` of it fails for, with the error's text glued to Triton's words as Triton glues
    it: an offset that is not a multiple of the page size or no bytes at all (EINVAL), an end
    past 2**64 that the sum wrapped (EOVERFLOW).  An empty object is told so after
    Triton's words."""
    def refused(reason: str) -> SharedMemoryError:
        hint = (f"; shared memory object '{key}' is empty (0 bytes): size it (ftruncate) to "
                "hold the tensors, then register it") if object_bytes == 0 else ""
        return SharedMemoryError(grpc.StatusCode.INVALID_ARGUMENT,
                                 f"failed to register shared memory region '{name}': {reason}{hint}")

    if (offset + byte_size) & _SIZE_T_MAX > object_bytes:
        raise refused("invalid args")
    if offset % mmap.PAGESIZE or byte_size == 0:
        raise refused("unable to process address space" + os.strerror(errno.EINVAL))
    if offset + byte_size > object_bytes:
        raise refused("unable to process address space" + os.strerror(errno.EOVERFLOW))


class RegisteredRegions:
    """The regions registered through this router (all of its workers when ``directory`` is
    shared), and the reads and writes of tensors in them."""

    def __init__(self, directory: Path | None = None):
        self._own = directory is None
        # This process's own directory is made at the first registration: most routers
        # never see one.
        self._directory = directory
        self._made = False
        # name -> (identity of its registration file, the registration read from it)
        self._regions: dict[str, tuple[tuple[int, int], Region]] = {}

    def close(self) -> None:
        self._regions.clear()
        if self._own and self._directory is not None:
            shutil.rmtree(self._directory, ignore_errors=True)
            self._directory, self._made = None, False

    @property
    def directory(self) -> Path:
        if self._directory is None:
            self._directory = Path(tempfile.mkdtemp(prefix="mms-shm-"))
        elif not self._made:
            self._directory.mkdir(parents=True, exist_ok=True)
        self._made = True
        return self._directory

    # ------------------------------------------------------------------ registrations
    def _file(self, name: str) -> Path:
        return self.directory / (hashlib.sha256(name.encode()).hexdigest()[:40] + ".json")

    def register(self, name: str, key: str, offset: int, byte_size: int) -> None:
        """Checked in Triton's order: the name, the key, the object, the region in it."""
        target = self._file(name)
        if target.exists():
            raise SharedMemoryError(grpc.StatusCode.ALREADY_EXISTS,
                                    f"shared memory region '{name}' already in manager")
        if any(region.key == key for region in self.status()):
            # Triton 2.51 checks a second region of a registered key on the descriptor it
            # opened for the first one, which it closed once that was mapped: fstat fails
            # and every such registration is refused, in these words.  (Two workers
            # registering one key at once may both pass: what Triton refuses, not worse.)
            raise SharedMemoryError(grpc.StatusCode.INTERNAL, f"Invalid shared memory region: '{key}'")
        fd, size = open_object(key, os.O_RDWR)  # outputs are written: read-write, as Triton opens it
        os.close(fd)
        check_registration(name, key, offset, byte_size, size)
        region = Region(name, key, offset, byte_size)
        fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=".new-")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(region.as_json(), f)
            try:
                os.link(tmp, target)  # fails if another worker registered the name meanwhile
            except FileExistsError:
                raise SharedMemoryError(grpc.StatusCode.ALREADY_EXISTS,
                                        f"shared memory region '{name}' already in manager") from None
        finally:
            os.unlink(tmp)

    def unregister(self, name: str = "") -> None:
        """One region, or every region when ``name`` is empty.  An unknown name is no error
        (Triton's answer too)."""
        files = [self._file(name)] if name else list(self.directory.glob("*.json"))
        for path in files:
            path.unlink(missing_ok=True)

    def status(self, name: str = "") -> list[Region]:
        if name:
            region = self._read(self._file(name), name)
            if region is None:
                raise SharedMemoryError(grpc.StatusCode.NOT_FOUND,
                                        f"Unable to find system shared memory region: '{name}'")
            return [region]
        regions = []
        for path in sorted(self.directory.glob("*.json")):
            try:
                region = self._read(path)
            except SharedMemoryError:  # said when the region is named; the others are listed
                continue
            if region is not None:
                regions.append(region)
        return sorted(regions, key=lambda r: r.name)

    @staticmethod
    def _read(path: Path, name: str | None = None) -> Region | None:
        """The registration in ``path``, None when there is none.  One that is not a
        registration (cut short, written by hand) is a client error naming what to do."""
        try:
            text = path.read_bytes()
        except FileNotFoundError:
            return None
        try:
            return Region.from_json(json.loads(text))
        except (ValueError, TypeError):
            log.warning("shared-memory registration %s is unreadable", path)
            raise SharedMemoryError(grpc.StatusCode.FAILED_PRECONDITION,
                                    f"the registration of shared memory region '{name or path.stem}' is "
                                    "unreadable: unregister it and register it again") from None

    def _region(self, name: str) -> Region:
        """The registration of ``name`` as it is now: one ``stat`` of its file, read again
        when it changed (an unregister or a re-register by any worker)."""
        path = self._file(name)
        try:
            st = path.stat()
        except FileNotFoundError:
            self._regions.pop(name, None)
            raise SharedMemoryError(grpc.StatusCode.NOT_FOUND,
                                    f"Unable to find shared memory region: '{name}'") from None
        identity = (st.st_ino, st.st_mtime_ns)
        cached = self._regions.get(name)
        if cached is not None and cached[0] == identity:
            return cached[1]
        region = self._read(path, name)
        if region is None:
            raise SharedMemoryError(grpc.StatusCode.NOT_FOUND, f"Unable to find shared memory region: '{name}'")
        self._regions[name] = (identity, region)
        return region

    def _check_span(self, name: str, offset: int, byte_size: int) -> Region:
        """The registration of ``name``, which ``byte_size`` bytes at ``offset`` must lie in:
        Triton's checks of a tensor's place, in its order and words.  A negative number
        (gRPC's int64 parameters) is read as Triton reads it, a size_t past any region."""
        region = self._region(name)
        if offset < 0 or offset >= region.byte_size:
            raise SharedMemoryError(grpc.StatusCode.INVALID_ARGUMENT,
                                    f"Invalid offset for shared memory region: '{name}'")
        if byte_size < 0 or offset + byte_size > region.byte_size:
            raise SharedMemoryError(grpc.StatusCode.INVALID_ARGUMENT,
                                    f"Invalid offset + byte size for shared memory region: '{name}'")
        return region

    def _open_span(self, name: str, offset: int, byte_size: int, flags: int) -> tuple[int, int]:
        """A descriptor of region ``name``'s object and where ``byte_size`` bytes at
        ``offset`` in the region start in it, checked against the registration and against
        the object's size now.  The caller closes the descriptor."""
        region = self._check_span(name, offset, byte_size)
        try:
            fd, size = open_object(region.key, flags)
        except SharedMemoryError as exc:
            if exc.grpc_code != grpc.StatusCode.INTERNAL:
                raise
            # The object is gone since its registration (Triton's words for a region it lost).
            raise SharedMemoryError(grpc.StatusCode.NOT_FOUND,
                                    f"Unable to find shared memory region: '{name}'") from None
        start = region.offset + offset
        if start + byte_size > size:
            os.close(fd)
            raise _shrunk(name, region, size, start + byte_size)
        return fd, start

    def read(self, name: str, offset: int, byte_size: int) -> bytes:
        fd, start = self._open_span(name, offset, byte_size, os.O_RDONLY)
        try:
            data = os.pread(fd, byte_size, start)
            if len(data) < byte_size:  # cut between the size check and the read
                parts = [data]
                got = len(data)
                while got < byte_size:
                    more = os.pread(fd, byte_size - got, start + got)
                    if not more:
                        raise _shrunk(name, self._region(name), os.fstat(fd).st_size, start + byte_size)
                    parts.append(more)
                    got += len(more)
                data = b"".join(parts)
            return data
        finally:
            os.close(fd)

    def write(self, output: str, place: OutputPlace, data: bytes) -> None:
        if len(data) > place.byte_size:
            raise SharedMemoryError(
                grpc.StatusCode.INTERNAL,
                f"shared memory size specified with the request for output '{output}' "
                f"({place.byte_size} bytes) should be at least {len(data)} bytes to hold the results")
        fd, start = self._open_span(place.region, place.offset, place.byte_size, os.O_RDWR)
        try:
            view = memoryview(data)
            written = 0
            while written < len(view):
                written += os.pwrite(fd, view[written:], start + written)
        finally:
            os.close(fd)


def _shrunk(name: str, region: Region, size: int, end: int) -> SharedMemoryError:
    return SharedMemoryError(
        grpc.StatusCode.FAILED_PRECONDITION,
        f"shared memory region '{name}' reaches byte {end} of object '{region.key}', which has "
        f"{size} bytes now (truncated since it was registered): size the object again, or "
        "unregister the region and register it again")
