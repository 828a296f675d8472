"""The one ledger of holds the manager's leases and the adapters' slots keep: each ends when
its own worker says its request was answered, or by itself."""

from __future__ import annotations

import asyncio

from control_plane.manager.request_holds import RequestHolds


def test_a_workers_answers_end_its_own_holds_oldest_first_and_never_anothers():
    async def go():
        events = []
        holds = RequestHolds(3600.0, on_first=lambda k: events.append(("first", k)),
                             on_end=lambda k: events.append(("end", k)),
                             on_last=lambda k: events.append(("last", k)))
        first = holds.hold("m", "w0")
        holds.hold("m", "w1")
        holds.hold("m", "w0")
        assert holds.count("m") == 3 and events == [("first", "m")]
        assert holds.answered("m", 5, "w0") == 2  # only w0's, however many it says
        assert first.cancelled() and holds.count("m") == 1 and "m" in holds
        assert holds.answered("m", 1, "w0") == 0
        assert holds.answered("m", 1, "w1") == 1
        assert "m" not in holds and len(holds) == 0
        assert events == [("first", "m"), ("end", "m"), ("end", "m"), ("end", "m"), ("last", "m")]

    asyncio.run(go())


def test_a_hold_nobody_ends_expires_and_ending_it_again_does_nothing():
    async def go():
        ended = []
        holds = RequestHolds(0.01, on_last=ended.append)
        handle = holds.hold("a:x", None)
        while "a:x" in holds:
            await asyncio.sleep(0.005)
        assert ended == ["a:x"]
        holds.end("a:x", handle)
        assert ended == ["a:x"] and holds.answered("a:x", 1, None) == 0

    asyncio.run(go())
