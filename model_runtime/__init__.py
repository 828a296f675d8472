"""Code that runs inside Triton's python-backend stubs, not in the control plane.

``model_runtime.family``: the model-family runtime (fixed-size weight slots shared by the
fine-tuned variants of one architecture).  ``model_runtime.lora``: the LoRA runtime (many
adapters on one base model), copied into each LoRA base model as ``<version>/_lora``
(``control_plane.demo.lora`` writes it).  A family's model folder gets a copy of that
package as ``<version>/_mms_family`` (``control_plane.families.folders`` writes it), so a
Triton model folder stays self-contained; this package therefore imports nothing from the
control plane or the router.
"""

import os
import shutil
from pathlib import Path

# Modules of this folder that a runtime imports beside its own (``control_socket``): a copy
# of the runtime in a model folder carries them inside the package.
SHARED_MODULES = (Path(__file__).resolve().parent / "control_socket.py",)


def copy_runtime(package: Path, destination: Path) -> None:
    """Copy the runtime ``package`` (``model_runtime/family`` or ``model_runtime/lora``) to
    ``destination`` in a model folder, with the shared modules it imports beside its own."""
    shutil.copytree(package, destination, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    for module in SHARED_MODULES:
        shutil.copy2(module, destination / module.name)


def refresh_runtime(package: Path, copy: Path) -> bool:
    """Replace ``copy``, a model folder's copy of the runtime ``package``, with this version's
    when their modules differ (a folder written by an earlier version follows this one's
    control plane from its next load); True when it was replaced.  A folder without such a
    copy (a model with its own code) is left alone.  The copy is swapped by renames: a load
    reading the folder meanwhile finds the old copy or the new one."""
    if not (copy / "__init__.py").is_file():
        return False
    wanted = {f.name: f for f in package.glob("*.py")} | {m.name: m for m in SHARED_MODULES}
    present = {f.name for f in copy.glob("*.py")}
    if present == set(wanted) and all(
            (copy / name).read_bytes() == source.read_bytes() for name, source in wanted.items()):
        return False
    fresh, old = copy.with_name(f".{copy.name}.new"), copy.with_name(f".{copy.name}.old")
    for leftover in (fresh, old):
        if leftover.exists():
            shutil.rmtree(leftover)
    copy_runtime(package, fresh)
    os.rename(copy, old)
    os.rename(fresh, copy)
    shutil.rmtree(old)
    return True
