"""``mmctl``: one click group per resource, one API client."""

from mmctl.main import cli, main

__all__ = ["cli", "main"]
