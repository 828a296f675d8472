"""What the router hands the outcomes of experiment and canary requests to, and what judges
canaries beside an in-process router: interfaces only.

The statistics and the canary judgement are the control plane's
(``control_plane.rollouts``); the router never imports them (an import contract in
pyproject.toml).  The control plane's service builds them and gives them to the router it
runs in its own process; a router worker reports its outcomes to the control plane instead
(``router.serving.state_client.RemoteState.record_outcome``), where the data-plane hub
judges them over every worker.
"""

from __future__ import annotations

from typing import Protocol


class OutcomeSink(Protocol):
    def record_outcome(self, scope: str, variant: str, code: str, served_ms: float | None,
                       randomly_assigned: bool = False) -> object:
        """One request of ``scope`` (``exp:<id>`` or ``canary:<route>``) answered ``code``
        (a grpc.StatusCode name); ``served_ms``: latency from when the model was ready
        (None: it never was)."""


class CanaryJudge(Protocol):
    def step(self) -> None:
        """Judge every running canary once (a control loop's pass)."""
