"""Demo model generators (the only code outside models that writes torch weights), and the
demo repository `mmctl up` serves when it is given no repository of the user's."""

from __future__ import annotations

import logging
from pathlib import Path

log = logging.getLogger(__name__)

# The demo's cust017 rollout variants have their place in the registry: versions of cust017
# (whose own folder is version 1), so a rollout reads "cust017 -> version 2"; each keeps its
# folder name as its concrete name.  (Here, not beside the generators: the control plane
# reads them at every start and imports torch only when it writes the demo.)
DEMO_VERSIONS = {"cust017-v2": ("cust017", 2), "cust017-v3": ("cust017", 3), "cust017-faulty": ("cust017", 4)}
# Written beside them: only a repository the demo wrote reads those folders as versions of
# cust017 (in anyone else's, a folder named cust017-v2 is a model of its own).
DEMO_MARKER = ".mms-demo"


def require_weights_writer() -> None:
    """InvalidInput, saying what to install, where torch or safetensors is missing: the
    control plane's own install (its container image) leaves them out, being code that only
    models and the demo's writer run."""
    import importlib.util

    missing = [name for name in ("torch", "safetensors") if importlib.util.find_spec(name) is None]
    if missing:
        from domain.errors import InvalidInput

        raise InvalidInput(
            f"writing the demo fleet needs {' and '.join(missing)}, which this install leaves "
            "out: pip install 'multimodel-serving[runtime]', or write it with the Triton image "
            "(docker/compose.yaml's fleet-init does), or give mmctl up --fleet-size 0")


def write_demo_repository(repository: Path, fleet_size: int, model_size_mb: float | None = None,
                          layout: str = "family") -> None:
    """The demo fleet (cust001..custNNN as one model family, or one Triton model each), its
    extras and the LoRA demo, each written only where missing."""
    require_weights_writer()
    from control_plane.demo.fleet import (
        demo_spec,
        generate_extras,
        generate_family_fleet,
        generate_fleet,
    )
    from control_plane.demo.lora import BASES, LoraDemoSpec, generate_lora_demo

    spec = demo_spec(fleet_size, model_size_mb)
    if layout == "family":
        written = generate_family_fleet(repository, spec) + generate_extras(repository, spec, family=True)
    else:
        written = generate_fleet(repository, spec) + generate_extras(repository, spec)
    if written:
        log.info("wrote %d demo models into %s", len(written), repository)
    if not all((repository / base).is_dir() for base in BASES):  # LoRA bases + demo adapters
        lora = generate_lora_demo(repository, LoraDemoSpec(adapters=4, instance_kind=spec.instance_kind))
        log.info("wrote LoRA bases %s with %d demo adapters each", ", ".join(lora), 4)
