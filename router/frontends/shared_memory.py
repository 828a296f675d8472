"""Triton's system shared-memory protocol on the public port, for clients on the router's host.

A client registers a POSIX shared-memory object (``/dev/shm/<key>``) under a region name,
then names the region in an inference request instead of sending the tensor: inputs are
read from the region, outputs are written into it.  The router reads and writes the object
itself and sends the tensors inline to Triton, so Triton (on another host, another GPU or
restarted since) never needs the client's memory, and a request may move between Tritons.

Registrations are shared by every router worker of one ``mmctl up`` through a directory
(one small file per region, created with ``link`` so a name is registered once): a client's
register call and its inference calls may reach different workers over different
connections.  Each use opens the object again (``O_NOFOLLOW``), checks its size as it is now
and reads or writes with ``pread``/``pwrite``: no mapping outlives a request, so an object
its owner truncated is a client error, never SIGBUS in a worker.

Only a peer on the loopback interface may register, list, unregister or name a region: a
region is this host's memory, and a remote client naming one would read or overwrite
another process's memory.  The bytes a request reads from regions count against the
request limit (``--max-request-bytes``) with its own.  The texts and codes of Triton's
errors are Triton's (tritonserver 2.51, measured), in Triton's order: a registration is
checked as Triton checks it before and when it maps the region (``check_registration``),
a tensor's place as Triton checks it at each request, inputs then outputs, before anything
is read or sent (``_check_span``).  The checks Triton does not make answer 4xx with what to
do.  CUDA shared memory is not served: its handle maps device memory of the GPU Triton runs
on, which the router does not hold; a registration is refused as Triton refuses a handle it
cannot open (``CUDA_REFUSAL``).
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
import numpy as np
from google.protobuf.message import DecodeError
from tritonclient.grpc import service_pb2
from tritonclient.utils import serialize_byte_tensor, triton_to_np_dtype

from domain.router_errors import PayloadTooLarge, PermissionDenied
from router.frontends.peers import loopback_peer
from router.frontends.shared_memory_objects import SharedMemoryError, open_object
from router.frontends.shared_memory_requests import (
    BYTE_SIZE,
    OFFSET,
    REGION,
    SHM_PARAMETERS,
    grpc_place,
    json_uses_shared_memory,
    names_region,
    uses_shared_memory,
)

log = logging.getLogger(__name__)

# Triton's answer to a CUDA registration whose handle it cannot open (INVALID_ARGUMENT / 400),
# then the router's reason: Triton's clients match on the first words ("failed to register
# shared memory region.*invalid args").
CUDA_REFUSAL = ("failed to register shared memory region: invalid args: CUDA shared memory is not "
                "available through the router: its handle maps memory of a GPU that Triton, not the "
                "router, holds. Use system shared memory (same host) or send the tensors in the request")
REMOTE_REFUSAL = ("system shared memory is only for clients on the router's host (loopback); "
                  "send the tensors in the request instead")
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


def refuse_remote(peer: str | None) -> None:
    """PermissionDenied unless ``peer`` (``loopback_peer``) is on the router's host."""
    if not loopback_peer(peer):
        raise PermissionDenied(REMOTE_REFUSAL)


def cuda_refusal() -> SharedMemoryError:
    return SharedMemoryError(grpc.StatusCode.INVALID_ARGUMENT, CUDA_REFUSAL)


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


