"""A registered version and its names: the concrete name Triton serves it under, its
artifact URI when it is a folder of Triton's repository, its stage history entries.  Pure."""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field

from domain.errors import InvalidInput
from domain.names import validate_model_name
from domain.stages import DEFAULT_SLA, SLA_CLASSES, STAGES  # noqa: F401  (the registry's names)

_CONCRETE_RE = re.compile(r"^(?P<model>.+)\.v(?P<version>[0-9]+)$")
# Artifacts that are folders of Triton's repository itself (no cold copy).
REPOSITORY_SCHEME = "repository"


def concrete_name(model: str, version: int) -> str:
    """The Triton model name of one version: ``cust017.v3``."""
    return validate_model_name(f"{model}.v{int(version)}")


def repository_uri(folder: str) -> str:
    """The artifact URI of a version that is the repository folder ``folder`` itself."""
    return f"{REPOSITORY_SCHEME}://{validate_model_name(folder)}/"


def parse_concrete(name: str) -> tuple[str, int] | None:
    """``cust017.v3`` -> (``cust017``, 3); None for a name without a ``.v<N>`` suffix."""
    m = _CONCRETE_RE.match(name)
    if m is None:
        return None
    return m.group("model"), int(m.group("version"))


@dataclass(frozen=True)
class ModelVersion:
    model: str
    version: int
    artifact_uri: str
    sha256: str
    size_bytes: int
    sla: str = DEFAULT_SLA
    stage: str = "registered"
    memory_bytes: int | None = None
    data_fingerprint: str | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    tenant: str | None = None
    created_at: float = 0.0
    created_by: str = ""
    stage_changed_at: float = 0.0
    stage_changed_by: str = ""
    triton_name: str | None = None  # None: the default <model>.v<version>
    # False: the control plane sends no synthetic warm-up request after a load (a model
    # whose own inputs reject zeros); Triton still runs the config's model_warmup.
    synthetic_warmup: bool = True
    # The model family this version is a variant of: its weights go into a slot of that
    # family's Triton model instead of a Triton model of its own.  None: its own model.
    family: str | None = None

    @property
    def name(self) -> str:
        """The concrete name: Triton's model name and the folder in its repository."""
        return self.triton_name or concrete_name(self.model, self.version)

    @property
    def in_repository(self) -> bool:
        """True when the artifact is a folder of Triton's repository (no cold copy)."""
        return self.artifact_uri.startswith(REPOSITORY_SCHEME + "://")

    def to_dict(self) -> dict:
        d = asdict(self)
        d["name"] = self.name
        return d


@dataclass(frozen=True)
class StageChange:
    model: str
    version: int
    from_stage: str | None
    to_stage: str
    who: str
    at: float
    note: str | None = None

    def to_dict(self) -> dict:
        return asdict(self)


def _validate_who(who: str) -> str:
    if not isinstance(who, str) or not who.strip() or len(who) > 200:
        raise InvalidInput("say who made the change (1-200 characters), e.g. --who alice")
    return who.strip()


def parse_metrics(items: Iterable[str]) -> dict[str, float]:
    """``["auc=0.781", "ndcg=0.4"]`` -> ``{"auc": 0.781, "ndcg": 0.4}``."""
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        try:
            if not sep or not key.strip():
                raise ValueError
            out[key.strip()] = float(value)
        except ValueError:
            raise InvalidInput(f"metric {item!r} must look like name=number, e.g. auc=0.781") from None
    return out
