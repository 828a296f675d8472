"""Triton's system shared-memory protocol on the public port, for clients on the router's host.

A client registers a POSIX shared-memory object (``/dev/shm/<key>``) under a region name,
then names the region in an inference request instead of sending the tensor: inputs are
read from the region, outputs are written into it.  The router maps the region itself and
sends the tensors inline to Triton, so Triton (on another host, another GPU or restarted
since) never needs the client's memory, and a request may move between Tritons.

Registrations are shared by every router worker of one ``mmctl up`` through a directory
(one small file per region, created with ``link`` so a name is registered once): a client's
register call and its inference calls may reach different workers over different
connections.  Each worker maps a region once and checks the registration's file identity
per request (one ``stat``), so an unregister or a re-register elsewhere is seen at once.

Only a peer on the loopback interface may register: a region is this host's memory, and a
remote client naming a key would read or overwrite another process's memory.  The texts and
codes of every error are Triton's (tritonserver 2.51), so a client cannot tell the router
from Triton.  CUDA shared memory is not served: its handle maps device memory of the GPU
Triton runs on, which the router does not hold.
"""

from __future__ import annotations

import hashlib
import ipaddress
import json
import mmap
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np
from tritonclient.grpc import service_pb2
from tritonclient.utils import serialize_byte_tensor, triton_to_np_dtype

from router.serving.errors import RouterError

REGION = "shared_memory_region"
OFFSET = "shared_memory_offset"
BYTE_SIZE = "shared_memory_byte_size"
SHM_PARAMETERS = (REGION, OFFSET, BYTE_SIZE)
SHM_ROOT = Path("/dev/shm")
CUDA_REFUSAL = ("CUDA shared memory is not available through the router: its handle maps memory of "
                "a GPU that Triton, not the router, holds. Use system shared memory (same host) or "
                "send the tensors in the request")

# Triton's HTTP status for each of its error codes (its HTTP front end maps them this way).
_HTTP_STATUS = {grpc.StatusCode.NOT_FOUND: 404, grpc.StatusCode.INTERNAL: 500,
                grpc.StatusCode.UNAVAILABLE: 503, grpc.StatusCode.UNIMPLEMENTED: 501}


