"""What router workers tell the control plane: the reports they send (per-model use,
per-variant outcomes, shadow counts), checked whole before anything is applied, taken into
the manager's use counts and the rollouts' statistics, asked for on demand, and the shadow
counts summed over workers."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, fields

from control_plane.dataplane.workers import WorkerRegistry, WorkerSeen
from domain.errors import InvalidInput
from domain.shadow_reports import ShadowReport

GATHER_TIMEOUT_S = 2.0  # a read of experiment / canary / shadow figures waits this long for reports
SHADOW_COUNTS = tuple(f.name for f in fields(ShadowReport) if f.name != "last")
SHADOW_COUNT_TYPES = {name: type(getattr(ShadowReport(), name)) for name in SHADOW_COUNTS}  # int, float


@dataclass
class WorkerReport:
    worker: str
    pid: int
    # model -> requests served since the last report, in the order of each one's last use (the
    # most recent last): the order the least-recently-used policies are touched in
    uses: dict[str, int]
    requests: int
    samples: list[tuple[str, str, str, float | None, bool]]  # scope, variant, code, ms, random
    shadow: dict[str, dict[str, int | float]] | None  # route -> cumulative ShadowReport counts
    report_call: int = 0  # the ask for reports this one answers; 0: a periodic report
    # model -> requests it has sent to Triton and not had answered, now (none: all idle)
    outstanding: dict[str, int] = field(default_factory=dict)


def worker_of(body: dict) -> tuple[str, int]:
    try:
        return str(body.get("worker", "")), int(body.get("pid") or 0)
    except (TypeError, ValueError):
        raise InvalidInput(f"pid must be a number, got {body.get('pid')!r}") from None


# A model's uses in one report or ensure count at most this many times for the policies
# that count frequency: the work a body causes stays bounded by its size.
MAX_TOUCHES_PER_USE = 32


def parse_uses(body: dict) -> dict[str, int]:
    """``uses`` of a report or an ensure: {model: requests}, in the order of their last use;
    raises TypeError, ValueError or AttributeError when malformed."""
    return {str(model): int(count) for model, count in (body.get("uses") or {}).items()}


def parse_report(body: dict) -> WorkerReport:
    """A worker's report, every field checked: a malformed one is refused whole (400)."""
    worker, pid = worker_of(body)
    try:
        uses = parse_uses(body)
        requests = int(body.get("requests") or 0)
        samples = [(str(scope), str(variant), str(code), None if ms is None else float(ms), bool(randomly))
                   for scope, variant, code, ms, randomly in body.get("samples") or []]
        report_call = int(body.get("report_call") or 0)
        outstanding = {str(model): int(n) for model, n in (body.get("outstanding") or {}).items()}
        shadow = body.get("shadow")
        if shadow is not None:
            shadow = {str(route): {key: SHADOW_COUNT_TYPES[key](counts.get(key, 0)) for key in SHADOW_COUNTS}
                      for route, counts in shadow.items()}
    except (TypeError, ValueError, AttributeError) as exc:
        raise InvalidInput(f"malformed data-plane report from worker {worker!r} ({exc}): uses is "
                           "{model: count}, requests a count, samples [scope, variant, code, "
                           "served_ms or null, randomly_assigned] lists, shadow {route: {count: n}}, "
                           "outstanding {model: count}") from None
    return WorkerReport(worker, pid, uses, requests, samples, shadow, report_call, outstanding)


class ReportGathering:
    """Takes each worker's report into the manager's use counts (``touch``) and the
    rollouts' statistics (``record_outcome``), and asks every worker for one on demand."""

    def __init__(self, workers: WorkerRegistry, touch: Callable[[str], None],
                 record_outcome: Callable[..., None], shadow_log_dir: str | None = None):
        self.workers = workers
        self.touch = touch
        self.record_outcome = record_outcome
        self.shadow = ShadowReports(lambda: workers.workers.values(), shadow_log_dir)
        # Asks for reports now (gather): answered through the workers' long-polls, so that
        # statistics read after a client's answers count those answers.
        self.report_call = 0

    def take(self, report: WorkerReport) -> bool:
        """Apply a checked report; True when it answers an ask (the hub then tells the
        waiters)."""
        seen = self.workers.heard_from(report.worker, report.pid)
        self.take_uses(report.uses)
        seen.requests += report.requests
        for scope, variant, code, served_ms, randomly in report.samples:
            self.record_outcome(scope, variant, code, served_ms, randomly)
        seen.samples += len(report.samples)
        if report.shadow is not None:
            if seen.shadow_pid not in (0, report.pid):  # a new process of this worker
                for route, counts in seen.shadow.items():
                    before = seen.shadow_before.setdefault(route, {})
                    for key, value in counts.items():
                        before[key] = before.get(key, 0) + value
            seen.shadow = report.shadow
            seen.shadow_pid = report.pid
        seen.outstanding = report.outstanding
        if report.report_call > seen.report_call:
            seen.report_call = report.report_call
            return True
        return False

    def take_uses(self, uses: dict[str, int]) -> None:
        """Touch each model used, in the order given (the most recently used last), once per
        use up to ``MAX_TOUCHES_PER_USE`` (frequency-aware policies count uses)."""
        for model, count in uses.items():
            for _ in range(min(count, MAX_TOUCHES_PER_USE)):
                self.touch(model)

    def outstanding(self) -> dict[str, int]:
        """Requests each model has on Triton now, over the workers in touch (each worker
        reports its count when it changes, with its other reports)."""
        total: dict[str, int] = {}
        for seen in self.workers.in_touch():
            for model, n in seen.outstanding.items():
                total[model] = total.get(model, 0) + n
        return total

    def asked_since(self, answered: int) -> bool:
        """Whether there is an ask newer than the one a worker last ``answered``."""
        return self.report_call > answered

    async def gather(self, timeout_s: float = GATHER_TIMEOUT_S) -> bool:
        """Ask every worker in touch for its report now and wait until each has answered:
        experiment, canary and shadow figures read next count every request answered before
        this call (workers otherwise report every 0.25 s, later on a busy machine).  False
        when a worker did not answer in ``timeout_s``: the figures may then lag."""
        asked = self.workers.in_touch()
        if not asked:
            return True
        self.report_call += 1
        call = self.report_call
        # The long-polls carry the ask: woken, each answers at once.
        return await self.workers.wait_until(lambda: all(w.report_call >= call for w in asked),
                                             time.monotonic() + timeout_s, notify=True)


class ShadowReports:
    """Shadow reports summed over workers (``control_plane.admin.rollout_routes`` reads
    ``reports`` and ``report``)."""

    def __init__(self, workers: Callable[[], Iterable[WorkerSeen]], log_dir: str | None):
        self.workers = workers  # the hub's workers, as they are when asked
        self.log_dir = log_dir

    @property
    def reports(self) -> dict[str, ShadowReport]:
        routes = {r for w in self.workers() for r in (*w.shadow, *w.shadow_before)}
        return {r: self._merged(r) for r in routes}

    def _merged(self, route: str) -> ShadowReport:
        total = ShadowReport()
        for w in self.workers():
            for counts in (w.shadow_before.get(route), w.shadow.get(route)):
                if not counts:
                    continue
                for key in SHADOW_COUNTS:
                    setattr(total, key, getattr(total, key) + counts.get(key, 0))
        return total

    def report(self, route: str) -> dict:
        body = self._merged(route).to_dict()
        body["workers"] = sum(1 for w in self.workers() if route in w.shadow)
        if self.log_dir is not None:
            body["log"] = f"{self.log_dir}/w*/{route}.jsonl"  # one folder per router worker
        return body
