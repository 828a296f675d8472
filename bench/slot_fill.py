"""A family slot's swap-in alone, side by side in one run: ``SlotBank.fill`` of one variant
from the host-DRAM warm tier (tmpfs) with 1, 2, 4, 8 and 16 threads, copying out of the
file's kept mapping (the default) and reading it with preadv; on a GPU, through a pinned
staging buffer with and without each part's device copy overlapping the reads after it, and
as one device copy straight out of the mapping registered with CUDA (the default there);
against a plain read of the same file into host memory, a memcpy of the same bytes and a
pinned host-to-device copy of them; and the first fill out of a new mapping (its page
faults, and on a GPU its registration).

    .venv/bin/python -m bench.slot_fill [--size-mb 200] [--repeats 15] [--device cuda]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from model_runtime.family.layout import read_layout
from model_runtime.family.slots import SlotBank


def p50_ms(samples: list[float]) -> float:
    return round(sorted(samples)[len(samples) // 2] * 1000, 2)


def timed(fn, repeats: int) -> list[float]:
    fn()  # pages committed, staging allocated
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-mb", type=float, default=200.0)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--threads", default="1,2,4,8,16")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "slot_fill.json")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    warm = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    work = Path(tempfile.mkdtemp(prefix="bench-slot-", dir=warm))
    path = work / "variant.safetensors"
    weights = {"w": torch.randn(int(args.size_mb * 1e6 / 4), generator=torch.Generator().manual_seed(0))}
    save_file(weights, str(path))
    layout, offset = read_layout(path)
    nbytes = layout.data_bytes
    rows = []
    try:
        host = torch.empty(nbytes, dtype=torch.uint8)
        with open(path, "rb", buffering=0) as f:
            def plain_read():
                f.seek(offset)
                f.readinto(memoryview(host.numpy()))
            rows.append({"what": "plain read into host memory (1 thread)", "p50_ms": p50_ms(timed(plain_read, args.repeats))})
        source = torch.empty(nbytes, dtype=torch.uint8).fill_(1)
        rows.append({"what": "memcpy of the same bytes (1 thread)",
                     "p50_ms": p50_ms(timed(lambda: host.copy_(source), args.repeats))})
        if device.type == "cuda":
            pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
            on_device = torch.empty(nbytes, dtype=torch.uint8, device=device)

            def h2d():
                on_device.copy_(pinned, non_blocking=True)
                torch.cuda.synchronize(device)
            rows.append({"what": "pinned host-to-device copy", "p50_ms": p50_ms(timed(h2d, args.repeats))})
        overlaps = (False, True) if device.type == "cuda" else (False,)
        expected = weights["w"].view(torch.uint8).reshape(-1)
        for mapped in (True, False):
          for threads in (int(t) for t in args.threads.split(",")):
            for overlap in overlaps:
                bank = SlotBank(layout, 1, device, read_threads=threads, overlap_copies=overlap,
                                map_files=mapped, direct_copies=False, in_place=False)

                def fill(bank=bank):
                    bank.release("v")
                    bank.fill("v", path)
                samples = timed(fill, args.repeats)
                assert torch.equal(bank.buffers[0].cpu(), expected), "the slot does not hold the file's bytes"
                bank.close()
                label = f"SlotBank.fill, {'kept mapping' if mapped else 'preadv'}, {threads} threads" + (
                    (", copies overlap the reads" if overlap else ", one copy after the read")
                    if device.type == "cuda" else "")
                rows.append({"what": label, "threads": threads, "overlap": overlap,
                             "read": "kept mapping" if mapped else "preadv",
                             "p50_ms": p50_ms(samples), "gb_per_s": round(nbytes / (p50_ms(samples) / 1000) / 1e9, 2)})
                del bank
                if device.type == "cuda":
                    torch.cuda.empty_cache()
        if device.type == "cuda":  # the product's default on a GPU: no staging copy
            bank = SlotBank(layout, 1, device)

            def direct_fill(bank=bank):
                bank.release("v")
                bank.fill("v", path)
            samples = timed(direct_fill, args.repeats)
            assert torch.equal(bank.buffers[0].cpu(), expected), "the slot does not hold the file's bytes"
            label = "SlotBank.fill, one device copy out of the registered mapping"
            if bank.pinned.disabled:
                label += f" (NOT registered: {bank.pinned.disabled[:60]}; staging)"
            rows.append({"what": label, "direct": True, "registered": bank.pinned.disabled is None,
                         "p50_ms": p50_ms(samples), "gb_per_s": round(nbytes / (p50_ms(samples) / 1000) / 1e9, 2)})
            bank.close()
        if device.type == "cpu":  # the product's default on CPU for a file in host RAM
            bank = SlotBank(layout, 1, device)

            def in_place_fill(bank=bank):
                bank.release("v")
                bank.fill("v", path)
            samples = timed(in_place_fill, args.repeats)
            in_place = bank.reads_in_place(0)
            views = torch.cat([v.reshape(-1).view(torch.uint8) for v in bank.views(0).values()])
            assert torch.equal(views, expected), "the slot does not read the file's bytes"
            label = ("SlotBank.fill, read in place out of the kept mapping" if in_place
                     else "SlotBank.fill, copied: not in host RAM or under IN_PLACE_MIN_BYTES")
            rows.append({"what": label, "in_place": in_place, "p50_ms": p50_ms(samples)})  # no bytes move

            def settle(bank=bank):
                bank.release("v")
                bank.fill("v", path)
                bank.settle(0)
            if in_place:
                samples = timed(settle, args.repeats)
                assert torch.equal(bank.buffers[0], expected), "the settled slot does not hold the file's bytes"
                rows.append({"what": "SlotBank.fill in place, then its copy afterwards (settle, 1 thread)",
                             "p50_ms": p50_ms(samples),
                             "gb_per_s": round(nbytes / (p50_ms(samples) / 1000) / 1e9, 2)})
            bank.close()
        for direct in (False, True) if device.type == "cuda" else (False,):
            bank = SlotBank(layout, 1, device, direct_copies=direct, in_place=False)
            bank.fill("v", path)  # the slot's pages committed

            def first_fill(bank=bank):
                bank.release("v")
                bank.files.close()  # a new mapping: its pages fault in (and are registered)
                bank.files = bank.new_mapped_files(sweep_s=None)
                bank.fill("v", path)
            samples = timed(first_fill, args.repeats)
            how = ", registering it" if direct else ""
            rows.append({"what": f"SlotBank.fill, first out of a new mapping{how}, {bank.read_threads} threads",
                         "p50_ms": p50_ms(samples), "gb_per_s": round(nbytes / (p50_ms(samples) / 1000) / 1e9, 2)})
            bank.close()
    finally:
        path.unlink(missing_ok=True)
        work.rmdir()
    result = {"benchmark": "slot_fill", "conditions": {
        "machine": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version(),
        "torch": torch.__version__, "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "bytes": nbytes, "warm tier": str(warm), "repeats": args.repeats, "loadavg": os.getloadavg()},
        "rows": rows}
    print(f"slot_fill: one {nbytes / 1e6:.0f} MB variant from {warm} into a slot on {result['conditions']['device']}, "
          f"{os.cpu_count()} CPUs, p50 of {args.repeats}")
    if device.type != "cuda":
        print("  skipped for lack of a GPU: the pinned host-to-device copy, the device copies "
              "overlapping the reads and the device copy out of the registered mapping (fills "
              "here copy into host memory)")
        result["skipped"] = ("no GPU: pinned host-to-device copy, device copies overlapping the reads, "
                             "device copy out of the registered mapping")
    for row in rows:
        print(f"  {row['what']:<58} {row['p50_ms']:>8.2f} ms" + (f"  {row['gb_per_s']:>6.2f} GB/s" if "gb_per_s" in row else ""))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
