"""``mmctl``: one click group per resource, one API client (``mmctl.main``: the command line's
root group, ``cli``, and its entry point, ``main``)."""
