"""Memory a benchmark reads from outside the product: a process's own pages (RssAnon, from
/proc) and the GPU's memory in use (nvidia-smi)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path


def gpu_used_mib() -> float | None:
    """Device memory in use on GPU 0 (nvidia-smi), or None without one."""
    if shutil.which("nvidia-smi") is None:
        return None
    out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, check=False).stdout
    return float(out.splitlines()[0]) if out.strip() else None


FAMILY_STUB = "triton_python_backend_stub.*recommender"  # the family process's command line


def family_rss_bytes() -> int | None:
    return anon_rss_bytes(FAMILY_STUB)


def anon_rss_bytes(pattern: str) -> int | None:
    """The own pages (RssAnon) of the processes whose command line matches ``pattern``."""
    pids = subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True,
                          check=False).stdout.split()
    return sum(anon_rss_of(pid) for pid in pids) or None


def anon_rss_of(pid: str) -> int:
    """RssAnon of one process in bytes (0 once it is gone): not RssShmem, the warm tier's
    files a family process keeps mapped."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0
