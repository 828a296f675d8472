"""Debian packages that tests drive for real: ``chromium`` (the status page in a browser),
``prometheus`` (with ``promtool``: a real Prometheus scrapes a running stack), ``podman``,
``runc`` and ``debootstrap`` (the images built and served from containers).

They are installed when missing: ``make test`` runs this module before pytest (``python -m
tests.system_packages``) and the tests call ``require`` again, which costs nothing once
they are there.  Installing needs apt-get and root, as on CI; without them the tests fail
with the command to run, never skip.  Nothing is downloaded but Debian's packages: the
browser is Debian's chromium (playwright is only its driver here).
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
from pathlib import Path

# package -> the files a test runs
PACKAGES = {"chromium": ("/usr/bin/chromium",),
            "prometheus": ("/usr/bin/prometheus", "/usr/bin/promtool"),
            # The container suite (tests/containers): images built and compose run with
            # podman on runc, the base image made by debootstrap where no registry answers.
            "podman": ("/usr/bin/podman",),
            "runc": ("/usr/sbin/runc",),
            # kube play's pause container (a recommendation of podman, not a dependency).
            "catatonit": ("/usr/bin/catatonit",),
            # Names between pods and between compose services, internal networks included
            # (docker/podman/containers.conf picks netavark; CNI resolves none there).
            "netavark": ("/usr/lib/podman/netavark",),
            "aardvark-dns": ("/usr/lib/podman/aardvark-dns",),
            # netavark sets up each network's NAT and forwarding with iptables (a bare
            # machine has none: every build step and container failed to get a network).
            "iptables": ("/usr/sbin/iptables",),
            "debootstrap": ("/usr/sbin/debootstrap",)}
LOCK = Path("/tmp/mms-system-packages.lock")
APT_TIMEOUT_S = 600


class PackagesMissing(RuntimeError):
    pass


def missing(names) -> list[str]:
    return [n for n in names if not all(os.access(f, os.X_OK) for f in PACKAGES[n])]


def _command(names) -> str:
    return "apt-get update && apt-get install -y --no-install-recommends " + " ".join(names)


def _apt(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    return subprocess.run(["apt-get", *args], capture_output=True, text=True, env=env,
                          timeout=APT_TIMEOUT_S, check=False)


def ensure(*names: str) -> None:
    """Install the Debian packages ``names`` (default: all) that are missing; raise
    ``PackagesMissing`` saying what to run when that is not possible here."""
    names = names or tuple(PACKAGES)
    need = missing(names)
    if not need:
        return
    if shutil.which("apt-get") is None:
        raise PackagesMissing(f"these tests need Debian's {', '.join(need)} and this machine has "
                              f"no apt-get: install them (on Debian/Ubuntu: {_command(need)})")
    if os.geteuid() != 0:
        raise PackagesMissing(f"these tests need Debian's {', '.join(need)}, not installed; "
                              f"installing needs root: sudo sh -c '{_command(need)}'")
    with open(LOCK, "w") as lock:  # one installer at a time
        fcntl.flock(lock, fcntl.LOCK_EX)
        need = missing(names)
        if not need:
            return
        done = _apt("update")
        if done.returncode == 0:
            done = _apt("install", "-y", "--no-install-recommends", *need)
        if done.returncode != 0 or missing(need):
            raise PackagesMissing(f"installing Debian's {', '.join(need)} failed ({_command(need)}):"
                                  f"\n{done.stdout[-2000:]}{done.stderr[-2000:]}")


def require(*names: str) -> None:
    """``ensure`` for a test: a failure (not a skip) with the message."""
    import pytest

    try:
        ensure(*names)
    except PackagesMissing as exc:
        pytest.fail(str(exc), pytrace=False)


if __name__ == "__main__":
    try:
        ensure(*sys.argv[1:])
    except PackagesMissing as exc:
        print(f"tests/system_packages.py: {exc}", file=sys.stderr)
        sys.exit(1)
