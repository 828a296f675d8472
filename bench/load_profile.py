"""Where the load of a demo model goes, on a real tritonserver, phase by phase.

The demo model's folder is copied with its ``model.py`` replaced by a thin profiling wrapper
that runs the real file (``model_repository/recommender/1/model.py``) unchanged and
writes timestamps (epoch seconds) to a file: when the stub process started (/proc), when
Triton ran ``model.py``, when its imports were done, how long reading the weights and
building the model took in ``initialize``.  The control plane's side is timed around each
call it makes: the load RPC, reading the warm-up plan, the warm-up inference, and the rest
of ``ensure`` (placement, accounting, SQLite).  Two reference models say what is Triton's:
``floor`` (a python model importing nothing) and ``torch-only`` (imports torch, nothing
else).  Unloads are timed until Triton's index shows the model UNAVAILABLE, once with the
control plane's polling and, at the same time, with a 5 ms poll: the difference is what
the polling cadence adds.

    .venv/bin/python -m bench.load_profile [--cycles 6] [--model-size-mb 0]
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

from control_plane.demo.fleet import (
    TEMPLATE_DIR,
    FleetSpec,
    generate_fleet,
    hidden_dim_for_size,
)
from control_plane.manager.manager_config import ManagerConfig
from control_plane.manager.model_manager import ModelManager
from control_plane.manager.records import ServerSpec
from control_plane.state.state_store import StateStore
from control_plane.triton.admin import TritonModelState
from control_plane.triton.process import TritonLaunchConfig, TritonProcess

# The wrapper the profiled models get as their 1/model.py.  It adds no work to the model's
# own path but the timestamps.
PROFILED_MODEL = '''
import time
_MODULE_START = time.time()
import importlib.util
import json
import os

_spec = importlib.util.spec_from_file_location("recommender_model", {real!r})
_mod = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_mod)  # the real model.py: torch, safetensors, numpy
_IMPORTS_DONE = time.time()
_weights_s = []
_real_load_file = _mod.load_file


def _timed_load_file(*args, **kwargs):
    start = time.perf_counter()
    try:
        return _real_load_file(*args, **kwargs)
    finally:
        _weights_s.append(time.perf_counter() - start)


_mod.load_file = _timed_load_file


def _process_start_epoch():
    # Age from /proc (clock ticks since boot vs uptime): btime has whole seconds only.
    with open("/proc/self/stat") as f:
        start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
    with open("/proc/uptime") as f:
        uptime_s = float(f.read().split()[0])
    return time.time() - (uptime_s - start_ticks / os.sysconf("SC_CLK_TCK"))


class TritonPythonModel(_mod.TritonPythonModel):
    def initialize(self, args):
        start = time.time()
        super().initialize(args)
        done = time.time()
        with open({out!r}, "a") as f:
            f.write(json.dumps({{"process_start": _process_start_epoch(),
                                 "module_start": _MODULE_START, "imports_done": _IMPORTS_DONE,
                                 "init_start": start, "init_done": done,
                                 "weights_read_s": sum(_weights_s), "pid": os.getpid()}}) + "\\n")
'''

FLOOR_MODEL = '''
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        out = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "FEATURES").as_numpy()
            out.append(pb_utils.InferenceResponse(
                output_tensors=[pb_utils.Tensor("SCORES", x[:, :1].astype(np.float32))]))
        return out
'''


def write_reference(repo: Path, name: str, body: str) -> None:
    """A model with the demo model's config and ``body`` as its model.py."""
    folder = repo / name
    (folder / "1").mkdir(parents=True, exist_ok=True)
    (folder / "1" / "model.py").write_text(body)
    config = (repo / "cust001" / "config.pbtxt").read_text().replace('name: "cust001"', f'name: "{name}"')
    (folder / "config.pbtxt").write_text(config)


