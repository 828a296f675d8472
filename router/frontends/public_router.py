"""What the public ports use of the assembled router (``router.assembly.Router``): the front
ends are built over this surface, so they import nothing of the assembly that builds them
(the assembly imports the front ends)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from router.frontends.grpc_inference import Forwarder
    from router.frontends.shared_memory import SystemSharedMemory
    from router.rollouts.routing_decisions import Decider
    from router.serving.inference_pipeline import InferencePipeline
    from router.serving.metrics import RouterMetrics
    from router.serving.readiness_and_metadata import Answers
    from router.serving.router_config import RouterConfig
    from router.serving.serving_state import ServingState


class PublicRouter(Protocol):
    """The collaborators a front end calls (each owns its calls: see router.assembly)."""

    config: RouterConfig
    answers: Answers
    metrics: RouterMetrics
    state: ServingState
    decider: Decider
    pipeline: InferencePipeline
    forwarder: Forwarder
    shared_memory: SystemSharedMemory
