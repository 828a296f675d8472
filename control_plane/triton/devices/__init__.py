"""Devices the fleet runs on (CPU, whole GPUs, MIG slices) and measured GPU memory.

Discovery uses NVML through ``nvidia-ml-py`` (module ``pynvml``) when it is installed and a
driver answers; otherwise the fleet comes from config (``devices_from_config``), which is
also how a CPU-only machine describes "slices" for tests.  One Triton runs per device; for a
MIG slice it is started with ``CUDA_VISIBLE_DEVICES=<MIG uuid>`` (``launch_env``).

Measured memory: the python backend runs every model instance in its own stub process
(``triton_python_backend_stub <repository>/<model>/<version>/model.py ...``), so NVML's
per-process usage on a device, mapped to models through each stub's command line, is the
model's real footprint.  ``MemoryReconciler.step()`` compares that with what the planner
accounts and corrects (and logs) any drift; on CPU devices the artifact size stays the
estimate and nothing is measured.

Modules:
    discovery  the Device model, the configured fleet, NVML discovery
    budgets    default per-server budget, one Triton server per device with its budget
    probe      per-model GPU bytes from NVML's process list, the MemoryReconciler
    meter      GpuMemoryMeter / NoMemoryMeter around loads and unloads, reserve_measured
"""

from control_plane.triton.devices.budgets import (
    GPU_RESERVE_FRACTION,
    GPU_RESERVE_MIN_BYTES,
    HOST_MEMORY_FRACTION,
    DeviceServer,
    default_memory_budget,
    device_budget_bytes,
    device_servers,
    gpu_reserve_bytes,
    host_memory_bytes,
    select_devices,
    server_name,
)
from control_plane.triton.devices.discovery import (
    DEVICE_KINDS,
    Device,
    devices_from_config,
    discover,
    discover_or_config,
    load_nvml,
)
from control_plane.triton.devices.meter import (
    GpuMemoryMeter,
    Measurement,
    NoMemoryMeter,
    is_python_backend,
    reserve_measured,
)
from control_plane.triton.devices.probe import (
    Correction,
    GpuMemoryProbe,
    MemoryReconciler,
    _stub_model,
    probe_for,
)

__all__ = [
    "DEVICE_KINDS",
    "GPU_RESERVE_FRACTION",
    "GPU_RESERVE_MIN_BYTES",
    "HOST_MEMORY_FRACTION",
    "Correction",
    "Device",
    "DeviceServer",
    "GpuMemoryMeter",
    "GpuMemoryProbe",
    "Measurement",
    "MemoryReconciler",
    "NoMemoryMeter",
    "_stub_model",
    "default_memory_budget",
    "device_budget_bytes",
    "device_servers",
    "devices_from_config",
    "discover",
    "discover_or_config",
    "gpu_reserve_bytes",
    "host_memory_bytes",
    "is_python_backend",
    "load_nvml",
    "probe_for",
    "reserve_measured",
    "select_devices",
    "server_name",
]
