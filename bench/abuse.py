"""What one hostile HTTP inference request costs a router worker, beside a normal one.

Each hostile body is built at the largest size the router accepts (``--max-request-bytes``,
16 MiB by default) and decoded and checked as the HTTP front end does it (``decode_body``
then ``parse_infer_request``, in the worker thread that ``read_infer_request`` uses).  For
each: the answer (200 when the checks pass and the request would go on to Triton, else the
error's status), the thread CPU seconds (``time.thread_time``, the least of ``--repeats``)
and the peak memory the call allocates (tracemalloc, a separate run), beside a normal body of
the same size: single-digit INT32 values in one flat ``data`` array, the most values a body
of that size can hold, so the most work per byte a well-formed request asks for.

    gzip_empty_members   gzip members of nothing, one after another (20 bytes each)
    deep_nesting         the normal body's values with the last one nested as deep as the
                         JSON depth limit allows (a ragged array is valid JSON data)
    tiny_inputs          as many one-value inputs as fit
    mixed_arrays         values and one-value arrays alternating ([0, [0], 0, [0], ...])
    long_shape           an input whose shape is as many dimensions of 2**63 - 1 as fit

    .venv/bin/python -m bench.abuse [--size-mb 16] [--quick] [--repeats 3]

Writes bench/results/abuse.json.  No sockets, no Triton.
"""

from __future__ import annotations

import argparse
import dataclasses
import gzip
import json
import os
import platform
import sys
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path

from domain.router_errors import RouterError
from domain.worker_settings import WorkerConfig
from router.frontends.http_request import decode_body, parse_infer_request
from router.frontends.strict_json import MAX_JSON_DEPTH

RESULTS = Path(__file__).resolve().parent / "results"
# The largest request a router worker accepts unless told otherwise (--max-request-bytes).
LIMIT_BYTES = next(f.default for f in dataclasses.fields(WorkerConfig) if f.name == "max_request_bytes")
EMPTY_GZIP_MEMBER = gzip.compress(b"", mtime=0)
# {"inputs": [{"data": [...]}]} takes the first 4 levels of the JSON depth limit.
DATA_DEPTH = MAX_JSON_DEPTH - 4


@dataclasses.dataclass(frozen=True)
class Body:
    raw: bytes
    encoding: str = ""  # Content-Encoding


def _one_input(values: str, count: int, pad: int) -> bytes:
    """An INT32 input of ``count`` values written as ``values`` (JSON array text), padded
    with spaces to ``pad`` bytes."""
    head = f'{{"inputs": [{{"name": "X", "datatype": "INT32", "shape": [{count}], "data": '
    raw = (head + values + "}]}").encode()
    return raw + b" " * max(0, pad - len(raw))


def _digits(count: int) -> str:
    """``count`` single digits, comma-separated (0, 1, ... 9, 0, ...)."""
    tens, rest = divmod(count, 10)
    return ",".join(["0,1,2,3,4,5,6,7,8,9"] * tens + list("0123456789"[:rest]))


def normal(size_bytes: int) -> Body:
    """Single-digit INT32 values in one flat array: the most values a body of this size holds."""
    count = (size_bytes - 100) // 2
    return Body(_one_input("[" + _digits(count) + "]", count, size_bytes))


