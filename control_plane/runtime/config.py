"""The control plane's settings: parsed once by mmctl, validated here, carried to the
control plane's own process as JSON (secrets excepted: they travel in its environment)."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field, fields
from pathlib import Path

from control_plane.domain.errors import InvalidInput
from control_plane.eviction import DEFAULT_POLICY, POLICIES

log = logging.getLogger(__name__)


@dataclass
class ServiceConfig:
    state_dir: Path = Path(".state")
    repository: Path | None = None  # Triton's repository = the warm tier; default below
    warm_budget_bytes: int | None = None
    cold_dir: Path | None = None  # local cold store; default <state_dir>/cold
    s3: object | None = None  # cold_store.S3Config when an S3 bucket is configured
    auto_pin_top_k: int | None = None
    prefetch_min_miss_rate: float | None = None
    admin_host: str = "127.0.0.1"
    admin_port: int = 8090
    admin_token: str | None = None  # None: reuse or generate <state_dir>/admin.token
    admin_allowed_hosts: list[str] = field(default_factory=list)  # extra Host names
    triton_host: str = "127.0.0.1"
    triton_servers: int = 1  # CPU Tritons to start where no GPU is found
    # GPUs / MIG slices: one Triton each, found by NVML.  ``devices``: only these (ids such as
    # gpu0 or gpu1/mig2, server names, UUIDs); ``device_budgets``: bytes per device id.
    devices: list[str] | None = None
    device_budgets: dict[str, int] = field(default_factory=dict)
    nvml: object | None = None  # an NVML module (pynvml's surface); None: pynvml if usable
    use_nvml: bool = True
    triton_http_port: int = 8100  # server i uses port + 10 * i; 0 = any free port
    triton_grpc_port: int = 8101
    triton_metrics_port: int = 8102
    attach: list[str] = field(default_factory=list)  # gRPC URLs of running Tritons
    max_loaded: int | None = None
    memory_budget_bytes: int | None = None  # None: derived from the device (local servers)
    derive_memory_budget: bool = True  # False (--memory-budget unlimited): no byte budget
    # Write the demo fleet (fleet_size models, the LoRA demo) into the repository where
    # missing: only `mmctl up` sets it (no --repository, or --demo); a control plane of a
    # cluster never writes demo models.
    demo: bool = False
    fleet_size: int = 50
    model_size_mb: float | None = None
    # The demo fleet as one model family ("family": variants in the weight slots of one
    # Triton model) or one Triton model per customer ("models").
    fleet_layout: str = "family"
    policy: str = DEFAULT_POLICY
    reconcile_interval_s: float = 2.0
    drain_timeout_s: float = 30.0
    unload_timeout_s: float = 60.0
    triton_ready_timeout_s: float = 120.0
    router: bool = True
    # Router worker processes (control_plane.runtime.supervisor); 0: the router runs in this process.
    # With workers this process serves them (dataplane_hub) and binds no public port.
    router_workers: int = 0
    router_host: str = "127.0.0.1"
    router_http_port: int = 8000
    router_grpc_port: int = 8001
    max_request_bytes: int = 16 * 1024 * 1024
    expose_versions: bool = False  # concrete Triton names callable on the public port
    load_wait_timeout_s: float = 120.0
    # Room each server keeps free for the next miss (ManagerConfig): None = one model where
    # at least 8 fit, 0 = off; headroom_bytes: explicit bytes under a byte budget.
    headroom_models: int | None = None
    headroom_bytes: int | None = None
    # Past one machine.  state_url: sqlite:///path or postgresql://... (None: the SQLite file
    # in state_dir).  Leader election: on by default with PostgreSQL (several control planes
    # share it), off with SQLite; lease_ttl_s bounds how long a dead leader is waited for.
    state_url: str | None = None
    leader_election: bool | None = None
    lease_ttl_s: float = 5.0
    instance_name: str | None = None  # this control plane in the lease (default host:pid:rand)
    advertise_url: str | None = None  # how standbys and operators reach this admin API
    servers_file: Path | None = None  # Tritons registered by address (runtime.tritons)
    triton_admin_key: str | None = None  # Triton's restricted model-repository protocol key
    # A registered Triton that has not answered for this long is lost: its models are
    # placed again elsewhere (pinned ones at once, the others at their next request).
    server_lost_after_s: float = 10.0
    # Router workers run elsewhere (mmctl router, other pods): serve them, bind no public port.
    external_routers: bool = False

    def validate(self) -> None:
        if self.max_loaded is not None and self.max_loaded < 1:
            raise InvalidInput(f"max_loaded ({self.max_loaded}) must be >= 1")
        if self.memory_budget_bytes is not None and self.memory_budget_bytes < 1:
            raise InvalidInput(f"memory budget ({self.memory_budget_bytes}) must be > 0 bytes")
        if self.triton_servers < 0 or (self.triton_servers == 0 and not self.attach
                                       and self.servers_file is None):
            raise InvalidInput(
                f"triton_servers ({self.triton_servers}) must be >= 1 unless --attach or "
                "--servers-file is given")
        if self.lease_ttl_s <= 0.5:
            raise InvalidInput(f"--lease-ttl ({self.lease_ttl_s}s) must be > 0.5s: the leader "
                               "renews every third of it")
        if self.headroom_models is not None and self.headroom_models < 0:
            raise InvalidInput(f"--headroom-models ({self.headroom_models}) must be >= 0 (0 turns "
                               "the headroom off)")
        if self.headroom_bytes is not None and self.headroom_bytes < 0:
            raise InvalidInput(f"--headroom-bytes ({self.headroom_bytes}) must be >= 0 (0 turns "
                               "the byte headroom off)")
        if self.fleet_size < 0:
            raise InvalidInput(f"fleet_size ({self.fleet_size}) must be >= 0")
        if self.fleet_layout not in ("family", "models"):
            raise InvalidInput(f"fleet layout {self.fleet_layout!r} must be 'family' or 'models'")
        if self.policy not in POLICIES:
            raise InvalidInput(
                f"unknown eviction policy {self.policy!r}; choose one of {', '.join(sorted(POLICIES))}")
        if self.admin_host not in ("127.0.0.1", "localhost", "::1"):
            log.warning("admin API binds %s: it can load and unload models; keep it off public "
                        "networks", self.admin_host)

    @property
    def repository_dir(self) -> Path:
        """The warm tier, which Triton serves from: host DRAM (tmpfs) when there is room
        for the demo fleet and the warm budget, else a folder in the state directory."""
        if self.repository is not None:
            return self.repository.resolve()
        from control_plane.tiers.warm import default_warm_repository

        need = (self.warm_budget_bytes or 0) + int(self.fleet_size * (self.model_size_mb or 1) * 1e6)
        return default_warm_repository(self.state_dir, need)


# Not carried in the config file: the S3 settings and a fake NVML come from the environment
# of the control plane's process, the admin token from its file.
# The state URL (it may hold a password) and Triton's admin key come from the environment too.
_NOT_IN_FILE = frozenset({"s3", "nvml", "admin_token", "state_url", "triton_admin_key"})
_PATH_FIELDS = frozenset({"state_dir", "repository", "cold_dir", "servers_file"})


def config_to_json(cfg: ServiceConfig) -> str:
    """The control plane's settings, for the process the supervisor starts."""
    body = {}
    for f in fields(cfg):
        if f.name not in _NOT_IN_FILE:
            value = getattr(cfg, f.name)
            body[f.name] = str(value) if isinstance(value, Path) else value
    return json.dumps(body, indent=2)


def config_from_json(text: str) -> ServiceConfig:
    body = json.loads(text)
    for name in _PATH_FIELDS:
        if body.get(name) is not None:
            body[name] = Path(body[name])
    return ServiceConfig(**body)


