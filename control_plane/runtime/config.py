"""The control plane's settings, declared once (``domain.settings``): each
field below that is a ``setting`` is an option of ``mmctl up`` / ``mmctl control-plane``
(mmctl/settings.py derives them), an ``MMS_`` environment variable, and a row
of ``mmctl settings --markdown``.  Parsed once by mmctl, validated here, carried to the
control plane's own process as JSON (secrets excepted: they travel in its environment).

Environment variables of earlier releases still read (``aliases``): MMCTL_TOKEN,
MMCTL_STATE_URL, MMCTL_ADVERTISE_URL, MMCTL_TRITON_ADMIN_KEY (and, elsewhere, MMCTL_URL,
MMCTL_TOKEN_FILE, MMCTL_CONTROL_URL); the MMS_ name wins where both are set.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, fields
from pathlib import Path

from control_plane.eviction import POLICIES
from control_plane.manager.manager_config import ManagerConfig
from domain.errors import InvalidInput
from domain.settings import (
    ADMIN_TOKEN,
    DATAPLANE_TOKEN,
    FLAG,
    LOG_LEVEL,
    MIN_TOKEN_CHARS,
    MULTIPLE,
    SWITCH,
    TRACE_EXPORTER,
    at_least_zero,
    comma_list,
    declared,
    file_path,
    same_as,
    setting,
)
from domain.sizes import parse_size, size_text
from domain.worker_settings import WorkerConfig

log = logging.getLogger(__name__)

UP = ("up",)  # settings only `mmctl up` takes (a cluster's control plane runs no router)
UNLIMITED = "unlimited"  # --memory-budget unlimited: no byte budget at all


def parse_budget(text: str) -> int | str:
    """A size, or 'unlimited' (ServiceConfig turns it into derive_memory_budget=False)."""
    return UNLIMITED if text.strip().lower() == UNLIMITED else parse_size(text)


def parse_device_budget(entry: str) -> tuple[str, int]:
    """``gpu0=60GiB`` -> ("gpu0", bytes)."""
    device, sep, size = entry.partition("=")
    if not sep or not device.strip() or not size.strip():
        raise InvalidInput(f"{entry!r} is not DEVICE=SIZE (example: gpu0=60GiB)")
    return device.strip(), parse_size(size)


def _show_budget(value: int | str) -> str:
    return value if isinstance(value, str) else size_text(value)


@dataclass
class ServiceConfig:
    # ----------------------------------------------------- settings of up and control-plane
    state_dir: Path = setting(
        Path(".state"), "Pins, routes, registry (SQLite), admin token, endpoints.json, Triton logs.",
        flag="--state-dir", parse=Path)
    # Triton's repository = the warm tier; default: ``repository_dir`` below
    repository: Path | None = setting(
        None, "Triton model repository (default: <state-dir>/repository with the demo fleet).",
        flag="--repository", parse=Path)
    max_loaded: int | None = setting(None, "Most models loaded per Triton server.",
                                     flag="--max-loaded", parse=int)
    server_concurrency: int | None = setting(
        None, "Requests each Triton server takes at once from the router; past that each "
        "model gets its fair share of the server (mmctl share). Default: no limit.",
        flag="--server-concurrency", parse=int)
    # None: derived from the device (local servers); ``--memory-budget unlimited`` sets
    # derive_memory_budget=False instead (__post_init__).
    memory_budget_bytes: int | None = setting(
        None, "Bytes of model memory per server (e.g. 2GiB), or 'unlimited'. Default: each "
        "GPU's or MIG slice's memory less 10% (at least 1 GiB), else 50% of host RAM shared by "
        "the local servers (mmctl fleet shows it).",
        flag="--memory-budget", parse=parse_budget, show=_show_budget, metavar="SIZE")
    fleet_size: int = setting(
        50, "Demo models cust001..custNNN to create if missing (mmctl up's demo).",
        flag="--fleet-size", parse=int)
    model_size_mb: float | None = setting(
        None, "Weight size of each demo model (the seed scenario uses 850).",
        flag="--model-size-mb", parse=float)
    # The demo fleet as one model family ("family": variants in the weight slots of one
    # Triton model) or one Triton model per customer ("models").
    fleet_layout: str = setting(
        "family", "Demo fleet as one model family (variants swap into the weight slots of one "
        "Triton model) or as one Triton model per customer.",
        flag="--fleet-layout", choices=("family", "models"))
    admin_host: str = setting(
        "127.0.0.1", "Address of the admin API (model control: keep it off public networks).",
        flag="--admin-host")
    admin_port: int = setting(
        8090, "Port of the admin API (0 = any free port; endpoints.json says which).",
        flag="--admin-port", parse=int)
    admin_token: str | None = ADMIN_TOKEN.field(flag="--admin-token")
    dataplane_token: str | None = DATAPLANE_TOKEN.field()  # environment only: argv is visible
    admin_allowed_hosts: list[str] = setting(  # extra Host names
        (), "Another Host name the admin API answers to besides loopback and --admin-host "
        "(repeatable); any other name is refused (DNS rebinding).",
        flag="--admin-allowed-host", kind=MULTIPLE, env="MMS_ADMIN_ALLOWED_HOSTS")
    triton_servers: int = setting(  # CPU Tritons to start where no GPU is found
        1, "Local tritonserver processes to start on a machine without GPUs (with GPUs: one per "
        "GPU or MIG slice).", flag="--triton-servers", parse=int)
    # GPUs / MIG slices: one Triton each, found by NVML.  ``devices``: only these (ids such as
    # gpu0 or gpu1/mig2, server names, UUIDs); ``device_budgets``: bytes per device id.
    devices: list[str] | None = setting(
        None, "Only these GPUs / MIG slices, comma-separated: ids as `mmctl fleet` shows them "
        "(gpu0, gpu1/mig2; a GPU's id selects all its slices) or UUIDs. Default: every one NVML "
        "finds.", flag="--devices", parse=comma_list, show=",".join)
    device_budgets: dict[str, int] = setting(
        (), "Model memory of one device, e.g. gpu0=60GiB (repeatable). Default: the device's "
        "memory less a reserve of 10% (at least 1 GiB) for Triton's CUDA context, memory pool "
        "and fragmentation.", flag="--device-budget", kind=MULTIPLE, parse=parse_device_budget,
        collect=dict, show=lambda pair: f"{pair[0]}={size_text(pair[1])}", metavar="DEVICE=SIZE",
        env="MMS_DEVICE_BUDGETS")
    # server i uses port + 10 * i; 0 = any free port
    triton_http_port: int = setting(
        8100, "Triton's internal HTTP port (server i: port + 10*i; 0 = any free port).",
        flag="--triton-http-port", parse=int)
    triton_grpc_port: int = setting(
        8101, "Triton's internal gRPC port (server i: port + 10*i; 0 = any free port).",
        flag="--triton-grpc-port", parse=int)
    triton_metrics_port: int = setting(
        8102, "Triton's metrics port (server i: port + 10*i; 0 = any free port).",
        flag="--triton-metrics-port", parse=int)
    attach: list[str] = setting(  # gRPC URLs of running Tritons
        (), "Already running Triton: GRPC_URL[,HTTP_URL] (repeatable).", flag="--attach",
        kind=MULTIPLE)
    expose_versions: bool = setting(  # concrete Triton names callable on the public port
        False, "Let clients call concrete Triton names (cust017.v3, cust017-faulty) directly. "
        "Off: only logical names and their registry versions are public, so A/B, canaries and "
        "limits on a name cannot be skipped.", flag="--expose-versions", kind=FLAG)
    warm_budget_bytes: int | None = setting(
        None, "Bytes of host DRAM for the warm tier (Triton's repository), e.g. 16GiB.",
        flag="--warm-budget", parse=parse_size, show=size_text, metavar="SIZE")
    cold_dir: Path | None = setting(  # local cold store; default <state_dir>/cold
        None, "Local cold store (default <state-dir>/cold). S3 comes from MMS_S3_* env.",
        flag="--cold-dir", parse=Path)
    auto_pin_top_k: int | None = setting(
        None, "Pin the K models with the most traffic automatically.", flag="--auto-pin-top-k",
        parse=int)
    prefetch_min_miss_rate: float | None = setting(
        None, "Prefetch into warm the models missing more often than this per second.",
        flag="--prefetch-min-miss-rate", parse=float)
    # The model manager's settings (control_plane.manager.manager_config): declared there.
    policy: str = same_as(ManagerConfig, "policy")
    headroom_models: int | None = same_as(ManagerConfig, "headroom_models")
    headroom_bytes: int | None = same_as(ManagerConfig, "headroom_bytes")
    scale_up_outstanding: float = same_as(ManagerConfig, "scale_up_outstanding")
    scale_up_after_s: float = same_as(ManagerConfig, "scale_up_after_s")
    scale_down_after_s: float = same_as(ManagerConfig, "scale_down_after_s")
    reconcile_interval_s: float = setting(
        2.0, "Seconds between passes that compare with each Triton and repair.",
        flag="--reconcile-interval", parse=float)
    log_level: str = LOG_LEVEL.field()
    trace_exporter: str | None = TRACE_EXPORTER.field()
    # ----------------------------------------------------- settings of mmctl up alone
    # Write the demo fleet (fleet_size models, the LoRA demo) into the repository where
    # missing.  None: mmctl up decides (when no --repository); a control plane of a cluster
    # never writes demo models.
    demo: bool | None = setting(
        None, "Write the demo fleet (--fleet-size models, the LoRA demo) where missing. "
        "Default: when no --repository is given.", flag="--demo", kind=SWITCH, commands=UP)
    router: bool = setting(True, "Serve the public Triton-compatible endpoint.",
                           flag="--router", kind=SWITCH, commands=UP)
    # Router worker processes (control_plane.runtime.supervisor).  None: mmctl up starts a
    # quarter of the cores; 0 (or None in a ServiceConfig built in code): the router runs
    # in this process.  With workers this process serves them (dataplane_hub) and binds no
    # public port.
    router_workers: int | None = setting(
        None, "Router processes sharing the public ports (SO_REUSEPORT), supervised with the "
        "control plane: a crash of either leaves the other serving. Default: a quarter of the "
        "cores (1 to 8). 0: the router runs inside the control plane's process (one process, "
        "no supervisor).", flag="--router-workers", parse=at_least_zero, metavar="INTEGER",
        commands=UP)
    # The router's public side: the same settings as `mmctl router`'s (one declaration).
    router_host: str = same_as(WorkerConfig, "host", "--router-host", UP)
    router_http_port: int = same_as(WorkerConfig, "http_port", "--router-http-port", UP)
    router_grpc_port: int = same_as(WorkerConfig, "grpc_port", "--router-grpc-port", UP)
    max_request_bytes: int = same_as(WorkerConfig, "max_request_bytes", commands=UP)
    load_timeout_s: float = same_as(WorkerConfig, "load_timeout_s", commands=UP)
    miss_budget: float = same_as(WorkerConfig, "miss_budget", commands=UP)
    client_header: str | None = same_as(WorkerConfig, "client_header", commands=UP)
    # ----------------------------------------------------- past one machine
    # state_url: sqlite:///path or postgresql://... (None: the SQLite file in state_dir).
    # Leader election: on by default with PostgreSQL (several control planes share it), off
    # with SQLite; lease_ttl_s bounds how long a dead leader is waited for.
    state_url: str | None = setting(
        None, "Where durable state lives: sqlite:///path/state.db or "
        "postgresql://user:password@host/db (prefer the environment: argv is visible to other "
        "users). Default: <state-dir>/state.db. With PostgreSQL several control planes share "
        "it: one leads, the others stand by.",
        flag="--state-url", aliases=("MMCTL_STATE_URL",), secret=True)
    leader_election: bool | None = setting(
        None, "Run for the leader lease in the state store before acting. Default: on with "
        "PostgreSQL, off with SQLite.", flag="--leader-election", kind=SWITCH)
    lease_ttl_s: float = setting(
        5.0, "Seconds a leader's lease lasts without renewal: how long a standby waits after "
        "the leader's death before it takes over.", flag="--lease-ttl", parse=float)
    instance_name: str | None = setting(  # this control plane in the lease
        None, "This control plane's name in the lease (default host:pid:random).",
        flag="--instance-name")
    advertise_url: str | None = setting(  # how standbys and operators reach this admin API
        None, "How other machines reach this admin API, recorded with the lease so a standby "
        "can name the leader (default: http://<admin host>:<port>; in a pod: "
        "http://$(POD_IP):8090).", flag="--advertise-url", aliases=("MMCTL_ADVERTISE_URL",))
    servers_file: Path | None = setting(  # Tritons registered by address (runtime.tritons)
        None, "JSON list of Tritons running elsewhere (other nodes), registered by address: "
        '{"servers": [{"name", "grpc_url", "http_url", "metrics_url", "node", '
        '"memory_budget"}]}. README: More than one machine.',
        flag="--servers-file", parse=file_path, metavar="FILE")
    triton_admin_key: str | None = setting(  # the key of Triton's restricted APIs
        None, "Key of the Tritons' restricted APIs (model control, shared memory, trace, "
        "logging): the Tritons started here take those calls only with it, and the control "
        "plane sends it to every Triton. Default: reuse or generate <state-dir>/triton.key "
        "(mode 0600). Prefer the environment.",
        flag="--triton-admin-key", aliases=("MMCTL_TRITON_ADMIN_KEY",), secret=True)
    server_lost_after_s: float = same_as(ManagerConfig, "server_lost_after_s")
    # ----------------------------------------------------- set by code, not by users
    s3: object | None = None  # cold_store.S3Config (its own MMS_S3_* settings) or None
    nvml: object | None = None  # an NVML module (pynvml's surface); None: pynvml if usable
    use_nvml: bool = True
    derive_memory_budget: bool = True  # False (--memory-budget unlimited): no byte budget
    triton_host: str = "127.0.0.1"
    triton_ready_timeout_s: float = 120.0
    # Router workers run elsewhere (mmctl router, other pods): serve them, bind no public port.
    external_routers: bool = False

    def __post_init__(self) -> None:
        if self.memory_budget_bytes == UNLIMITED:
            self.memory_budget_bytes, self.derive_memory_budget = None, False

    def validate(self) -> None:
        if self.max_loaded is not None and self.max_loaded < 1:
            raise InvalidInput(f"max_loaded ({self.max_loaded}) must be >= 1")
        if self.server_concurrency is not None and self.server_concurrency < 1:
            raise InvalidInput(f"server_concurrency ({self.server_concurrency}) must be >= 1")
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
        for flag, value in (("--scale-up-outstanding", self.scale_up_outstanding),
                            ("--scale-up-after", self.scale_up_after_s),
                            ("--scale-down-after", self.scale_down_after_s)):
            if not value > 0:
                raise InvalidInput(f"{flag} ({value}) must be > 0")
        if self.fleet_layout not in ("family", "models"):
            raise InvalidInput(f"fleet layout {self.fleet_layout!r} must be 'family' or 'models'")
        if self.policy not in POLICIES:
            raise InvalidInput(
                f"unknown eviction policy {self.policy!r}; choose one of {', '.join(sorted(POLICIES))}")
        if self.admin_token and len(self.admin_token) < MIN_TOKEN_CHARS:
            raise InvalidInput(f"the admin token given (--admin-token / MMS_ADMIN_TOKEN) has "
                               f"{len(self.admin_token)} characters; use at least {MIN_TOKEN_CHARS}, "
                               "or leave it unset for a generated one")
        if self.dataplane_token and len(self.dataplane_token) < MIN_TOKEN_CHARS:
            # It opens /v1/dataplane/*, which reaches every router worker's state: the same
            # floor as the admin token.  A file written by hand: ensure_dataplane_token_file.
            raise InvalidInput(f"the data-plane token given (MMS_DATAPLANE_TOKEN) has "
                               f"{len(self.dataplane_token)} characters; use at least "
                               f"{MIN_TOKEN_CHARS}, or leave it unset for a generated one")
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


# Not carried in the config file: secrets (the state URL may hold a password; Triton's admin
# key) come from the environment of the control plane's process, the admin token from its
# file; the S3 settings (MMS_S3_*) and a fake NVML from its environment too.
SECRETS = frozenset(d.name for d in declared(ServiceConfig) if d.setting.secret)
_NOT_IN_FILE = SECRETS | {"s3", "nvml"}
_PATH_FIELDS = frozenset(d.name for d in declared(ServiceConfig) if d.setting.parse in (Path, file_path))


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


