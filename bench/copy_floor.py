"""The floor a family miss is held against: a plain copy of the same bytes between buffers
this process already holds (numpy ``copyto``, torch ``copy_``; on a GPU, pinned host memory
to the device), and the percentiles the family benchmarks print."""

from __future__ import annotations

import time

import numpy as np
import torch


def percentiles(samples_s: list[float]) -> dict:
    ms = np.array(samples_s) * 1000
    return {"n": len(ms), "p50_ms": round(float(np.percentile(ms, 50)), 3),
            "p99_ms": round(float(np.percentile(ms, 99)), 3), "max_ms": round(float(ms.max()), 3)}


def memcpy_baseline(size_bytes: int, repeats: int = 20) -> dict:
    src = np.random.default_rng(0).integers(0, 255, size_bytes, dtype=np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)  # pages committed before timing
    numpy_s = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        numpy_s.append(time.perf_counter() - t0)
    tsrc, tdst = torch.from_numpy(src), torch.from_numpy(dst)
    torch_s = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        tdst.copy_(tsrc)
        torch_s.append(time.perf_counter() - t0)
    out = {"bytes": size_bytes, "numpy_copyto": percentiles(numpy_s), "torch_copy_": percentiles(torch_s)}
    if torch.cuda.is_available():  # what a GPU slot's miss pays at least: pinned host to device
        from bench.gpu import pinned_h2d_seconds

        out["torch_pinned_h2d"] = percentiles(pinned_h2d_seconds(size_bytes, repeats))
        out["cuda_device"] = torch.cuda.get_device_name()
    return out
