"""Cold tier bandwidth: a verified download from S3 (moto's server) against the local store.

One model folder (config.pbtxt + weights of ``--size-mb`` random bytes) is published to
both stores, then downloaded ``--repeats`` times with ``download_verified`` (streamed into a
staging folder on the warm tier's filesystem, sha256 checked as the bytes arrive), from:

* the local directory store (the default cold tier),
* S3 with one GET per object (how downloads went before ranged GETs),
* S3 with ``--concurrency`` ranged GETs of ``--part-mb`` in flight.

The same run also measures sha256 alone over the same bytes (the bound of any verified
download on this CPU).  moto's S3 server runs in its own process, so it does not share the
downloader's interpreter; it is a Python server, so its numbers are a floor for a real one.

    .venv/bin/python -m bench.cold_bandwidth [--size-mb 256] [--repeats 3] [--concurrency 8]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import requests

from control_plane.tiers.cold import (
    LocalDirStore,
    S3Config,
    S3Store,
    download_verified,
    publish,
)
from control_plane.triton.process import free_port

MB = 1_000_000
BUCKET = "bench"


def start_moto(port: int, object_bytes: int) -> subprocess.Popen:
    # moto keeps an object larger than its key buffer (5 MiB by default) in a temporary file
    # and reads all of it for every GET, ranged or not: keep the artifact in memory instead.
    env = dict(os.environ, MOTO_S3_DEFAULT_KEY_BUFFER_SIZE=str(2 * object_bytes))
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            requests.get(f"http://127.0.0.1:{port}/moto-api/", timeout=1)
            return proc
        except requests.RequestException:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError("moto's S3 server did not start")


def timed_downloads(store, uri: str, sha256: str, staging: Path, repeats: int) -> list[float]:
    """Seconds of each verified download (the staged folder is removed after each)."""
    times = []
    for i in range(repeats):
        start = time.perf_counter()
        folder, _ = download_verified(store, uri, sha256, staging, f"bench{i}")
        times.append(time.perf_counter() - start)
        shutil.rmtree(folder)
    return times


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-mb", type=float, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--concurrency", type=int, default=S3Config.max_concurrency)
    ap.add_argument("--part-mb", type=float, default=S3Config.part_size_bytes / (1 << 20),
                    help="MiB per ranged GET")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "cold_bandwidth.json")
    args = ap.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="bench-cold-"))
    # Staging lives where the warm tier does by default: tmpfs (host RAM) when there is one.
    shm = Path("/dev/shm")
    staging_root = Path(tempfile.mkdtemp(prefix="bench-cold-", dir=shm if shm.is_dir() else work))
    size_bytes = int(args.size_mb * MB)
    folder = work / "model"
    (folder / "1").mkdir(parents=True)
    (folder / "config.pbtxt").write_text('name: "bench"\nbackend: "python"\n')
    (folder / "1" / "weights.bin").write_bytes(os.urandom(size_bytes))
    port = free_port()
    moto = start_moto(port, size_bytes)
    loadavg_start = os.getloadavg()
    try:
        data = (folder / "1" / "weights.bin").read_bytes()
        start = time.perf_counter()
        hashlib.sha256(data).hexdigest()
        sha_s = time.perf_counter() - start
        del data

        local = LocalDirStore(work / "cold")
        local_uri = local.default_uri("bench", 1)
        info = publish(local, folder, local_uri)

        def s3(concurrency: int, part_bytes: int) -> S3Store:
            return S3Store(S3Config(bucket=BUCKET, prefix="m", endpoint_url=f"http://127.0.0.1:{port}",
                                    region="us-east-1", access_key_id="bench",
                                    secret_access_key="bench", addressing_style="path",
                                    max_concurrency=concurrency, part_size_bytes=part_bytes))

        parallel = s3(args.concurrency, int(args.part_mb * (1 << 20)))
        parallel.client.create_bucket(Bucket=BUCKET)
        s3_uri = f"s3://{BUCKET}/m/bench/1/"
        publish(parallel, folder, s3_uri)
        # One GET per object: a part size larger than the object means no ranges.
        single = s3(1, 2 * size_bytes + (5 << 20))
        runs = {
            "local": timed_downloads(local, local_uri, info.sha256, staging_root, args.repeats),
            "s3_one_get": timed_downloads(single, s3_uri, info.sha256, staging_root, args.repeats),
            "s3_ranged": timed_downloads(parallel, s3_uri, info.sha256, staging_root, args.repeats),
        }
    finally:
        moto.terminate()
        moto.wait(timeout=10)
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(staging_root, ignore_errors=True)
    total = info.size_bytes
    mbps = {k: total / MB / statistics.median(v) for k, v in runs.items()}
    result = {
        "benchmark": "cold_bandwidth",
        "command": "python -m bench.cold_bandwidth " + " ".join(argv if argv is not None else sys.argv[1:]),
        "conditions": {"machine": platform.node(), "cpus": os.cpu_count(),
                       "python": platform.python_version(), "artifact_bytes": total,
                       "repeats": args.repeats, "concurrency": args.concurrency,
                       "part_mib": args.part_mb, "staging": str(staging_root.parent),
                       "s3": "moto server (python -m moto.server), its own process, loopback",
                       "loadavg_start": [round(v, 2) for v in loadavg_start],
                       "loadavg_end": [round(v, 2) for v in os.getloadavg()]},
        "sha256_only_mb_per_s": total / MB / sha_s,
        "mb_per_s": mbps,
        "s3_ranged_vs_local": mbps["s3_ranged"] / mbps["local"],
        "s3_ranged_vs_one_get": mbps["s3_ranged"] / mbps["s3_one_get"],
        "seconds": runs,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"verified download of a {total / MB:.0f} MB artifact into {staging_root.parent}, median "
          f"of {args.repeats}, {os.cpu_count()} CPUs, load average {loadavg_start[0]:.2f}:")
    print(f"  sha256 alone                        {result['sha256_only_mb_per_s']:8.0f} MB/s")
    print(f"  local directory store               {mbps['local']:8.0f} MB/s")
    print(f"  S3 (moto), one GET per object       {mbps['s3_one_get']:8.0f} MB/s")
    print(f"  S3 (moto), {args.concurrency} ranged GETs of {args.part_mb:g} MiB  "
          f"{mbps['s3_ranged']:8.0f} MB/s  ({result['s3_ranged_vs_local']:.2f}x local, "
          f"{result['s3_ranged_vs_one_get']:.2f}x one GET)")
    print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
