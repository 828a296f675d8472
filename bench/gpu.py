"""GPU benchmarks (run on a machine with a CUDA GPU; CPU machines exit with a message).

1. Adapter swap-in vs a raw pinned host-to-device copy of the same bytes.
2. Load/evict cycles of recommender models with KIND_GPU instances on the real stack, GPU
   memory sampled with nvidia-smi every 50 ms: load time, unload-until-free time, memory
   per loaded model, and memory left behind after every model is unloaded (leaks).

    .venv/bin/python -m bench.gpu [--model-size-mb 200] [--cycles 6]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.process_memory import gpu_used_mib


class MemorySampler(threading.Thread):
    def __init__(self, interval_s: float = 0.05):
        super().__init__(daemon=True)
        self.interval_s = interval_s
        self.samples: list[tuple[float, float]] = []
        self._halt = threading.Event()  # not _stop: Thread has a method of that name

    def run(self) -> None:
        while not self._halt.is_set():
            self.samples.append((time.monotonic(), gpu_used_mib()))
            time.sleep(self.interval_s)

    def stop(self) -> None:
        self._halt.set()
        self.join()


def pinned_h2d_seconds(nbytes: int, repeats: int = 50) -> list[float]:
    """Seconds of each of ``repeats`` copies of ``nbytes`` from pinned host memory to the GPU
    (after one untimed copy)."""
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return times


def raw_copy_gbps(nbytes: int, repeats: int = 50) -> float:
    times = sorted(pinned_h2d_seconds(nbytes, repeats))
    return nbytes / times[len(times) // 2] / 1e9


def swap_in_section() -> dict:
    """The LoRA bench's swap-in on CUDA, then a raw pinned copy of the same bytes."""
    out = subprocess.run([sys.executable, "bench/lora_bench.py", "--only", "swap", "--device", "cuda"],
                         cwd=ROOT, capture_output=True, text=True, check=False)
    print(out.stdout)
    result = {"lora_swap_in_output": out.stdout.strip().splitlines()[-4:]}
    for nbytes in (150_000, 1 << 20, 16 << 20, 256 << 20):
        gbps = raw_copy_gbps(nbytes)
        result[f"raw_pinned_h2d_gbps_{nbytes}"] = round(gbps, 2)
        print(f"raw pinned H2D copy of {nbytes} bytes: {gbps:.2f} GB/s (p50)")
    return result


def load_evict_section(model_size_mb: float, cycles: int) -> dict:
    from control_plane.demo.fleet import FleetSpec, generate_fleet, hidden_dim_for_size
    from tests.product import Product

    work = Path(tempfile.mkdtemp(prefix="bench-gpu-"))
    repo = work / "repository"
    generate_fleet(repo, FleetSpec(count=4, instance_kind="KIND_GPU",
                                   hidden_dim=hidden_dim_for_size(model_size_mb)))
    baseline_mib = gpu_used_mib()
    sampler = MemorySampler()
    product = Product(work / "state", repo, "--max-loaded", "2", "--policy", "lru").start()
    idle_mib = gpu_used_mib()  # Triton up, no model: its own CUDA context and memory pools
    sampler.start()
    loads = []
    try:
        for cycle in range(cycles):
            name = f"cust{cycle % 4 + 1:03d}"
            t0 = time.monotonic()
            assert product.mmctl("load", name).returncode == 0
            loads.append({"model": name, "load_s": round(time.monotonic() - t0, 3),
                          "gpu_used_mib": gpu_used_mib()})
            print(f"cycle {cycle}: loaded {name} in {loads[-1]['load_s']:.2f}s, GPU used "
                  f"{loads[-1]['gpu_used_mib']:.0f} MiB")
        status = product.json("status")
        fleet = product.json("fleet")  # the servers' device, capacity and measured use
        print("fleet:", json.dumps(fleet))
        for m in status:
            if m["state"] == "ready":
                t0 = time.monotonic()
                assert product.mmctl("unload", m["model"]).returncode == 0
                print(f"unloaded {m['model']}: memory free after {time.monotonic() - t0:.2f}s")
        time.sleep(2)
        after_mib = gpu_used_mib()
    finally:
        sampler.stop()
        product.stop()
        shutil.rmtree(work, ignore_errors=True)
    peak = max(m for _, m in sampler.samples) if sampler.samples else None
    result = {"model_size_mb": model_size_mb, "cycles": loads, "status_loaded": status, "fleet": fleet,
              "baseline_mib": baseline_mib, "triton_idle_mib": idle_mib,
              "peak_mib": peak, "after_all_unloaded_mib": after_mib,
              "left_behind_mib": after_mib - idle_mib}
    print(f"GPU memory: before the product {baseline_mib:.0f} MiB, Triton up with no model "
          f"{idle_mib:.0f} MiB, peak {peak:.0f} MiB, after every unload {after_mib:.0f} MiB "
          f"({after_mib - idle_mib:+.0f} MiB left behind by the models)")
    return result


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-size-mb", type=float, default=200.0)
    ap.add_argument("--cycles", type=int, default=6)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "gpu.json")
    args = ap.parse_args(argv)
    try:
        import torch

        has_cuda = torch.cuda.is_available() and shutil.which("nvidia-smi") is not None
    except ImportError:
        has_cuda = False
    if not has_cuda:
        # Both sections measure the GPU itself: nothing of them means anything on a CPU.
        print("bench/gpu.py needs a CUDA GPU and nvidia-smi; this machine has none. Skipped, "
              "for lack of a GPU: adapter swap-in vs a pinned host-to-device copy, and KIND_GPU "
              "load/evict cycles with GPU memory sampled. Nothing was measured.")
        return 2
    result = {"device": torch.cuda.get_device_name(), "swap_in": swap_in_section(),
              "load_evict": load_evict_section(args.model_size_mb, args.cycles)}
    out = args.out
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
