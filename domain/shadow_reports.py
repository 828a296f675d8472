"""A shadow route's cumulative comparison counts.

Kept by each router worker's shadow mirror and summed by the control plane over its workers'
reports, so both sides count the same fields.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ShadowReport:
    mirrored: int = 0
    dropped: int = 0
    shed: int = 0
    errors: int = 0
    timeouts: int = 0
    compared: int = 0
    diverged: int = 0
    latency_delta_ms_sum: float = 0.0
    last: list = field(default_factory=list)

    def to_dict(self) -> dict:
        return {
            "mirrored": self.mirrored, "dropped": self.dropped, "shed": self.shed,
            "errors": self.errors, "timeouts": self.timeouts, "compared": self.compared,
            "diverged": self.diverged,
            "divergence_rate": round(self.diverged / self.compared, 6) if self.compared else None,
            "mean_latency_delta_ms": round(self.latency_delta_ms_sum / self.compared, 3)
            if self.compared else None,
        }
