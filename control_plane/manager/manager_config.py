"""The model manager's settings.  Those a user sets (``--policy``, the headroom, the copies'
autoscaling, when a silent server is lost) are declared here once (``domain.settings``):
``control_plane.runtime.config.ServiceConfig`` holds the same declarations (``same_as``)
and hands their values over (``shared_values``), so a default exists in one place."""

from __future__ import annotations

from dataclasses import dataclass

from control_plane.eviction import DEFAULT_POLICY, POLICIES
from domain.errors import InvalidInput
from domain.settings import at_least_zero, setting
from domain.sizes import parse_size, size_text


@dataclass
class ManagerConfig:
    drain_timeout_s: float = 30.0
    unload_timeout_s: float = 60.0
    policy: str = setting(
        DEFAULT_POLICY, "Which unpinned model to evict when a server is full: lru (least "
        "recently used), wtinylfu (frequency and load cost), wtinylfu-hits (frequency), gdsf "
        "(frequency, cost and size). README: replayed hit ratios of each.",
        flag="--policy", choices=tuple(sorted(POLICIES)))
    warmup: bool = True
    # After a failed load, on-demand ensures fail fast for this long instead of retrying
    # the load for every request (an explicit `mmctl load` always retries).
    failure_backoff_s: float = 10.0
    # How long a load waits for room held by other loads/unloads in progress.
    capacity_wait_s: float = 120.0
    # Room each server keeps free for the next miss (eviction.HeadroomSpec): None = the
    # default (one model where at least 8 fit), 0 = off.  headroom_bytes: explicit bytes
    # under a byte budget instead of models x the median resident's size.
    headroom_models: int | None = setting(
        None, "Models' worth of room each server keeps free, so that a miss loads at once "
        "instead of waiting for an unload; the policy's next victim leaves in the background. "
        "Default: 1 on servers that hold at least 8 models, else 0. 0 turns it off.",
        flag="--headroom-models", parse=at_least_zero, metavar="INTEGER")
    headroom_bytes: int | None = setting(
        None, "Bytes each server with a byte budget keeps free instead (e.g. 2GiB); default: "
        "--headroom-models times the median loaded model's size.",
        flag="--headroom-bytes", parse=parse_size, show=size_text, metavar="SIZE")
    # Overlap: memory beyond a model's own size that a load may take while it starts (a
    # python stub with torch: about 0.3 GB of RAM; on a GPU its CUDA context), kept free for
    # each load in flight before a load may start ahead of its victims' unloads.
    overlap_margin_bytes: int = 1 << 30
    # A Triton that has not answered for this long is lost: its models are forgotten there
    # and placed on the others (pinned ones at once, the others at their next request).  A
    # local Triton's went when it went down (it is killed and started again); a registered
    # one keeps them until now.
    server_lost_after_s: float = setting(
        10.0, "Seconds a registered Triton may not answer before its models are placed on the "
        "other servers.", flag="--server-lost-after", parse=float)
    # Liveness probes (Triton's ServerLive, answered by its front end even while models
    # compute): one every probe_interval_s per server, each given probe_timeout_s;
    # probe_failures missed in a row make the server down (a frozen Triton: within
    # interval + failures x timeout).  probe_interval_s 0: no probes (reconcile passes only).
    probe_interval_s: float = 1.0
    probe_timeout_s: float = 1.0
    probe_failures: int = 3
    # A model the router had loaded for a request stays out of the victims until the router
    # says the request was answered, and at most this long (a router that died meanwhile).
    # Generous: on a busy machine a request can take seconds between its load and Triton's
    # answer, and a hold that ends before it does loses the request's model under it.
    on_its_way_s: float = 10.0
    # Copies of a model scaled auto (copies.Copies.autoscale): one more once its outstanding
    # requests per copy stay above scale_up_outstanding for scale_up_after_s (also the
    # cool-down between two changes); one fewer once the copies left would each have under
    # half of that for scale_down_after_s.
    scale_up_outstanding: float = setting(
        4.0, "A model scaled auto (mmctl scale --replicas auto) gets one more copy when its "
        "requests outstanding on Triton, per copy, stay above this for --scale-up-after.",
        flag="--scale-up-outstanding", parse=float)
    scale_up_after_s: float = setting(
        3.0, "Seconds its outstanding requests must stay above --scale-up-outstanding per copy "
        "before a copy is added; also the least time between two changes of one model's copies.",
        flag="--scale-up-after", parse=float)
    scale_down_after_s: float = setting(
        60.0, "Seconds the copies an auto model would keep must each have had under half of "
        "--scale-up-outstanding before it loses one.", flag="--scale-down-after", parse=float)

    def __post_init__(self):
        for name in ("headroom_models", "headroom_bytes", "overlap_margin_bytes", "probe_interval_s"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise InvalidInput(f"{name} ({value}) must be >= 0")
        if self.probe_timeout_s <= 0:
            raise InvalidInput(f"probe_timeout_s ({self.probe_timeout_s}) must be > 0")
        if self.probe_failures < 1:
            raise InvalidInput(f"probe_failures ({self.probe_failures}) must be >= 1")
