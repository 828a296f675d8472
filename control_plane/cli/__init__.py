"""``mmctl``: one click group per resource, one API client."""

from control_plane.cli.main import cli, main

__all__ = ["cli", "main"]
