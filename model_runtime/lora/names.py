"""Adapter-name validation: a name becomes a directory under the adapter root, so only a
conservative alphabet passes (the same rules as model names in ``domain.names``)."""

import re

from .errors import InvalidAdapterName

MAX_NAME_LENGTH = 128
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]*$")


def validate_adapter_name(name: object) -> str:
    """Return ``name`` if it is a safe adapter name, else raise InvalidAdapterName saying why."""
    if not isinstance(name, str) or not name:
        raise InvalidAdapterName("adapter name must be a non-empty string")
    if len(name) > MAX_NAME_LENGTH:
        raise InvalidAdapterName(
            f"adapter name is {len(name)} characters; the limit is {MAX_NAME_LENGTH}"
        )
    if ".." in name or not _NAME_RE.fullmatch(name):
        raise InvalidAdapterName(
            f"adapter name {name!r} is invalid: use letters, digits, '_', '-' and '.', starting "
            "with a letter or digit (no '..', '/', whitespace or shell metacharacters)"
        )
    return name
