"""`make up-docker`: a compose stack in the foreground, removed when it stops.

    python docker/compose_up.py podman-compose -f docker/compose.yaml

runs ``COMPOSE up``; Ctrl-C (or SIGTERM, or the stack ending on its own) is followed by
``COMPOSE down``, and this process exits only once ``down`` has finished, so the prompt
comes back with no container left (the volumes stay).  A shell's EXIT trap cannot promise
that: a shell killed by the terminal's SIGINT runs no trap, and make returns as soon as its
shell is gone.  Standard library only: it runs before anything else is installed.
"""

from __future__ import annotations

import signal
import subprocess
import sys


def main(argv: list[str]) -> int:
    if not argv or argv[0].startswith("-"):
        print("usage: compose_up.py COMPOSE [ARGS...]   (e.g. podman-compose -f docker/compose.yaml)",
              file=sys.stderr)
        return 2
    stopping: list[int] = []
    up: subprocess.Popen | None = None

    def on_signal(signum, _frame):
        # The terminal's Ctrl-C reaches `up` itself (same process group); a SIGTERM sent to
        # this process alone is passed on.
        if not stopping and signum == signal.SIGTERM and up is not None and up.poll() is None:
            up.send_signal(signal.SIGTERM)
        stopping.append(signum)

    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, on_signal)
    up = subprocess.Popen([*argv, "up"])
    code = up.wait()
    # Nothing interrupts the removal (a second Ctrl-C would leave containers behind): `down`
    # inherits the ignored signals.
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, signal.SIG_IGN)
    print("removing the stack's containers (compose down)...", flush=True)
    down = subprocess.run([*argv, "down"], check=False)
    if down.returncode != 0:
        print(f"compose down failed ({down.returncode}): see above", file=sys.stderr)
        return down.returncode
    return 128 + stopping[0] if stopping else code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
