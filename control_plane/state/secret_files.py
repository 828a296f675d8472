"""Secrets kept in the state directory: owner-only files that a restart reads back.

The admin token (``admin.token``) and the key that opens Triton's restricted APIs
(``triton.key``) live here, so that mmctl on this machine, a control plane restarted on the
same state directory and the Tritons it adopts keep working without the secret being given
again.  A file readable by other users is not trusted: a new secret replaces it.
"""

from __future__ import annotations

import logging
import os
import secrets
from pathlib import Path

log = logging.getLogger(__name__)

STATE_DIR_MODE = 0o700


def ensure_private_dir(path: Path) -> Path:
    """``path`` created owner-only (0700) when missing.  An existing directory keeps its mode
    (an operator may share it on purpose) but a warning says when others may read it."""
    path.mkdir(parents=True, exist_ok=True, mode=STATE_DIR_MODE)
    mode = path.stat().st_mode & 0o777
    if mode & 0o077:
        log.warning("the state directory %s is open to other users (mode %o): it holds the "
                    "state database and its secret files are owner-only, but `chmod 700 %s` "
                    "keeps the rest private too", path, mode, path)
    return path


def ensure_secret_file(path: Path, given: str | None = None, what: str = "secret") -> str:
    """The secret kept in ``path`` with mode 0600.

    ``given`` (from a flag or the environment): written there.  Otherwise the file's secret is
    reused, so clients keep working across restarts (delete the file to rotate it), unless the
    file is empty or readable by others; then a new one is generated.
    """
    if given is None and path.is_file():
        mode = path.stat().st_mode & 0o777
        existing = path.read_text().strip()
        if existing and not mode & 0o077:
            return existing
        if existing:
            log.warning("%s was readable by other users (mode %o); generating a new %s",
                        path, mode, what)
    value = given or secrets.token_urlsafe(32)
    path.parent.mkdir(parents=True, exist_ok=True, mode=STATE_DIR_MODE)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        os.fchmod(f.fileno(), 0o600)  # O_CREAT's mode does not apply to an existing file
        f.write(value + "\n")
    return value
