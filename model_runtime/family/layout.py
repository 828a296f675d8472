"""A family's weight layout: the tensors every variant has, their dtypes, shapes and byte
ranges, read from a safetensors header.

A safetensors file is an 8-byte little-endian header length, a JSON header naming each
tensor's dtype, shape and byte range in the data section, then the data section.  Two files
written by ``safetensors.torch.save_file`` from tensors of the same names, dtypes and shapes
have the same header, so a variant's data section can be copied into a slot as one block:
the slot *is* a data section, and each parameter is a view at its byte range.

Pure: no torch, no Triton.  Errors are ``LayoutError`` with a message that says what to do.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass

HEADER_LENGTH_BYTES = 8
METADATA_KEY = "__metadata__"
# safetensors dtype -> bytes per element
ELEMENT_BYTES = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2,
                 "BF16": 2, "I16": 2, "U16": 2, "I8": 1, "U8": 1, "BOOL": 1}
# A header larger than this is not a weights file (safetensors caps it at 100 MB too).
MAX_HEADER_BYTES = 100_000_000


class LayoutError(ValueError):
    """A weights file that does not have the family's layout, or is not readable as one."""


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str  # safetensors' name: F32, F16, BF16, I64, ...
    shape: tuple[int, ...]
    begin: int  # byte range in the data section
    end: int

    def describe(self) -> str:
        return f"{self.name} {self.dtype}{list(self.shape)}"


@dataclass(frozen=True)
class Layout:
    tensors: tuple[TensorSpec, ...]
    data_bytes: int

    def by_name(self) -> dict[str, TensorSpec]:
        return {t.name: t for t in self.tensors}

    def to_json(self) -> dict:
        return {"data_bytes": self.data_bytes,
                "tensors": [{"name": t.name, "dtype": t.dtype, "shape": list(t.shape),
                             "offsets": [t.begin, t.end]} for t in self.tensors]}

    @classmethod
    def from_json(cls, body: dict) -> Layout:
        try:
            tensors = tuple(TensorSpec(t["name"], t["dtype"], tuple(int(d) for d in t["shape"]),
                                       int(t["offsets"][0]), int(t["offsets"][1]))
                            for t in body["tensors"])
            return cls(tensors, int(body["data_bytes"]))
        except (KeyError, TypeError, ValueError, IndexError) as exc:
            raise LayoutError(f"a family layout needs data_bytes and tensors with name, dtype, "
                              f"shape and offsets: {exc}") from None

    def mismatch(self, other: Layout) -> str | None:
        """Why ``other`` (a variant's weights) cannot go into a slot of this layout, or None."""
        mine, theirs = self.by_name(), other.by_name()
        missing = sorted(set(mine) - set(theirs))
        extra = sorted(set(theirs) - set(mine))
        problems = []
        if missing:
            problems.append(f"missing {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}")
        if extra:
            problems.append(f"unexpected {', '.join(extra[:5])}{' ...' if len(extra) > 5 else ''}")
        for name in sorted(set(mine) & set(theirs)):
            a, b = mine[name], theirs[name]
            if (a.dtype, a.shape) != (b.dtype, b.shape):
                problems.append(f"{name} is {b.dtype}{list(b.shape)}, the family has "
                                f"{a.dtype}{list(a.shape)}")
        if problems:
            return "; ".join(problems[:6])
        if other.tensors != self.tensors or other.data_bytes != self.data_bytes:
            return "same tensors but a different byte order; write it with safetensors' save_file"
        return None