def stub_rss_bytes(model: str, repo: Path) -> int | None:
    """Resident memory of the python stub serving ``model`` (its cmdline names the folder)."""
    needle = str(repo / model)
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmd = (entry / "cmdline").read_bytes().decode(errors="replace")
            if "triton_python_backend_stub" not in cmd or needle not in cmd:
                continue
            for line in (entry / "status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        except OSError:
            continue
    return None


def median_or_none(values: list) -> float | None:
    """The median of the values measured (a cycle may measure none of one kind)."""
    measured = [v for v in values if v is not None]
    return statistics.median(measured) if measured else None


class Timed:
    """Wraps a TritonAdmin's calls and records how long each took (seconds, last call)."""

    def __init__(self, admin):
        self.admin = admin
        self.last: dict[str, float] = {}
        self.started: dict[str, float] = {}
        self.calls: dict[str, list[float]] = {}
        # triton_index: the index RPC itself, which the unload's wait for UNAVAILABLE polls
        # (index() is the manager's view and calls it too).
        for method in ("load", "warmup_plan", "warmup", "statistics", "triton_index"):
            setattr(admin, method, self._wrap(method, getattr(admin, method)))

    def _wrap(self, method, real):
        async def timed(*args, **kwargs):
            self.started[method] = time.time()
            start = time.perf_counter()
            try:
                return await real(*args, **kwargs)
            finally:
                took_s = time.perf_counter() - start
                self.last[method] = self.last.get(method, 0.0) + took_s
                self.calls.setdefault(method, []).append(took_s)

        return timed

    def reset(self) -> None:
        self.last.clear()
        self.calls.clear()


async def tight_free(admin, model: str, poll_s: float = 0.005) -> float:
    """Epoch time at which the index first shows ``model`` UNAVAILABLE, polling every 5 ms."""
    while True:
        entry = (await admin.index()).get(model)
        if entry is None or entry.state in (TritonModelState.UNAVAILABLE, TritonModelState.ABSENT):
            return time.time()
        await asyncio.sleep(poll_s)


async def profile(proc: TritonProcess, repo: Path, work: Path, names: list[str], refs: list[str],
                  profile_file: Path, cycles: int) -> dict:
    spec = ServerSpec("triton0", proc.grpc_url, proc.http_url, max_loaded=2)
    mgr = ModelManager([ModelManager.make_server(spec, "lru")], StateStore(work / "state.db"),
                       repository=repo, config=ManagerConfig(policy="lru", headroom_models=0))
    await mgr.start()
    admin = mgr.servers["triton0"].admin
    timed = Timed(admin)
    from control_plane.triton.admin import TritonAdmin

    watcher = TritonAdmin(proc.grpc_url)  # its own channel, so polls do not queue behind ours
    rows, refs_rows = [], []
    for i in range(cycles):
        name = names[i % len(names)]
        timed.reset()
        t0 = time.time()
        p0 = time.perf_counter()
        rec = await mgr.ensure(name)
        ensure_s = time.perf_counter() - p0
        stub = json.loads(profile_file.read_text().splitlines()[-1])
        rss = stub_rss_bytes(name, repo)
        load_sent = timed.started["load"]
        load_s = timed.last["load"]
        row = {
            "model": name,
            "ensure_s": ensure_s,
            "load_rpc_s": load_s,
            # Triton receives the load, reads the config, spawns the stub process.
            "triton_to_stub_process_s": stub["process_start"] - load_sent,
            # The stub's interpreter starts, connects to Triton, imports its own modules.
            "stub_startup_s": stub["module_start"] - stub["process_start"],
            "imports_s": stub["imports_done"] - stub["module_start"],
            "triton_until_initialize_s": stub["init_start"] - stub["imports_done"],
            "weights_read_s": stub["weights_read_s"],
            "model_build_s": (stub["init_done"] - stub["init_start"]) - stub["weights_read_s"],
            "after_initialize_until_load_returns_s": (load_sent + load_s) - stub["init_done"],
            "warmup_plan_s": timed.last.get("warmup_plan", 0.0),
            "warmup_infer_s": timed.last.get("warmup", 0.0),
            "control_plane_rest_s": ensure_s - load_s - timed.last.get("warmup_plan", 0.0)
            - timed.last.get("warmup", 0.0),
            "statistics_rpc_s": timed.last.get("statistics", 0.0),
            "stub_rss_bytes": rss,
            "model_bytes": rec.memory_bytes,
            "started_at": t0,
        }
        # Unload: the control plane's polling and a 5 ms poll, side by side.
        u0 = time.time()
        await admin.unload(name)
        tight = asyncio.create_task(tight_free(watcher, name))
        timed.calls.pop("triton_index", None)
        await admin.wait_unavailable(name)
        seen_by_control_plane = time.time()
        freed = await tight
        polls = timed.calls.get("triton_index", [])
        row["unload_to_free_s"] = freed - u0
        row["polling_lag_s"] = max(0.0, seen_by_control_plane - freed)
        row["index_polls"] = len(polls)
        row["index_rpc_ms"] = 1000 * statistics.median(polls) if polls else None
        await mgr.step()
        rows.append(row)
    for i in range(cycles):
        for ref in refs:
            t0 = time.perf_counter()
            await admin.load(ref)
            load_s = time.perf_counter() - t0
            rss = stub_rss_bytes(ref, repo)
            await admin.unload(ref)
            await admin.wait_unavailable(ref)
            refs_rows.append({"model": ref, "load_rpc_s": load_s, "stub_rss_bytes": rss})
    await watcher.close()
    await mgr.close()
    return {"cycles": rows, "references": refs_rows}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cycles", type=int, default=6)
    ap.add_argument("--model-size-mb", type=float, default=0, help="0 = the small demo model")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "load_profile.json")
    args = ap.parse_args(argv)
    logging.getLogger("control_plane").setLevel(logging.ERROR)  # unloads behind its back
    work = Path(tempfile.mkdtemp(prefix="bench-profile-"))
    repo = work / "repository"
    spec = FleetSpec(count=3)
    if args.model_size_mb:
        spec = FleetSpec(count=3, hidden_dim=hidden_dim_for_size(args.model_size_mb))
    generate_fleet(repo, spec)
    profile_file = work / "stub-profile.jsonl"
    wrapper = PROFILED_MODEL.format(real=str(TEMPLATE_DIR / "1" / "model.py"), out=str(profile_file))
    names = spec.names()
    for name in names:
        (repo / name / "1" / "model.py").write_text(wrapper)
    write_reference(repo, "floor", FLOOR_MODEL)
    write_reference(repo, "torch-only", "import torch  # noqa: F401\n" + FLOOR_MODEL)
    loadavg_start = os.getloadavg()
    proc = TritonProcess(TritonLaunchConfig(repository=repo, work_dir=work / "triton"))
    proc.start()
    try:
        data = asyncio.run(profile(proc, repo, work, names, ["floor", "torch-only"], profile_file,
                                   args.cycles))
    finally:
        proc.stop()
        shutil.rmtree(work, ignore_errors=True)
    rows = data["cycles"]
    phases = ["triton_to_stub_process_s", "stub_startup_s", "imports_s", "triton_until_initialize_s",
              "weights_read_s", "model_build_s", "after_initialize_until_load_returns_s",
              "warmup_plan_s", "warmup_infer_s", "control_plane_rest_s"]
    med = {k: median_or_none([r[k] for r in rows]) for k in
           phases + ["ensure_s", "load_rpc_s", "statistics_rpc_s", "unload_to_free_s", "polling_lag_s",
                     "index_polls", "index_rpc_ms"]}
    refs = {}
    for ref in ("floor", "torch-only"):
        values = [r for r in data["references"] if r["model"] == ref]
        refs[ref] = {"load_rpc_s": statistics.median(r["load_rpc_s"] for r in values),
                     "stub_rss_bytes": max((r["stub_rss_bytes"] or 0) for r in values)}
    result = {
        "benchmark": "load_profile",
        "command": "python -m bench.load_profile " + " ".join(argv if argv is not None else sys.argv[1:]),
        "conditions": {"machine": platform.node(), "cpus": os.cpu_count(),
                       "python": platform.python_version(), "model_bytes": rows[0]["model_bytes"],
                       "cycles": args.cycles, "loadavg_start": [round(v, 2) for v in loadavg_start],
                       "loadavg_end": [round(v, 2) for v in os.getloadavg()]},
        "median": med,
        "stub_rss_bytes": max((r["stub_rss_bytes"] or 0) for r in rows),
        "references": refs,
        "cycles": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    labels = {
        "triton_to_stub_process_s": "Triton: load RPC -> stub process exists",
        "stub_startup_s": "stub: interpreter + backend utils until model.py",
        "imports_s": "model.py imports (torch, safetensors, numpy)",
        "triton_until_initialize_s": "Triton: imports done -> initialize()",
        "weights_read_s": "initialize: read weights (safetensors)",
        "model_build_s": "initialize: build the torch model",
        "after_initialize_until_load_returns_s": "Triton: initialize done -> load RPC returns",
        "warmup_plan_s": "control plane: read config for the warm-up",
        "warmup_infer_s": "control plane: warm-up inference",
        "control_plane_rest_s": "control plane: placement, accounting, SQLite",
    }
    print(f"load profile of {rows[0]['model_bytes']}-byte demo models, median of {args.cycles}, "
          f"{os.cpu_count()} CPUs, load average {loadavg_start[0]:.2f} at start:")
    for k in phases:
        print(f"  {labels[k]:<52} {med[k] * 1000:8.1f} ms")
    print(f"  {'= ensure (miss with room, no eviction)':<52} {med['ensure_s'] * 1000:8.1f} ms")
    print(f"  references: load RPC of a python model importing nothing "
          f"{refs['floor']['load_rpc_s'] * 1000:.0f} ms, importing torch only "
          f"{refs['torch-only']['load_rpc_s'] * 1000:.0f} ms")
    print(f"  stub RSS: demo model {result['stub_rss_bytes'] / 2**20:.0f} MiB, torch only "
          f"{refs['torch-only']['stub_rss_bytes'] / 2**20:.0f} MiB, nothing "
          f"{refs['floor']['stub_rss_bytes'] / 2**20:.0f} MiB")
    print(f"  unload until Triton shows UNAVAILABLE {med['unload_to_free_s']:.3f} s; the control "
          f"plane's polling saw it {med['polling_lag_s'] * 1000:.0f} ms later, after "
          f"{med['index_polls']:.0f} index RPCs of "
          f"{'-' if med['index_rpc_ms'] is None else format(med['index_rpc_ms'], '.2f')} ms (medians)")
    print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