class SystemSharedMemory:
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

    # ------------------------------------------------------------------ admission
    def admit(self, request: service_pb2.ModelInferRequest, peer: str | None, limit_bytes: int,
              request_bytes: int | None = None) -> None:
        """Refuse a request that names shared memory from a peer not on loopback, or whose
        region bytes with its own (``request_bytes``, its serialized size when None) pass
        ``limit_bytes``; nothing is read."""
        if not uses_shared_memory(request):
            return
        refuse_remote(peer)
        region_bytes = sum(max(grpc_place(t.parameters)[2], 0) for t in request.inputs
                           if REGION in t.parameters)
        _within_limit(region_bytes, request.ByteSize() if request_bytes is None else request_bytes,
                      limit_bytes)

    def admit_raw(self, raw: bytes, peer: str | None, limit_bytes: int) -> None:
        """``admit`` for a serialized ModelInferRequest; one that does not parse is left to
        the caller's own parse to refuse."""
        if not names_region(raw):
            return
        try:
            request = service_pb2.ModelInferRequest.FromString(raw)
        except DecodeError:
            return
        self.admit(request, peer, limit_bytes, len(raw))

    def admit_json(self, doc: dict, body_bytes: int, peer: str | None, limit_bytes: int) -> None:
        """``admit`` for an HTTP request's JSON header ``doc`` (its body ``body_bytes`` long)."""
        if not json_uses_shared_memory(doc):
            return
        refuse_remote(peer)
        sizes = ((t.get("parameters") or {}).get(BYTE_SIZE, 0) for t in doc.get("inputs", ())
                 if isinstance(t, dict) and REGION in (t.get("parameters") or {}))
        _within_limit(sum(s for s in sizes if type(s) is int and s > 0), body_bytes, limit_bytes)

    # ------------------------------------------------------------------ gRPC requests
    def inline(self, request: service_pb2.ModelInferRequest) -> dict[str, OutputPlace]:
        """Replace every shared-memory input of ``request`` by its bytes (raw contents) and
        take the shared-memory parameters off its outputs; returns where each such output
        goes, for ``deliver``.  Every place is checked first, inputs then outputs (Triton's
        order): a bad output region is refused before anything is read or sent."""
        shm_inputs = [t for t in request.inputs if REGION in t.parameters]
        for tensor in shm_inputs:
            self._check_span(*grpc_place(tensor.parameters))
        places = {}
        for output in request.outputs:
            if REGION in output.parameters:
                place = OutputPlace(*grpc_place(output.parameters))
                self._check_span(place.region, place.offset, place.byte_size)
                places[output.name] = place
                for key in SHM_PARAMETERS:
                    output.parameters.pop(key, None)
        if not shm_inputs:
            return places
        raw = iter(request.raw_input_contents)
        contents = []
        for tensor in request.inputs:
            params = tensor.parameters
            if REGION in params:
                region, offset, byte_size = grpc_place(params)
                contents.append(self.read(region, offset, byte_size))
                for key in SHM_PARAMETERS:
                    params.pop(key, None)
            elif tensor.HasField("contents"):
                # Raw contents are all or nothing in one request: typed ones become raw too.
                contents.append(_typed_as_raw(tensor))
                tensor.ClearField("contents")
            else:
                contents.append(next(raw, b""))
        del request.raw_input_contents[:]
        request.raw_input_contents.extend(contents)
        return places

    def deliver(self, response: service_pb2.ModelInferResponse, places: dict[str, OutputPlace]) -> None:
        """Write the outputs asked for in shared memory into their regions; Triton's answer
        for such an output carries no data."""
        for index, output in enumerate(response.outputs):
            place = places.get(output.name)
            if place is not None and index < len(response.raw_output_contents):
                self.write(output.name, place, response.raw_output_contents[index])
                response.raw_output_contents[index] = b""

    # ------------------------------------------------------------------ HTTP requests
    def inline_json(self, doc: dict, binary: bytes) -> tuple[dict, bytes, dict[str, OutputPlace]]:
        """The HTTP request ``doc`` (its binary tensors ``binary``) with shared-memory inputs
        made binary tensors and shared-memory outputs asked for as binary data.  Places are
        checked as in ``inline``; the parameters' types were checked with the request's."""
        doc = dict(doc)
        places = {}
        for tensor in doc.get("inputs", ()):
            params = tensor.get("parameters") or {}
            if REGION in params:
                self._check_span(params[REGION], params.get(OFFSET, 0), params.get(BYTE_SIZE, 0))
        if any(REGION in (o.get("parameters") or {}) for o in doc.get("outputs", ())):
            outputs = []
            for output in doc["outputs"]:
                params = output.get("parameters") or {}
                if REGION in params:
                    place = OutputPlace(params[REGION], params.get(OFFSET, 0), params.get(BYTE_SIZE, 0))
                    self._check_span(place.region, place.offset, place.byte_size)
                    places[output["name"]] = place
                    rest = {k: v for k, v in params.items() if k not in SHM_PARAMETERS}
                    output = dict(output, parameters=dict(rest, binary_data=True))
                outputs.append(output)
            doc["outputs"] = outputs
        if not any(REGION in (i.get("parameters") or {}) for i in doc.get("inputs", ())):
            return doc, binary, places
        inputs, parts, cursor = [], [], 0
        for tensor in doc["inputs"]:
            params = tensor.get("parameters") or {}
            if REGION in params:
                data = self.read(params[REGION], params.get(OFFSET, 0), params.get(BYTE_SIZE, 0))
                rest = {k: v for k, v in params.items() if k not in SHM_PARAMETERS}
                tensor = dict(tensor, parameters=dict(rest, binary_data_size=len(data)))
                parts.append(data)
            elif "binary_data_size" in params:
                size = params["binary_data_size"]
                parts.append(binary[cursor:cursor + size])
                cursor += size
            inputs.append(tensor)
        doc["inputs"] = inputs
        return doc, b"".join(parts), places

    def deliver_json(self, out: dict, binary: bytes, places: dict[str, OutputPlace]) -> bytes:
        """Write the outputs asked for in shared memory (binary in Triton's answer) into their
        regions; returns the binary tensors left for the client.  ``out`` loses those
        outputs' data parameters, as Triton answers."""
        kept, cursor = [], 0
        for output in out.get("outputs", ()):
            params = output.get("parameters") or {}
            size = params.get("binary_data_size")
            if size is None:
                continue
            data = binary[cursor:cursor + size]
            cursor += size
            if output.get("name") in places:
                self.write(output["name"], places[output["name"]], data)
                output.pop("parameters")
            else:
                kept.append(data)
        return b"".join(kept)


