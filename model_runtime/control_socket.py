"""A model process's control socket: control commands from the control plane beside the
inference Triton runs, instead of as requests in Triton's queue.

An abstract Unix socket of the process (it has no file, so nothing is left behind when the
process dies), open to processes of the same user only (checked with ``SO_PEERCRED``: an
abstract socket has no file permissions), one JSON command per line each way, each line at
most ``MAX_COMMAND_BYTES``, at most ``MAX_CONNECTIONS`` connections, an idle one closed after
``IDLE_S``.  What a command may do is the model's to check (``handle``): the families and the
LoRA models take commands that carry the key the control plane keeps in Triton's repository
(``read_control_key``).

Plain standard library: each runtime that serves one (``model_runtime.family``,
``model_runtime.lora``) carries a copy of this file when it is copied into a model folder.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import struct
import threading
from collections.abc import Callable

log = logging.getLogger(__name__)

# In Triton's repository (beside the model folders), readable by its owner only: the key
# every command on a control socket carries.  A dot file: Triton never lists it as a model.
CONTROL_KEY_FILE = ".mms-family-key"
# A command is one JSON line of at most this many bytes: the work a caller causes is bounded.
MAX_COMMAND_BYTES = 64 * 1024
# Connections served at once, and how long an idle one is kept.
MAX_CONNECTIONS = 4
IDLE_S = 300.0


def read_control_key(repository: str) -> str | None:
    """The control key in Triton's repository, or None (every keyed command refused) when the
    file is missing or other users may read it: a key anyone can read opens the model to
    anyone."""
    try:
        fd = os.open(os.path.join(repository, CONTROL_KEY_FILE), os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return None
    with os.fdopen(fd) as f:
        if os.fstat(fd).st_mode & 0o077:
            return None
        return f.read().strip() or None


class ControlSocketServer:
    """Serves ``handle(line) -> answer`` (a JSON-able dict; a refusal is an answer with
    ``error`` and ``code``) on the abstract Unix socket ``name``, each connection on a thread
    of its own.  ``name`` is None when no socket could be opened (commands then come as
    requests only)."""

    def __init__(self, name: str, handle: Callable[[str], dict], what: str = "model"):
        self.handle = handle
        self.what = what
        self._lock = threading.Lock()
        self._open: set[socket.socket] = set()  # shut by close: no command after it
        self._connections = threading.BoundedSemaphore(MAX_CONNECTIONS)
        try:
            listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            listener.bind("\0" + name)
            listener.listen(MAX_CONNECTIONS)
        except OSError as exc:
            log.warning("%s: no control socket (%s); control commands come as requests", what, exc)
            self.name = None
            self._listener = None
            return
        self.name = name
        self._listener = listener
        self._acceptor = threading.Thread(target=self._accept, name=f"{what}-control", daemon=True)
        self._acceptor.start()

    def _accept(self) -> None:
        listener = self._listener
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return  # closed by close()
            _pid, uid, _gid = struct.unpack("3i", conn.getsockopt(
                socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
            if uid != os.getuid() or not self._connections.acquire(blocking=False):
                conn.close()
                continue
            with self._lock:
                self._open.add(conn)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            conn.settimeout(IDLE_S)
            with conn, conn.makefile("rwb") as stream:
                while True:
                    line = stream.readline(MAX_COMMAND_BYTES + 1)
                    if not line:
                        return
                    if len(line) > MAX_COMMAND_BYTES or not line.endswith(b"\n"):
                        stream.write(json.dumps({"error": "control command too long", "code":
                                                 "INVALID_ARG"}).encode() + b"\n")
                        stream.flush()
                        return
                    answer = self.handle(line.decode("utf-8", "replace"))
                    stream.write(json.dumps(answer).encode() + b"\n")
                    stream.flush()
        except OSError:
            return  # the caller went away or stayed idle
        finally:
            with self._lock:
                self._open.discard(conn)
            self._connections.release()

    def close(self) -> None:
        """Stop accepting and shut the open connections (a command running now finishes)."""
        listener = self._listener
        if listener is None:
            return
        self._listener = None
        with contextlib.suppress(OSError):
            listener.shutdown(socket.SHUT_RDWR)
        listener.close()
        self._acceptor.join(5)  # the name is free once it stopped accepting
        with self._lock:
            for conn in self._open:
                with contextlib.suppress(OSError):
                    conn.shutdown(socket.SHUT_RDWR)
