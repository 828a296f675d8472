"""LoRA adapters of the base models: add, list, pin/unpin, load/unload, remove.

A LoRA base (``model_repository/tinylm``, ``recommender_lora``) is an ordinary model folder in
Triton's repository whose config has an ``ADAPTER_CONTROL`` input.  Its adapters live in its
adapter directory (``<folder>/adapters/<name>/``, PEFT files); the model serves whatever is
there, loading adapters on demand.  This package is the control plane's side:

* **add** copies a PEFT adapter from a local folder or a cold-store URI into
  ``<adapter_dir>/.<name>.tmp``, validates it against the base's linear layers
  (``lora.read_adapter``: a malformed file or an adapter for another base is refused with the
  reason and nothing is left behind), publishes a local one to the default cold store (so it
  survives a wiped tmpfs repository), and renames it into place: the model never sees half an
  adapter.
* **durable state** is the ``adapters`` table in the control plane's SQLite (who added what,
  from where, sha256, pins) and the manifest the model reads (``lora.manifest``).  The table is
  the truth: ``recover()`` re-downloads adapters whose folder is gone and rewrites the pins.
* **confirmed operations** go to the model as a control inference (``TritonAdmin.
  adapter_control``): ``sync`` after a manifest change (answered once the pins are loaded),
  ``load``/``unload`` of one adapter, ``status`` for listing and metrics.  A control request
  reaches one model instance; the others follow the manifest within ``manifest_poll_s``.
* **metrics** (requests, cache hits/misses, load time per adapter) come from the model's status
  and are exposed on the control plane's registry by a collector; ``step()`` refreshes them
  for every loaded base, ``run_forever()`` repeats it.

Status polls are not use: after a poll the base model's Triton ``last_inference`` is marked as
seen so the eviction policy does not count the control plane's own requests.

Tiers in ``list``: ``gpu`` (a device slot of a model on a GPU; ``device`` on a CPU server),
``host``, ``loading``, ``cold`` (only in the adapter directory), ``refused``, ``disabled``,
``missing`` (registered, folder gone, not restorable yet).

Modules: ``base`` (adapter names, which models are LoRA bases), ``rows`` (the merged
``list`` rows), ``adapter_table`` (the SQLite table), ``metrics`` (Prometheus), ``files`` (staging,
restoring and the manifest: blocking file work), ``manager`` (``AdapterManager``, the
operations themselves).
"""

from control_plane.adapters.adapter_table import AdapterStore
from control_plane.adapters.base import (
    CONFIG_FILE,
    CONTROL_INPUT,
    DEFAULT_ADAPTER_DIR,
    DEFAULT_MAX_RANK,
    LABEL_SEPARATOR,
    PEFT_FILES,
    WEIGHTS_FILE,
    LoraBase,
    adapter_name,
    describe_base,
    parse_adapter_ref,
    parse_model_config,
)
from control_plane.adapters.files import AdapterFiles, StagedAdapter, hand_slots_to_control_plane
from control_plane.adapters.manager import AdapterManager
from control_plane.adapters.metrics import AdapterMetrics
from control_plane.adapters.rows import _peft_summary, merge_rows, public_tier

__all__ = [
    "CONFIG_FILE",
    "CONTROL_INPUT",
    "DEFAULT_ADAPTER_DIR",
    "DEFAULT_MAX_RANK",
    "LABEL_SEPARATOR",
    "PEFT_FILES",
    "WEIGHTS_FILE",
    "AdapterFiles",
    "AdapterManager",
    "AdapterMetrics",
    "AdapterStore",
    "LoraBase",
    "StagedAdapter",
    "_peft_summary",
    "adapter_name",
    "describe_base",
    "hand_slots_to_control_plane",
    "merge_rows",
    "parse_adapter_ref",
    "parse_model_config",
    "public_tier",
]