def _shrunk(name: str, region: Region, size: int, end: int) -> SharedMemoryError:
    return SharedMemoryError(
        grpc.StatusCode.FAILED_PRECONDITION,
        f"shared memory region '{name}' reaches byte {end} of object '{region.key}', which has "
        f"{size} bytes now (truncated since it was registered): size the object again, or "
        "unregister the region and register it again")


def _within_limit(region_bytes: int, request_bytes: int, limit_bytes: int) -> None:
    if region_bytes + request_bytes > limit_bytes:
        raise PayloadTooLarge(
            f"request reads {region_bytes} bytes from shared memory, {region_bytes + request_bytes} "
            f"bytes with its own {request_bytes}, over the router's limit of {limit_bytes} bytes per "
            "request: send smaller batches, or raise the router's --max-request-bytes")


_TYPED_FIELDS = {"BOOL": "bool_contents", "INT8": "int_contents", "INT16": "int_contents",
                 "INT32": "int_contents", "INT64": "int64_contents", "UINT8": "uint_contents",
                 "UINT16": "uint_contents", "UINT32": "uint_contents", "UINT64": "uint64_contents",
                 "FP32": "fp32_contents", "FP64": "fp64_contents"}


def _typed_as_raw(tensor: service_pb2.ModelInferRequest.InferInputTensor) -> bytes:
    if tensor.datatype == "BYTES":
        return serialize_byte_tensor(np.array(list(tensor.contents.bytes_contents), dtype=np.object_)).item()
    field = _TYPED_FIELDS.get(tensor.datatype)
    if field is None:
        raise SharedMemoryError(grpc.StatusCode.INVALID_ARGUMENT,
                                f"unexpected datatype {tensor.datatype} for input '{tensor.name}'")
    return np.array(getattr(tensor.contents, field), dtype=triton_to_np_dtype(tensor.datatype)).tobytes()
