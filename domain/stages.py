"""Rollout stages of a registry version and SLA classes: names the registry, placement and
the command line share (the command line imports them without the registry)."""

STAGES = ("registered", "shadow", "canary", "production", "retired")
SLA_CLASSES = ("gold", "silver", "bronze")
DEFAULT_SLA = "silver"
