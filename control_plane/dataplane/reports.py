"""What router workers tell the control plane, as the data-plane hub keeps it: when each was
last heard from, the reports it sends (per-model use, per-variant outcomes, shadow counts),
checked whole before anything is applied, and the shadow counts summed over workers."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, fields

from domain.errors import InvalidInput
from domain.shadow_reports import ShadowReport

WORKER_LIVE_S = 10.0  # a worker not heard from for this long no longer counts as live
SHADOW_COUNTS = tuple(f.name for f in fields(ShadowReport) if f.name != "last")
SHADOW_COUNT_TYPES = {name: type(getattr(ShadowReport(), name)) for name in SHADOW_COUNTS}  # int, float


@dataclass
class WorkerSeen:
    worker: str
    pid: int = 0
    last_seen: float = 0.0
    version: int = -1  # the snapshot version it has
    epoch: str = ""
    requests: int = 0  # requests it reported
    samples: int = 0  # canary / experiment outcomes it reported
    shadow: dict = field(default_factory=dict)  # route -> its cumulative ShadowReport counts
    watching: int = 0  # its snapshot long-polls waiting here now
    report_call: int = 0  # the latest ask for reports it answered (DataPlaneHub.gather_reports)

    def live(self, now: float) -> bool:
        return now - self.last_seen < WORKER_LIVE_S

    def in_touch(self, now: float) -> bool:
        """Live, or waiting in a long-poll: an idle worker's watch (``WATCH_WAIT_S`` of
        router.serving.state_client, longer than ``WORKER_LIVE_S``) is its heartbeat."""
        return self.watching > 0 or self.live(now)

    def to_dict(self, now: float) -> dict:
        return {"worker": self.worker, "pid": self.pid, "snapshot_version": self.version,
                "seen_s_ago": round(now - self.last_seen, 3), "live": self.live(now),
                "requests": self.requests, "samples": self.samples}


@dataclass
class WorkerReport:
    worker: str
    pid: int
    uses: dict[str, int]  # model -> requests served since the last report
    requests: int
    samples: list[tuple[str, str, str, float | None, bool]]  # scope, variant, code, ms, random
    shadow: dict[str, dict[str, int | float]] | None  # route -> cumulative ShadowReport counts
    report_call: int = 0  # the ask for reports this one answers; 0: a periodic report


def worker_of(body: dict) -> tuple[str, int]:
    try:
        return str(body.get("worker", "")), int(body.get("pid") or 0)
    except (TypeError, ValueError):
        raise InvalidInput(f"pid must be a number, got {body.get('pid')!r}") from None


def parse_report(body: dict) -> WorkerReport:
    """A worker's report, every field checked: a malformed one is refused whole (400)."""
    worker, pid = worker_of(body)
    try:
        uses = {str(model): int(count) for model, count in (body.get("uses") or {}).items()}
        requests = int(body.get("requests") or 0)
        samples = [(str(scope), str(variant), str(code), None if ms is None else float(ms), bool(randomly))
                   for scope, variant, code, ms, randomly in body.get("samples") or []]
        report_call = int(body.get("report_call") or 0)
        shadow = body.get("shadow")
        if shadow is not None:
            shadow = {str(route): {key: SHADOW_COUNT_TYPES[key](counts.get(key, 0)) for key in SHADOW_COUNTS}
                      for route, counts in shadow.items()}
    except (TypeError, ValueError, AttributeError) as exc:
        raise InvalidInput(f"malformed data-plane report from worker {worker!r} ({exc}): uses is "
                           "{model: count}, requests a count, samples [scope, variant, code, "
                           "served_ms or null, randomly_assigned] lists, shadow {route: {count: n}}") from None
    return WorkerReport(worker, pid, uses, requests, samples, shadow, report_call)


class ShadowReports:
    """Shadow reports summed over workers (``control_plane.admin.rollout_routes`` reads ``reports`` and ``report``)."""

    def __init__(self, workers: Callable[[], Iterable[WorkerSeen]], log_dir: str | None):
        self.workers = workers  # the hub's workers, as they are when asked
        self.log_dir = log_dir

    @property
    def reports(self) -> dict[str, ShadowReport]:
        routes = {r for w in self.workers() for r in w.shadow}
        return {r: self._merged(r) for r in routes}

    def _merged(self, route: str) -> ShadowReport:
        total = ShadowReport()
        for w in self.workers():
            counts = w.shadow.get(route)
            for key in SHADOW_COUNTS:
                if counts:
                    setattr(total, key, getattr(total, key) + counts.get(key, 0))
        return total

    def report(self, route: str) -> dict:
        body = self._merged(route).to_dict()
        body["workers"] = sum(1 for w in self.workers() if route in w.shadow)
        if self.log_dir is not None:
            body["log"] = f"{self.log_dir}/w*/{route}.jsonl"  # one folder per router worker
        return body
