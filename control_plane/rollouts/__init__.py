"""Rollout judgement, on the control plane: the per-variant statistics of experiments and
canaries (``stats``) and the canary analysis that advances, promotes or rolls back a canary
on them (``canary``).

The router only routes by the route table and hands each outcome on: an in-process router
to the ``StatsBook`` the service gives it, a router worker to the data-plane hub in its
reports (``control_plane.admin.dataplane``).  The router never imports this package (an
import contract in pyproject.toml)."""
