"""How soon TritonAdmin.wait_unavailable sees an unload complete (fake index, no sockets,
a virtual clock: the polls' own timing, not the machine's load, decides)."""

from __future__ import annotations

from control_plane.triton import admin as admin_module
from control_plane.triton.admin import IndexEntry, TritonAdmin, TritonModelState
from tests.conftest import run


def test_the_wait_ends_soon_after_triton_frees_the_model(monkeypatch):
    """The stub exits 0.27 s after the unload; a load waiting for that memory starts when
    the poll sees it.  Polls backing off to 100 ms saw it 80 ms late; now within ~25 ms."""
    clock = {"now": 0.0}
    freed_at = 0.27

    async def virtual_sleep(delay: float) -> None:
        clock["now"] += delay

    monkeypatch.setattr(admin_module.asyncio, "sleep", virtual_sleep)

    async def go():
        admin = TritonAdmin("127.0.0.1:1")
        polls = []

        async def index():
            polls.append(clock["now"])
            state = (TritonModelState.UNAVAILABLE if clock["now"] >= freed_at
                     else TritonModelState.UNLOADING)
            return {"m": IndexEntry("m", state)}

        admin.triton_index = index
        await admin.wait_unavailable("m", timeout_s=5)
        lag_s = polls[-1] - freed_at
        assert 0 <= lag_s < 0.03, f"saw the model gone {lag_s * 1000:.0f} ms after it was"
        assert len(polls) < 40  # and without hammering the index

    run(go())
