"""Run Triton's own example clients, unmodified, against a tritonserver directly and against
the router of `mmctl up`, and compare what they print.

The examples live in Triton's client repository (src/python/examples); they are not part of
this product.  Point ``--examples`` at a folder holding them:

    python -m tests.client_examples --examples ~/client/src/python/examples

Both sides serve the models the examples call (``tests.triton_examples``).  An example
passes when it exits 0 against the router and prints the same lines as against Triton
(lines with timings or addresses are compared after masking numbers that vary).  The
server's list of extensions differs on purpose: the public port offers no model control,
trace, logging or CUDA shared memory.
"""

from __future__ import annotations

import argparse
import difflib
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import tritonclient.grpc as grpcclient

from control_plane.triton.process import TritonLaunchConfig, TritonProcess
from tests.product import Product
from tests.triton_examples import EXAMPLE_MODELS, write_example_repository

# (script, protocol of -u, extra arguments)
EXAMPLES = [
    ("simple_grpc_health_metadata.py", "grpc", []),
    ("simple_http_health_metadata.py", "http", []),
    ("simple_grpc_infer_client.py", "grpc", []),
    ("simple_grpc_async_infer_client.py", "grpc", []),
    ("simple_grpc_aio_infer_client.py", "grpc", []),
    ("simple_http_infer_client.py", "http", []),
    ("simple_http_async_infer_client.py", "http", []),
    ("simple_http_aio_infer_client.py", "http", []),
    ("simple_grpc_string_infer_client.py", "grpc", []),
    ("simple_http_string_infer_client.py", "http", []),
    ("grpc_explicit_int_content_client.py", "grpc", []),
    ("grpc_explicit_int8_content_client.py", "grpc", []),
    ("grpc_explicit_byte_content_client.py", "grpc", []),
    ("reuse_infer_objects_client.py", "grpc", ["-i", "grpc"]),
    ("reuse_infer_objects_client.py", "http", ["-i", "http"]),
    ("simple_grpc_keepalive_client.py", "grpc", []),
    ("simple_grpc_custom_args_client.py", "grpc", []),
    ("simple_grpc_shm_client.py", "grpc", []),
    ("simple_http_shm_client.py", "http", []),
    ("simple_grpc_shm_string_client.py", "grpc", []),
    ("simple_http_shm_string_client.py", "http", []),
]

VARYING = re.compile(r"\d+(\.\d+)?")
# The server's extensions differ on purpose: the public port offers no model control, trace,
# logging or CUDA shared memory.
EXTENSION_LINE = re.compile(r"^extensions: .*\n", re.MULTILINE)
EXTENSION_LIST = re.compile(r"'extensions': \[[^]]*\]")


def run_example(path: Path, url: str, extra: list[str]) -> tuple[int, str]:
    proc = subprocess.run([sys.executable, str(path), "-u", url, *extra], check=False, capture_output=True,
                          text=True, timeout=120)
    return proc.returncode, proc.stdout + proc.stderr


def comparable(output: str) -> list[str]:
    output = EXTENSION_LIST.sub("'extensions': [...]", EXTENSION_LINE.sub("", output))
    return [VARYING.sub("#", line) for line in output.splitlines()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--examples", type=Path, required=True,
                        help="Triton's client repository's src/python/examples folder")
    parser.add_argument("--router-workers", default="2")
    args = parser.parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="client-examples-"))
    triton = TritonProcess(TritonLaunchConfig(repository=write_example_repository(root / "direct"),
                                              work_dir=root / "triton"))
    product = Product(root / "state", write_example_repository(root / "repository"),
                      "--router-workers", args.router_workers)
    failed = 0
    try:
        triton.start()
        admin = grpcclient.InferenceServerClient(triton.grpc_url)
        for model in EXAMPLE_MODELS:
            admin.load_model(model)
        product.start()
        for model in EXAMPLE_MODELS:  # loaded on both sides, as the health example expects
            out = product.mmctl("load", model)
            assert out.returncode == 0, out.stdout + out.stderr
        endpoints = product.json("endpoints")
        sides = {"triton": {"grpc": triton.grpc_url, "http": triton.http_url},
                 "router": {"grpc": endpoints["router_grpc"], "http": endpoints["router_http"]}}
        print(f"{'example':44} {'triton':>7} {'router':>7}  same output   router s")
        for script, protocol, extra in EXAMPLES:
            label = script + (f" {' '.join(extra)}" if extra else "")
            direct_rc, direct_out = run_example(args.examples / script, sides["triton"][protocol], extra)
            start = time.perf_counter()
            routed_rc, routed_out = run_example(args.examples / script, sides["router"][protocol], extra)
            took = time.perf_counter() - start
            same = comparable(direct_out) == comparable(routed_out)
            ok = routed_rc == 0 and direct_rc == 0 and same
            failed += not ok
            print(f"{label:44} {direct_rc:>7} {routed_rc:>7}  {'yes' if same else 'NO':11} {took:8.2f}")
            if not ok:
                sys.stdout.writelines(difflib.unified_diff(
                    direct_out.splitlines(keepends=True), routed_out.splitlines(keepends=True),
                    "triton", "router"))
        print(f"{len(EXAMPLES) - failed} of {len(EXAMPLES)} examples pass against the router "
              f"({args.router_workers} router workers)")
    finally:
        product.stop()
        triton.stop()
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
