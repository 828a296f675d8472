"""The public HTTP port's listening site: aiohttp's, except that a client which sends its
request and then closes its sending side (``shutdown(SHUT_WR)``, ``nc -N``, some HTTP/1.0
tools) still gets its answer, as Triton answers it.

asyncio closes a connection when its peer's end of stream arrives unless the protocol's
``eof_received`` returns True, and aiohttp's returns None: the request was read but the
connection was gone before the answer.  Here the write side stays open, the connection
closes once the requests already received are answered, and one that never completes its
request is closed after ``abandon_after_s``.
"""

from __future__ import annotations

import asyncio

from aiohttp import web


class _AnswerAfterEof(asyncio.Protocol):
    """aiohttp's request handler, told of the end of stream without losing the write side."""

    def __init__(self, handler, abandon_after_s: float):
        self.handler = handler
        self.abandon_after_s = abandon_after_s
        self._abandon: asyncio.TimerHandle | None = None

    def connection_made(self, transport):
        self.handler.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        self.handler.data_received(data)

    def eof_received(self) -> bool:
        self.handler.eof_received()
        self.handler.close()  # no further requests: close once the ones read are answered
        self._abandon = asyncio.get_running_loop().call_later(self.abandon_after_s, self.handler.force_close)
        return True

    def connection_lost(self, exc: BaseException | None) -> None:
        if self._abandon is not None:
            self._abandon.cancel()
        self.handler.connection_lost(exc)

    def pause_writing(self) -> None:
        self.handler.pause_writing()

    def resume_writing(self) -> None:
        self.handler.resume_writing()


# How long requests in flight get to finish when a router stops, on both protocols (gRPC's
# stop grace, the HTTP runner's shutdown timeout): a client stuck sending its body does not
# hold a stop for aiohttp's default minute.
STOP_GRACE_S = 2.0


class HalfCloseTCPSite(web.BaseSite):
    """``web.TCPSite`` (host, port, SO_REUSEPORT) whose connections answer after the client's
    end of stream."""

    def __init__(self, runner: web.BaseRunner, host: str, port: int, reuse_port: bool = False,
                 abandon_after_s: float = 300.0):
        super().__init__(runner)
        self.host, self.port, self.reuse_port = host, port, reuse_port
        self.abandon_after_s = abandon_after_s

    @property
    def name(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def start(self) -> None:
        await super().start()
        handlers = self._runner.server
        assert handlers is not None, "the runner is not set up"
        self._server = await asyncio.get_running_loop().create_server(
            lambda: _AnswerAfterEof(handlers(), self.abandon_after_s), self.host, self.port,
            reuse_address=True, reuse_port=self.reuse_port or None)
