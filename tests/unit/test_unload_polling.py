"""How soon TritonAdmin.wait_unavailable sees an unload complete (fake index, no sockets)."""

from __future__ import annotations

import asyncio

from control_plane.triton.admin import IndexEntry, TritonAdmin, TritonModelState
from tests.conftest import run


def test_the_wait_ends_soon_after_triton_frees_the_model():
    """The stub exits 0.27 s after the unload; a load waiting for that memory starts when
    the poll sees it.  Polls backing off to 100 ms saw it 80 ms late; now within ~25 ms."""

    async def go():
        loop = asyncio.get_running_loop()
        admin = TritonAdmin("127.0.0.1:1")
        freed_at = loop.time() + 0.27
        polls = []

        async def index():
            polls.append(loop.time())
            state = (TritonModelState.UNAVAILABLE if loop.time() >= freed_at
                     else TritonModelState.UNLOADING)
            return {"m": IndexEntry("m", state)}

        admin.triton_index = index
        await admin.wait_unavailable("m", timeout_s=5)
        lag_s = loop.time() - freed_at
        assert lag_s < 0.05, f"saw the model gone {lag_s * 1000:.0f} ms after it was"
        assert len(polls) < 40  # and without hammering the index

    run(go())
