"""The control plane's side of a model process's control socket
(``model_runtime.control_socket``): commands to a family or a LoRA model beside the
inference Triton runs."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging

log = logging.getLogger(__name__)


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


class ControlSockets:
    """The control sockets a server's models named in their answers, by Triton model name (a
    family's model, a LoRA model): commands go over one beside the batches Triton executes,
    and through Triton when there is none or it is gone.

    A socket whose process went (replaced, unloaded, dead) is never connected again: the
    process Triton replaces may still answer on it for a moment, and its answers would be
    the old process's."""

    # Names of processes long gone are forgotten past this many (each process names a new one).
    MAX_GONE = 1024

    def __init__(self, server: str) -> None:
        self.server = server  # the Triton whose models these are, for the log
        self._open: dict[str, ControlSocket] = {}
        self._gone: set[str] = set()

    def name_of(self, model: str) -> str | None:
        """The socket ``model``'s commands go over now, or None (through Triton)."""
        channel = self._open.get(model)
        return None if channel is None else channel.name

    async def send(self, model: str, command: dict, timeout_s: float) -> dict | None:
        """``model``'s answer to ``command`` over its socket, or None when it has none or the
        socket is gone (send it through Triton: that answer names the socket of the process
        serving now).  TimeoutError past ``timeout_s``; the socket is dropped then, and the
        next answer through Triton names it again."""
        channel = self._open.get(model)
        if channel is None:
            return None
        try:
            return await channel.send(command, timeout_s)
        except TimeoutError:
            await self.drop(model)
            raise
        except (OSError, EOFError, ValueError) as exc:
            log.info("%s on %s: control socket %s: %s; sending as a request", model, self.server,
                     channel.name, exc)
            await self.forget(model)
            return None

    def learn(self, model: str, answer: dict) -> None:
        """Adopt the socket ``answer`` (from ``model``'s process) names, unless it is gone."""
        name = answer.get("control_socket")
        current = self._open.get(model)
        if current is not None and current.name == name:
            return
        if current is not None:
            self._open.pop(model)
            asyncio.get_running_loop().create_task(current.close())
        if name and name not in self._gone:
            self._open[model] = ControlSocket(name)

    async def drop(self, model: str) -> None:
        """Close ``model``'s socket until an answer names it again."""
        channel = self._open.pop(model, None)
        if channel is not None:
            await channel.close()

    async def forget(self, model: str) -> None:
        """Close ``model``'s socket for good: its process is gone or being replaced."""
        channel = self._open.get(model)
        if channel is not None:
            if len(self._gone) >= self.MAX_GONE:
                self._gone.clear()
            self._gone.add(channel.name)
        await self.drop(model)

    async def close(self) -> None:
        for model in list(self._open):
            await self.drop(model)