class SharedMemoryError(RouterError):
    """A shared-memory answer in Triton's code and words."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.grpc_code = code
        self.http_status = _HTTP_STATUS.get(code, 400)


@dataclass(frozen=True)
class Region:
    name: str
    key: str
    offset: int
    byte_size: int

    def as_json(self) -> dict:
        return {"name": self.name, "key": self.key, "offset": self.offset, "byte_size": self.byte_size}


@dataclass(frozen=True)
class OutputPlace:
    """Where the client asked for one output to be written."""
    region: str
    offset: int
    byte_size: int


def loopback_peer(address: str | None) -> bool:
    """``address``: an IP ("127.0.0.1", "::1") or gRPC's peer ("ipv4:127.0.0.1:5000",
    "ipv6:[::1]:5000", "unix:/path")."""
    if not address:
        return False
    if address.startswith("unix:"):
        return True
    if address.startswith(("ipv4:", "ipv6:")):
        address = address[5:].rsplit(":", 1)[0].strip("[]")
    try:
        return ipaddress.ip_address(address.split("%", 1)[0]).is_loopback
    except ValueError:
        return False


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


class _Mapping:
    def __init__(self, region: Region, identity: tuple[int, int]):
        self.region = region
        self.identity = identity
        path = _object_path(region.key)
        if path is None:
            raise OSError(f"not a shared-memory key: {region.key!r}")
        fd = os.open(path, os.O_RDWR)
        try:
            self.map = mmap.mmap(fd, 0)
        finally:
            os.close(fd)

    def close(self) -> None:
        self.map.close()


class SystemSharedMemory:
    """The regions registered through this router (all of its workers when ``directory`` is
    shared), and the reads and writes of tensors in them."""

    def __init__(self, directory: Path | None = None):
        self._own = directory is None
        # This process's own directory is made at the first registration: most routers
        # never see one.
        self._directory = directory
        self._made = False
        self._maps: dict[str, _Mapping] = {}

    def close(self) -> None:
        for mapping in self._maps.values():
            mapping.close()
        self._maps.clear()
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
        path = _object_path(key)
        if path is None or not path.is_file():
            raise SharedMemoryError(grpc.StatusCode.INTERNAL, f"Unable to open shared memory region: '{key}'")
        if offset < 0 or byte_size < 0 or offset + byte_size > path.stat().st_size:
            raise SharedMemoryError(grpc.StatusCode.INTERNAL, f"Invalid shared memory region: '{key}'")
        target = self._file(name)
        if target.exists():
            raise SharedMemoryError(grpc.StatusCode.ALREADY_EXISTS,
                                    f"shared memory region '{name}' already in manager")
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
            region = self._read(self._file(name))
            if region is None:
                raise SharedMemoryError(grpc.StatusCode.NOT_FOUND,
                                        f"Unable to find system shared memory region: '{name}'")
            return [region]
        regions = (self._read(p) for p in sorted(self.directory.glob("*.json")))
        return sorted((r for r in regions if r is not None), key=lambda r: r.name)

    @staticmethod
    def _read(path: Path) -> Region | None:
        try:
            return Region(**json.loads(path.read_text()))
        except FileNotFoundError:
            return None

    def _mapping(self, name: str) -> _Mapping:
        """The mapped region ``name``, mapped again when its registration changed."""
        path = self._file(name)
        mapping = self._maps.get(name)
        try:
            st = path.stat()
        except FileNotFoundError:
            if mapping is not None:
                self._maps.pop(name).close()
            raise SharedMemoryError(grpc.StatusCode.NOT_FOUND,
                                    f"Unable to find shared memory region: '{name}'") from None
        identity = (st.st_ino, st.st_mtime_ns)
        if mapping is not None and mapping.identity == identity:
            return mapping
        if mapping is not None:
            self._maps.pop(name).close()
        region = self._read(path)
        try:
            if region is None:
                raise FileNotFoundError(path)
            mapping = self._maps[name] = _Mapping(region, identity)
        except OSError:
            raise SharedMemoryError(grpc.StatusCode.NOT_FOUND,
                                    f"Unable to find shared memory region: '{name}'") from None
        return mapping

    def _span(self, name: str, offset: int, byte_size: int) -> tuple[mmap.mmap, int]:
        mapping = self._mapping(name)
        region = mapping.region
        if offset < 0 or byte_size < 0 or offset + byte_size > region.byte_size:
            raise SharedMemoryError(grpc.StatusCode.INVALID_ARGUMENT,
                                    f"Invalid offset + byte size for shared memory region: '{name}'")
        start = region.offset + offset
        if start + byte_size > len(mapping.map):  # the object shrank after it was registered
            raise SharedMemoryError(grpc.StatusCode.INVALID_ARGUMENT,
                                    f"Invalid offset + byte size for shared memory region: '{name}'")
        return mapping.map, start

    def read(self, name: str, offset: int, byte_size: int) -> bytes:
        memory, start = self._span(name, offset, byte_size)
        return memory[start:start + byte_size]  # a copy: no view outlives an unregister

    def write(self, output: str, place: OutputPlace, data: bytes) -> None:
        if len(data) > place.byte_size:
            raise SharedMemoryError(
                grpc.StatusCode.INTERNAL,
                f"shared memory size specified with the request for output '{output}' "
                f"({place.byte_size} bytes) should be at least {len(data)} bytes to hold the results")
        memory, start = self._span(place.region, place.offset, place.byte_size)
        memory[start:start + len(data)] = data

    # ------------------------------------------------------------------ gRPC requests
    def inline(self, request: service_pb2.ModelInferRequest) -> dict[str, OutputPlace]:
        """Replace every shared-memory input of ``request`` by its bytes (raw contents) and
        take the shared-memory parameters off its outputs; returns where each such output
        goes, for ``deliver``."""
        places = {}
        for output in request.outputs:
            if REGION in output.parameters:
                places[output.name] = OutputPlace(*_grpc_place(output.parameters))
                for key in SHM_PARAMETERS:
                    output.parameters.pop(key, None)
        if not any(REGION in i.parameters for i in request.inputs):
            return places
        raw = iter(request.raw_input_contents)
        contents = []
        for tensor in request.inputs:
            params = tensor.parameters
            if REGION in params:
                region, offset, byte_size = _grpc_place(params)
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
        made binary tensors and shared-memory outputs asked for as binary data."""
        doc = dict(doc)
        places = {}
        if any(REGION in (o.get("parameters") or {}) for o in doc.get("outputs", ())):
            outputs = []
            for output in doc["outputs"]:
                params = output.get("parameters") or {}
                if REGION in params:
                    places[output["name"]] = OutputPlace(params[REGION], params.get(OFFSET, 0),
                                                         params.get(BYTE_SIZE, 0))
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


def uses_shared_memory(request: service_pb2.ModelInferRequest) -> bool:
    return (any(REGION in t.parameters for t in request.inputs)
            or any(REGION in t.parameters for t in request.outputs))


def json_uses_shared_memory(doc: dict) -> bool:
    return any(REGION in (t.get("parameters") or {})
               for t in (*doc.get("inputs", ()), *doc.get("outputs", ())) if isinstance(t, dict))


def _grpc_place(params) -> tuple[str, int, int]:
    return (params[REGION].string_param,
            params[OFFSET].int64_param if OFFSET in params else 0,
            params[BYTE_SIZE].int64_param if BYTE_SIZE in params else 0)


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
