"""With no capacity options each local Triton still gets a byte budget derived from the
machine: a share of host RAM on CPU, the GPU's memory less a reserve where there is one."""

from __future__ import annotations

from control_plane.runtime.service import Service, ServiceConfig
from control_plane.triton.devices import (
    GPU_RESERVE_MIN_BYTES,
    HOST_MEMORY_FRACTION,
    Device,
    default_memory_budget,
    host_memory_bytes,
)

GiB = 1 << 30
MEMINFO = "MemTotal:       16384000 kB\nMemFree:         1000000 kB\n"


def test_host_memory_from_meminfo_capped_by_the_cgroup():
    assert host_memory_bytes(MEMINFO, "max\n") == 16384000 * 1024
    assert host_memory_bytes(MEMINFO, "4294967296\n") == 4 * GiB  # a container's limit wins
    assert host_memory_bytes("", "") is None
    assert host_memory_bytes("MemTotal: garbage\n", "") is None


def test_cpu_budget_is_a_share_of_host_ram_per_server():
    assert HOST_MEMORY_FRACTION == 0.5
    budget, how = default_memory_budget([Device("cpu")], servers=2, host_bytes=32 * GiB)
    assert budget == 8 * GiB and "50% of host RAM" in how and "2 server" in how


def test_gpu_budget_is_the_smallest_device_less_a_reserve():
    gpus = [Device("gpu0", "gpu", 80 * GiB, uuid="GPU-a", name="H100"),
            Device("gpu1/mig0", "mig", 20 * GiB, uuid="MIG-b", parent="gpu1")]
    budget, how = default_memory_budget(gpus, servers=1, host_bytes=512 * GiB)
    assert budget == 18 * GiB and "gpu1/mig0" in how  # 20 GiB less 10%
    small = [Device("gpu0", "gpu", 5 * GiB, uuid="GPU-a")]
    assert default_memory_budget(small, 1, None)[0] == 5 * GiB - GPU_RESERVE_MIN_BYTES


def test_nothing_known_means_no_budget():
    budget, how = default_memory_budget([Device("cpu")], servers=1, host_bytes=None)
    assert budget is None and "neither GPU memory nor host RAM" in how


def test_service_derives_the_budget_unless_told(tmp_path):
    def budget(**cfg):
        service = Service(ServiceConfig(state_dir=tmp_path, **cfg))
        return service.tritons.local_memory_budget_bytes(devices=[Device("cpu")], host_bytes=16 * GiB)

    assert budget() == 8 * GiB
    assert budget(triton_servers=2) == 4 * GiB
    assert budget(memory_budget_bytes=2 * GiB) == 2 * GiB  # explicit wins
    assert budget(max_loaded=3) == 8 * GiB  # a slot limit does not remove the byte budget
    assert budget(derive_memory_budget=False) is None  # --memory-budget unlimited
