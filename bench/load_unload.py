"""Load and unload times of demo models on a real tritonserver (explicit model control).

For each cycle: Triton load + warm-up through the control plane's manager (the model is
warm: its files are already in the repository), then unload, timing separately when the
unload call returns and when Triton's index shows the model UNAVAILABLE (memory free).

    .venv/bin/python -m bench.load_unload [--cycles 8] [--model-size-mb 0]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from control_plane.demo.fleet import FleetSpec, generate_fleet, hidden_dim_for_size
from control_plane.manager.manager_config import ManagerConfig
from control_plane.manager.model_manager import ModelManager
from control_plane.manager.records import ServerSpec
from control_plane.state.state_store import StateStore
from control_plane.triton.process import TritonLaunchConfig, TritonProcess


async def cycles(proc: TritonProcess, repo: Path, work: Path, n: int) -> list[dict]:
    spec = ServerSpec("triton0", proc.grpc_url, proc.http_url, max_loaded=4)
    mgr = ModelManager([ModelManager.make_server(spec, "lru")], StateStore(work / "state.db"),
                       repository=repo, config=ManagerConfig(policy="lru"))
    await mgr.start()
    admin = mgr.servers["triton0"].admin
    rows = []
    for i in range(n):
        name = f"cust{i % 4 + 1:03d}"
        t0 = time.perf_counter()
        rec = await mgr.ensure(name)
        load_s = time.perf_counter() - t0
        t1 = time.perf_counter()
        await admin.unload(name)
        returned_s = time.perf_counter() - t1
        await admin.wait_unavailable(name)
        free_s = time.perf_counter() - t1
        await mgr.step()  # the manager notices the unload made behind its back
        rows.append({"model": name, "load_and_warmup_s": load_s, "triton_load_s": rec.load_time_s,
                     "warmup_ms": rec.warmup["latency_ms"], "unload_returns_s": returned_s,
                     "unload_to_free_s": free_s, "bytes": rec.memory_bytes})
    await mgr.close()
    return rows


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cycles", type=int, default=8)
    ap.add_argument("--model-size-mb", type=float, default=0, help="0 = the small demo model")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "load_unload.json")
    args = ap.parse_args(argv)
    # The manager logs each unload done behind its back (here, on purpose) as a warning.
    logging.getLogger("control_plane").setLevel(logging.ERROR)
    work = Path(tempfile.mkdtemp(prefix="bench-load-"))
    repo = work / "repository"
    spec = FleetSpec(count=4)
    if args.model_size_mb:
        spec = FleetSpec(count=4, hidden_dim=hidden_dim_for_size(args.model_size_mb))
    generate_fleet(repo, spec)
    proc = TritonProcess(TritonLaunchConfig(repository=repo, work_dir=work / "triton"))
    proc.start()
    try:
        rows = asyncio.run(cycles(proc, repo, work, args.cycles))
    finally:
        proc.stop()
        shutil.rmtree(work, ignore_errors=True)
    med = {k: statistics.median(r[k] for r in rows) for k in
           ("load_and_warmup_s", "triton_load_s", "warmup_ms", "unload_returns_s", "unload_to_free_s")}
    result = {"benchmark": "load_unload", "conditions": {
        "machine": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version(),
        "model_bytes": rows[0]["bytes"], "cycles": args.cycles, "instance_kind": spec.instance_kind},
        "median": med, "cycles": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"{args.cycles} load/unload cycles, model of {rows[0]['bytes']} bytes, {os.cpu_count()} CPUs:")
    print(f"  load + warm-up (ensure)      median {med['load_and_warmup_s']:.3f} s "
          f"(Triton load {med['triton_load_s']:.3f} s incl. warm-up {med['warmup_ms']:.1f} ms)")
    print(f"  unload call returns after    median {med['unload_returns_s'] * 1000:.1f} ms")
    print(f"  unload until memory free     median {med['unload_to_free_s']:.3f} s "
          "(Triton index shows UNAVAILABLE)")
    print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