def gzip_empty_members(size_bytes: int) -> Body:
    return Body(EMPTY_GZIP_MEMBER * (size_bytes // len(EMPTY_GZIP_MEMBER)), "gzip")


def deep_nesting(size_bytes: int) -> Body:
    count = (size_bytes - 100 - 2 * DATA_DEPTH) // 2
    last = "[" * (DATA_DEPTH - 1) + "0" + "]" * (DATA_DEPTH - 1)
    return Body(_one_input("[" + _digits(count - 1) + "," + last + "]", count, size_bytes))


def tiny_inputs(size_bytes: int) -> Body:
    one = '{"name":"i%07d","datatype":"INT32","shape":[1],"data":[0]}'
    count = (size_bytes - 20) // (len(one % 0) + 1)
    raw = ('{"inputs":[' + ",".join(one % i for i in range(count)) + "]}").encode()
    return Body(raw + b" " * max(0, size_bytes - len(raw)))


def mixed_arrays(size_bytes: int) -> Body:
    pairs = (size_bytes - 100) // 6
    return Body(_one_input("[" + ",".join(["0,[0]"] * pairs) + "]", 2 * pairs, size_bytes))


def long_shape(size_bytes: int) -> Body:
    """One input whose shape is as many dimensions of 2**63 - 1 as fit, and no data."""
    dim = str(2**63 - 1)
    count = (size_bytes - 100) // (len(dim) + 1)
    head = '{"inputs": [{"name": "X", "datatype": "INT32", "shape": ['
    raw = (head + ",".join([dim] * count) + '], "data": []}]}').encode()
    return Body(raw + b" " * max(0, size_bytes - len(raw)))


HOSTILE: dict[str, Callable[[int], Body]] = {
    "gzip_empty_members": gzip_empty_members,
    "deep_nesting": deep_nesting,
    "tiny_inputs": tiny_inputs,
    "mixed_arrays": mixed_arrays,
    "long_shape": long_shape,
}


def decode_and_parse(body: Body, limit_bytes: int) -> tuple[int, str]:
    """The front end's decode and checks: (HTTP status, the error message or "")."""
    try:
        parse_infer_request(decode_body(body.raw, body.encoding, limit_bytes), None)
    except RouterError as exc:
        return exc.http_status, exc.message
    return 200, ""


def cpu_seconds(body: Body, limit_bytes: int, repeats: int) -> tuple[float, tuple[int, str]]:
    """The least thread CPU time of ``repeats`` calls, and the answer."""
    best = float("inf")
    for _ in range(repeats):
        start = time.thread_time()
        answer = decode_and_parse(body, limit_bytes)
        best = min(best, time.thread_time() - start)
    return best, answer


def peak_bytes(body: Body, limit_bytes: int) -> int:
    tracemalloc.start()
    try:
        decode_and_parse(body, limit_bytes)
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def conditions(size_bytes: int, repeats: int) -> dict:
    return {"machine": platform.node(), "platform": platform.platform(), "cpus": os.cpu_count(),
            "python": platform.python_version(), "size_bytes": size_bytes,
            "limit_bytes": max(size_bytes, LIMIT_BYTES), "repeats": repeats,
            "load_average": [round(x, 2) for x in os.getloadavg()]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-mb", type=float, default=LIMIT_BYTES / (1 << 20),
                    help="body size in MiB (default: the router's request limit)")
    ap.add_argument("--quick", action="store_true", help="1 MiB bodies")
    ap.add_argument("--repeats", type=int, default=3, help="timed calls per body; the least counts")
    ap.add_argument("--no-memory", action="store_true", help="skip the tracemalloc runs")
    ap.add_argument("--out", type=Path, default=RESULTS / "abuse.json")
    args = ap.parse_args(argv)
    size_bytes = int((1 if args.quick else args.size_mb) * (1 << 20))
    limit_bytes = max(size_bytes, LIMIT_BYTES)
    cond = conditions(size_bytes, args.repeats)
    print("conditions: " + ", ".join(f"{k} {v}" for k, v in cond.items()), flush=True)
    rows = []
    reference = normal(size_bytes)
    for name, build in {"normal": normal, **HOSTILE}.items():
        body = reference if name == "normal" else build(size_bytes)
        cpu_s, (status, message) = cpu_seconds(body, limit_bytes, args.repeats)
        peak = None if args.no_memory else peak_bytes(body, limit_bytes)
        rows.append({"body": name, "bytes": len(body.raw), "encoding": body.encoding or "none",
                     "status": status, "message": message[:120], "cpu_s": round(cpu_s, 4),
                     "peak_mib": None if peak is None else round(peak / (1 << 20), 1)})
    normal_cpu_s = rows[0]["cpu_s"]
    print(f"\n{'body':<20} {'bytes':>10} {'answer':>6} {'cpu s':>8} {'x normal':>8} {'peak MiB':>9}")
    for r in rows:
        r["cpu_vs_normal"] = round(r["cpu_s"] / normal_cpu_s, 2) if normal_cpu_s else None
        peak = "-" if r["peak_mib"] is None else f"{r['peak_mib']:.1f}"
        print(f"{r['body']:<20} {r['bytes']:>10} {r['status']:>6} {r['cpu_s']:>8.3f} "
              f"{r['cpu_vs_normal']:>8.2f} {peak:>9}" + (f"  {r['message'][:70]}" if r["message"] else ""))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"conditions": cond, "rows": rows}, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
