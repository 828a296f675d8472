"""The model registry: versions, artifacts, metadata and rollout stage, in the state SQLite.

A *logical* model (``cust017``) has numbered versions; each version is deployed to Triton
under a *concrete* name, the folder name in Triton's repository: ``<model>.v<version>``
(``cust017.v3``) unless the version was registered with its own (the demo fleet's folders
``cust017`` and ``cust017-v2`` are versions 1 and 2 of ``cust017``).  Clients and ``mmctl``
may use either name: a logical name means its production version (``resolve_name``).

A version's artifact lives in a cold store (``s3://``, ``file://``) and is staged into the
warm tier on demand, or it *is* a folder of Triton's repository (``repository://<folder>/``:
the demo fleet and the models found in a user's ``--repository``, registered at start by
``register_repository``), served as it is and never evicted from warm.  Each version
records its artifact (URI, folder sha256, bytes), the measured memory footprint once loaded, the training-data fingerprint, validation metrics, SLA class,
tenant, and its rollout stage:

    registered -> shadow -> canary -> production -> retired   (any order is allowed)

Every stage change is a row in ``registry_history`` with who made it and when.  A logical
model has at most one ``production`` version, the one it serves by default: promoting
another version to production retires the previous one (recorded in the history too).

Stage feeds the cache: ``stage_priority(concrete name)`` is the eviction priority (shadow
before canary before production, see eviction.STAGE_PRIORITY); pins still win over all.

Writes happen on the event-loop thread, like StateStore's.  Tables live in the same SQLite
file as the rest of the control plane's state (``StateStore.db``).

Modules: ``versions`` (a version, its names and stage changes), ``registered_versions``
(``Registry``, the tables and their migrations), ``artifacts`` (checking and registering a
cold-store artifact), ``repository`` (registering the folders of Triton's repository),
``priorities`` (stage as the eviction priority of loaded models).
"""

from control_plane.registry.artifacts import (
    check_model_config,
    check_model_folder,
    register_version,
)
from control_plane.registry.priorities import apply_stage_priorities, resident_priority_updater
from control_plane.registry.registered_versions import Registry
from control_plane.registry.repository import (
    FoundFolder,
    add_repository_versions,
    collect_repository,
    register_repository,
)
from control_plane.registry.versions import (
    DEFAULT_SLA,
    REPOSITORY_SCHEME,
    SLA_CLASSES,
    STAGES,
    ModelVersion,
    StageChange,
    concrete_name,
    parse_concrete,
    parse_metrics,
    repository_uri,
)

__all__ = [
    "DEFAULT_SLA",
    "REPOSITORY_SCHEME",
    "SLA_CLASSES",
    "STAGES",
    "FoundFolder",
    "ModelVersion",
    "Registry",
    "StageChange",
    "add_repository_versions",
    "apply_stage_priorities",
    "check_model_config",
    "check_model_folder",
    "collect_repository",
    "concrete_name",
    "parse_concrete",
    "parse_metrics",
    "register_repository",
    "register_version",
    "repository_uri",
    "resident_priority_updater",
]
