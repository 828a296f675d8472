"""Writing family and variant folders, and checking a variant's weights against its family
before anything is registered or copied.

A family folder is a Triton model folder the product completes: the family's own
config.pbtxt with the status output added and one instance, ``1/model.py`` (the family's
code), ``family.json`` (the slot layout, read from the base weights) and
``1/_mms_family/`` (a copy of ``model_runtime.family``).  A variant folder holds
``weights.safetensors`` (written by safetensors' ``save_file``, so its data section has the
family's layout) and ``variant.json``.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Mapping
from pathlib import Path

from tritonclient.grpc import model_config_pb2

from control_plane.families.family_catalog import VARIANT_FILE, WEIGHTS_FILE, Family
from domain import model_config
from domain.errors import InvalidInput
from domain.names import validate_model_name
from model_runtime import copy_runtime, refresh_runtime
from model_runtime.family.layout import Layout, LayoutError, read_layout
from model_runtime.family.protocol import LAYOUT_FILE, STATUS_OUTPUT

RUNTIME_DIR = Path(__file__).resolve().parents[2] / "model_runtime" / "family"
RUNTIME_PACKAGE = "_mms_family"

__all__ = ["VARIANT_FILE", "WEIGHTS_FILE", "check_variant_weights", "layout_of",
           "refresh_family_runtime", "write_family", "write_variant"]


def layout_of(weights: Path) -> Layout:
    """The layout of a safetensors file; InvalidInput saying what is wrong with it."""
    try:
        return read_layout(weights)[0]
    except LayoutError as exc:
        raise InvalidInput(str(exc)) from None


def check_variant_weights(family: Family, weights: Path, variant: str) -> Layout:
    """Refuse weights whose tensors, shapes or dtypes are not the family's (InvalidInput
    naming each difference); nothing is written before this passes."""
    layout = layout_of(weights)
    why = family.layout.mismatch(layout)
    if why is not None:
        raise InvalidInput(f"{variant}'s weights {weights} do not match family {family.name}: "
                           f"{why}; a variant has exactly the family's tensors")
    return layout


def _replace_folder(tmp: Path, final: Path) -> Path:
    if final.exists():
        shutil.rmtree(final)
    tmp.rename(final)
    return final


def _fresh(tmp: Path) -> Path:
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    return tmp


def family_config(config_text: str, name: str) -> str:
    """The family's config.pbtxt with its name, one instance, and the status output the
    control plane reads its slots through."""
    config = model_config.parse_config(config_text)
    model_config.set_name(config, name)
    if not any(o.name == STATUS_OUTPUT for o in config.output):
        status = config.output.add()
        status.name = STATUS_OUTPUT
        status.data_type = model_config_pb2.DataType.Value("TYPE_STRING")
        status.dims.append(1)
    if not config.instance_group:
        config.instance_group.add()
    for group in config.instance_group:
        group.count = 1
    del config.instance_group[1:]
    return model_config.render_config(config)


def write_family(repository: Path, name: str, *, config_text: str, version_files: Path,
                 base_weights: Path) -> Family:
    """Write the family folder ``repository/name`` atomically.  ``version_files``: the
    family's version folder (``1/`` with model.py); ``base_weights``: any variant's weights,
    whose layout every variant must have."""
    validate_model_name(name)
    layout = layout_of(base_weights)
    if not layout.tensors:
        raise InvalidInput(f"{base_weights} holds no tensors; a family needs its weights' layout")
    if not (version_files / "model.py").is_file():
        raise InvalidInput(f"{version_files} has no model.py; a family's code is a python-backend "
                           "model.py that subclasses _mms_family.FamilyModel")
    text = family_config(config_text, name)
    tmp = _fresh(repository / f".{name}.tmp")
    shutil.copytree(version_files, tmp / "1", ignore=shutil.ignore_patterns("__pycache__", "*.safetensors"))
    copy_runtime(RUNTIME_DIR, tmp / "1" / RUNTIME_PACKAGE)
    (tmp / "config.pbtxt").write_text(text)
    (tmp / LAYOUT_FILE).write_text(json.dumps(layout.to_json(), indent=1))
    folder = _replace_folder(tmp, repository / name)
    return Family(name, layout, folder)


def refresh_family_runtime(family: Family) -> bool:
    """Replace each version folder's copy of the family runtime (``<version>/_mms_family``)
    with this product's where they differ: a family written by an earlier version runs this
    version's fills (and talks the control plane's protocol) from its next load.  True when
    one was replaced."""
    replaced = False
    for version in family.folder.iterdir():
        if version.is_dir() and version.name.isdigit():
            replaced = refresh_runtime(RUNTIME_DIR, version / RUNTIME_PACKAGE) or replaced
    return replaced


def write_variant(parent: Path, name: str, family: str, weights: Mapping | Path) -> Path:
    """Write the variant folder ``parent/name``: ``weights`` (tensors, saved with
    safetensors' save_file, or a safetensors file, copied) and ``variant.json``."""
    validate_model_name(name)
    tmp = _fresh(parent / f".{name}.tmp")
    if isinstance(weights, Path):
        shutil.copyfile(weights, tmp / WEIGHTS_FILE)
    else:
        from safetensors.torch import save_file

        save_file(dict(weights), str(tmp / WEIGHTS_FILE))
    (tmp / VARIANT_FILE).write_text(json.dumps({"family": family}))
    return _replace_folder(tmp, parent / name)
