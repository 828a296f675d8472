"""Model-name validation: names reach Triton's repository and the filesystem, so only a
conservative alphabet passes (model control is remote code execution)."""

import re

from domain.errors import InvalidModelName

MAX_NAME_LENGTH = 128
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]*")


def validate_model_name(name: object) -> str:
    """Return ``name`` if it is a safe model name, else raise InvalidModelName saying why."""
    if not isinstance(name, str) or not name:
        raise InvalidModelName("model name must be a non-empty string")
    if len(name) > MAX_NAME_LENGTH:
        raise InvalidModelName(
            f"model name is {len(name)} characters; the limit is {MAX_NAME_LENGTH}"
        )
    if ".." in name:
        raise InvalidModelName(f"model name {name!r} contains '..'; use letters, digits, '_', '-', '.'")
    if not _NAME_RE.fullmatch(name):
        raise InvalidModelName(
            f"model name {name!r} is invalid: use letters, digits, '_', '-' and '.', "
            "starting with a letter or digit (no '/', whitespace or shell metacharacters)"
        )
    return name
