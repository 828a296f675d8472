"""Secrets kept in the state directory: owner-only files that a restart reads back.

The admin token (``admin.token``) and the key that opens Triton's restricted APIs
(``triton.key``) live here, so that mmctl on this machine, a control plane restarted on the
same state directory and the Tritons it adopts keep working without the secret being given
again.  A file readable by other users is not trusted: a new secret replaces it, written
to a new file, so a descriptor opened on the old one never reads the new secret.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import tempfile
from pathlib import Path

from domain.errors import InvalidInput

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


def ensure_secret_file(path: Path, given: str | None = None, what: str = "secret",
                       min_chars: int = 0, setting: str | None = None) -> str:
    """The secret kept in ``path`` with mode 0600.

    ``given`` (from a flag or the environment): written there.  Otherwise the file's secret is
    reused, so clients keep working across restarts (delete the file to rotate it), unless the
    file is empty or readable by others; then a new one is generated.  ``min_chars``: a given
    or reused secret shorter than that (one set by hand) raises InvalidInput, which names
    ``setting`` and the file, never the secret.
    """
    if given:
        _check_length(given, min_chars, f"the {what} given ({setting or 'by hand'})",
                      "or leave it unset for a generated one")
    if given is None and path.is_file():
        mode = path.stat().st_mode & 0o777
        existing = path.read_text().strip()
        if existing and not mode & 0o077:
            _check_length(existing, min_chars, f"the {what} in {path}",
                          "write a longer one there, or delete the file for a generated one")
            return existing
        if existing:
            log.warning("%s was readable by other users (mode %o); generating a new %s",
                        path, mode, what)
    value = given or secrets.token_urlsafe(32)
    path.parent.mkdir(parents=True, exist_ok=True, mode=STATE_DIR_MODE)
    _replace_file(path, value + "\n")
    return value


def _check_length(secret: str, min_chars: int, which: str, remedy: str) -> None:
    """A secret set by hand that is too short to resist guessing: refused at start (its
    length is said, never the secret)."""
    if len(secret) < min_chars:
        raise InvalidInput(f"{which} has {len(secret)} characters; use at least {min_chars} "
                           f"(a generated one has 43), {remedy}")


def _replace_file(path: Path, text: str) -> None:
    """``text`` in a new owner-only file renamed over ``path``.  Never rewritten in place: a
    descriptor opened on the old file (while it was readable by others, say) keeps reading
    the old inode's bytes, never the new secret; a symlink at ``path`` is replaced, not
    followed.  On failure the temporary file is removed and ``path`` is left as it was."""
    fd, temp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            os.fchmod(f.fileno(), 0o600)  # mkstemp makes it 0600; say so where it matters
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temp)
        raise
