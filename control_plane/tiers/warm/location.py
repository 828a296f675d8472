"""Where the warm tier lives: tmpfs or the state directory, the staging folder on the
repository's filesystem, and removing the default tmpfs tier at a clean stop.

Budget note: under /dev/shm the warm tier shares tmpfs with Triton's python-backend
shared-memory regions; leave headroom beyond ``budget_bytes``.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import shutil
from pathlib import Path

log = logging.getLogger(__package__)  # one logger name for the whole package


def default_warm_repository(state_dir: Path, budget_bytes: int | None = None,
                            shm: Path = Path("/dev/shm")) -> Path:
    """tmpfs (``/dev/shm/mms-<uid>-<hash of state dir>/repository``) when it exists, is
    writable and has room for the budget; else ``<state_dir>/warm/repository`` on disk."""
    try:
        usable = shm.is_dir() and os.access(shm, os.W_OK)
        if usable and budget_bytes is not None:
            st = os.statvfs(shm)
            usable = st.f_bavail * st.f_frsize >= budget_bytes
            if not usable:
                log.warning("%s has less free space than the warm budget (%d bytes); the warm "
                            "tier goes to the state directory on disk instead", shm, budget_bytes)
    except OSError:
        usable = False
    if usable:
        return tmpfs_warm_root(state_dir, shm) / "repository"
    return state_dir.resolve() / "warm" / "repository"


def tmpfs_warm_root(state_dir: Path, shm: Path = Path("/dev/shm")) -> Path:
    """The tmpfs folder of ``state_dir``'s default warm tier (repository + staging).  The
    Makefile's ``clean-warm`` computes the same name: sha256 of the resolved path, 12 hex."""
    key = hashlib.sha256(str(state_dir.resolve()).encode()).hexdigest()[:12]
    return shm / f"mms-{os.getuid()}-{key}"


def remove_tmpfs_warm_tier(state_dir: Path, repository: Path, shm: Path = Path("/dev/shm")) -> bool:
    """Delete ``repository`` and its staging folder if they are ``state_dir``'s default warm
    tier in tmpfs; a repository anywhere else (the user's --repository, the on-disk
    fallback) is never touched.  tmpfs is host RAM that nothing frees: with 850 MB models a
    stopped control plane would hold gigabytes.  Everything in it comes back on the next
    start (staged copies from the cold store, demo models from their generator).  Blocking:
    call it off the event loop."""
    root = tmpfs_warm_root(state_dir, shm)
    if repository.resolve().parent != root or not root.is_dir():
        return False
    shutil.rmtree(root, ignore_errors=True)
    log.info("removed the warm tier %s (host RAM)", root)
    return not root.exists()


STAGING_DIR_NAME = ".mms-staging"  # hidden: never a model name (those start alphanumeric)


def _device(path: Path) -> int:
    return os.stat(path).st_dev


def staging_dir_for(repository: Path) -> Path:
    """Where downloads wait for their one ``rename`` into ``repository``: on its filesystem,
    or the rename fails with EXDEV.  A sibling folder when that is the same filesystem (it
    stays out of Triton's repository index); when the repository is a mount point of its own
    (a docker volume), a hidden folder inside it."""
    sibling = repository.with_name(repository.name + ".staging")
    try:
        sibling.mkdir(parents=True, exist_ok=True)
        if _device(sibling) == _device(repository):
            return sibling
        with contextlib.suppress(OSError):
            sibling.rmdir()  # only if empty: it is not ours to clear
    except OSError:  # e.g. the repository's parent is read-only
        pass
    inside = repository / STAGING_DIR_NAME
    inside.mkdir(exist_ok=True)
    log.info("staging downloads in %s: %s is on another filesystem than %s", inside, sibling, repository)
    return inside


def folder_bytes(root: Path) -> int:
    total = 0
    for dirpath, _dirs, files in os.walk(root):
        for fn in files:
            with contextlib.suppress(OSError):
                total += (Path(dirpath) / fn).lstat().st_size
    return total
