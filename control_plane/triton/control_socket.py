"""The control plane's side of a model process's control socket
(``model_runtime.control_socket``): commands to a family or a LoRA model beside the
inference Triton runs."""

from __future__ import annotations

import asyncio
import contextlib
import json


class ControlSocket:
    """A connection to a family process's control socket (an abstract Unix socket,
    ``model_runtime.family.triton_model``): one command at a time, a JSON line each way."""

    def __init__(self, name: str):
        self.name = name
        self._lock = asyncio.Lock()
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None

    async def send(self, command: dict, timeout_s: float) -> dict:
        """The answer to ``command``.  Raises OSError/EOFError when the socket is gone (the
        connection is closed: the next send connects again), TimeoutError past ``timeout_s``."""
        async with self._lock:
            try:
                if self._writer is None:
                    self._reader, self._writer = await asyncio.open_unix_connection("\0" + self.name)
                self._writer.write(json.dumps(command).encode() + b"\n")
                await self._writer.drain()
                line = await asyncio.wait_for(self._reader.readline(), timeout_s)
                if not line.endswith(b"\n"):
                    raise EOFError("the family process closed its control socket")
                return json.loads(line)
            except BaseException:
                await self._close()
                raise

    async def close(self) -> None:
        async with self._lock:
            await self._close()

    async def _close(self) -> None:
        writer, self._reader, self._writer = self._writer, None, None
        if writer is not None:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()