def parse_header(header: bytes, where: str) -> Layout:
    try:
        body = json.loads(header)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise LayoutError(f"{where} is not a safetensors file (its header is not JSON: {exc})") from None
    if not isinstance(body, dict):
        raise LayoutError(f"{where} is not a safetensors file (its header is not an object)")
    tensors = []
    for name, spec in body.items():
        if name == METADATA_KEY:
            continue
        try:
            dtype, shape = spec["dtype"], tuple(int(d) for d in spec["shape"])
            begin, end = (int(x) for x in spec["data_offsets"])
        except (KeyError, TypeError, ValueError) as exc:
            raise LayoutError(f"{where}: tensor {name!r} has a malformed entry ({exc})") from None
        if dtype not in ELEMENT_BYTES:
            raise LayoutError(f"{where}: tensor {name!r} has dtype {dtype}, which a family slot "
                              f"cannot hold (use one of {', '.join(ELEMENT_BYTES)})")
        count = 1
        for d in shape:
            count *= d
        if end - begin != count * ELEMENT_BYTES[dtype] or begin < 0:
            raise LayoutError(f"{where}: tensor {name!r} claims bytes {begin}..{end} for "
                              f"{dtype}{list(shape)}; the file is corrupt")
        if begin % ELEMENT_BYTES[dtype]:
            raise LayoutError(f"{where}: tensor {name!r} starts at byte {begin}, not aligned to "
                              f"its {dtype} elements; write the file with safetensors' save_file")
        tensors.append(TensorSpec(name, dtype, shape, begin, end))
    tensors.sort(key=lambda t: t.begin)
    data_bytes = max((t.end for t in tensors), default=0)
    return Layout(tuple(tensors), data_bytes)


def read_layout(path: str | os.PathLike) -> tuple[Layout, int]:
    """(layout, byte offset of the data section) of the safetensors file at ``path``.

    Raises LayoutError for a file that is not safetensors, is truncated (shorter than its
    header says) or has tensors a slot cannot hold."""
    where = os.fspath(path)
    try:
        with open(path, "rb") as f:
            head = f.read(HEADER_LENGTH_BYTES)
            if len(head) < HEADER_LENGTH_BYTES:
                raise LayoutError(f"{where} is truncated: {len(head)} bytes, not a safetensors file")
            (length,) = struct.unpack("<Q", head)
            if length > MAX_HEADER_BYTES:
                raise LayoutError(f"{where} is not a safetensors file (header length {length})")
            header = f.read(length)
            size = os.fstat(f.fileno()).st_size
    except OSError as exc:
        raise LayoutError(f"cannot read {where}: {exc.strerror or exc}") from None
    return _whole(header, length, size, where)


def layout_of_bytes(raw: bytes, where: str, size: int | None = None) -> tuple[Layout, int]:
    """``read_layout`` of a file read whole (an object from a store), or of its first bytes
    (its header at least) when ``size`` says how long the whole file is."""
    if len(raw) < HEADER_LENGTH_BYTES:
        raise LayoutError(f"{where} is truncated: {len(raw)} bytes, not a safetensors file")
    (length,) = struct.unpack("<Q", raw[:HEADER_LENGTH_BYTES])
    if length > MAX_HEADER_BYTES:
        raise LayoutError(f"{where} is not a safetensors file (header length {length})")
    return _whole(raw[HEADER_LENGTH_BYTES:HEADER_LENGTH_BYTES + length], length,
                  len(raw) if size is None else size, where)


def header_bytes(first: bytes) -> int:
    """How many bytes of a safetensors file hold its header, from its first 8 (capped:
    a bigger one is refused by ``layout_of_bytes``)."""
    if len(first) < HEADER_LENGTH_BYTES:
        return HEADER_LENGTH_BYTES
    (length,) = struct.unpack("<Q", first[:HEADER_LENGTH_BYTES])
    return HEADER_LENGTH_BYTES + min(length, MAX_HEADER_BYTES)


def _whole(header: bytes, length: int, size: int, where: str) -> tuple[Layout, int]:
    """The layout of a file of ``size`` bytes whose header is ``header`` (``length`` bytes
    long, as its first 8 bytes say); LayoutError for a file shorter than it says."""
    if len(header) < length:
        raise LayoutError(f"{where} is truncated inside its header")
    layout = parse_header(header, where)
    offset = HEADER_LENGTH_BYTES + length
    if size < offset + layout.data_bytes:
        raise LayoutError(f"{where} is truncated: {size} bytes, its header needs "
                          f"{offset + layout.data_bytes}; copy it again")
    return layout, offset
