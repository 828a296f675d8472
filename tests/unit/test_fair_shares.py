"""The fair-share gate of a saturated server (router.serving.fair_shares): turns go to the
waiting model with the fewest running for its weight; waits end with their deadline; each
model's queue is bounded; a turn given up is handed on."""

from __future__ import annotations

import asyncio
import time

import pytest

from domain.router_errors import RequestTimeout
from router.serving.fair_shares import ShareExhausted, ShareGate


class Server:
    """A server that runs ``limit`` requests at once through ``gate`` and records the order
    in which their models start."""

    def __init__(self, gate: ShareGate):
        self.gate = gate
        self.started: list[str] = []
        self.release: dict[str, asyncio.Event] = {}

    async def request(self, model: str, deadline: float | None = None, hold: asyncio.Event | None = None):
        async with self.gate.turn("s0", model, deadline):
            self.started.append(model)
            if hold is not None:
                await hold.wait()
            else:
                await asyncio.sleep(0)


def gate(limit: int | None = 2, weights: dict | None = None, **kw) -> ShareGate:
    return ShareGate(lambda server: limit, lambda model: (weights or {}).get(model, 1.0), **kw)


async def settle():
    for _ in range(20):
        await asyncio.sleep(0)


def test_a_flood_queued_before_a_trickle_does_not_go_first():
    async def go():
        server = Server(gate(limit=2))
        hold = asyncio.Event()
        # Two flood requests take both turns and hold them; 50 more queue.
        running = [asyncio.create_task(server.request("flood", hold=hold)) for _ in range(2)]
        await settle()
        queued = [asyncio.create_task(server.request("flood")) for _ in range(50)]
        await settle()
        trickle = asyncio.create_task(server.request("trickle"))
        await settle()
        assert server.started == ["flood", "flood"]  # saturated: the rest wait
        hold.set()
        await asyncio.gather(*running, *queued, trickle)
        # The trickle arrived after 50 flood requests and started among the first to go.
        assert server.started.index("trickle") <= 3, server.started[:6]
        assert server.started.count("flood") == 52

    asyncio.run(go())


def test_without_a_limit_nothing_waits():
    async def go():
        server = Server(gate(limit=None))
        hold = asyncio.Event()
        tasks = [asyncio.create_task(server.request("m", hold=hold)) for _ in range(100)]
        await settle()
        assert len(server.started) == 100
        hold.set()
        await asyncio.gather(*tasks)

    asyncio.run(go())


def test_turns_follow_the_weights_when_both_wait():
    async def go():
        g = gate(limit=4, weights={"heavy": 3.0})
        server = Server(g)
        holds = [asyncio.Event() for _ in range(4)]
        first = [asyncio.create_task(server.request("x", hold=h)) for h in holds]
        await settle()
        # Both models have many waiting; as turns free up they are shared 3:1.
        gates = {m: [asyncio.Event() for _ in range(40)] for m in ("heavy", "light")}
        waiting = [asyncio.create_task(server.request(m, hold=e)) for m in gates for e in gates[m]]
        await settle()
        for h in holds:
            h.set()
        await settle()
        running = server.started[4:]
        assert sorted(running) == ["heavy", "heavy", "heavy", "light"], running
        for events in gates.values():
            for e in events:
                e.set()
        await asyncio.gather(*first, *waiting)

    asyncio.run(go())


async def saturated(**kw) -> tuple[ShareGate, Server, asyncio.Event, asyncio.Task]:
    """A server of one turn, taken by a request of "a" until the event is set."""
    g = gate(limit=1, **kw)
    server = Server(g)
    hold = asyncio.Event()
    busy = asyncio.create_task(server.request("a", hold=hold))
    await settle()
    return g, server, hold, busy


def test_a_wait_ends_with_its_deadline_and_hands_nothing_on():
    async def go():
        g, server, hold, busy = await saturated()
        started = time.monotonic()
        with pytest.raises(RequestTimeout, match="its share of s0"):
            await server.request("b", deadline=time.monotonic() + 0.05)
        assert time.monotonic() - started < 1.0
        assert g.waiting("s0", "b") == 0  # not left in the queue
        hold.set()
        await busy
        await server.request("c")  # the turn is free again
        assert server.started == ["a", "c"]

    asyncio.run(go())


def test_a_cancelled_waiter_leaves_its_turn_to_the_next():
    async def go():
        g, server, hold, busy = await saturated()
        gone = asyncio.create_task(server.request("b"))
        after = asyncio.create_task(server.request("c"))
        await settle()
        gone.cancel()
        await settle()
        hold.set()
        await asyncio.gather(busy, after)
        assert server.started == ["a", "c"]
        assert g._servers["s0"].total == 0 and not g._servers["s0"].running

    asyncio.run(go())


def test_each_models_queue_is_bounded_and_the_refusal_says_what_to_do():
    async def go():
        refused = []
        _gate, server, hold, busy = await saturated(max_waiting=3, on_refused=refused.append)
        waiting = [asyncio.create_task(server.request("a")) for _ in range(3)]
        await settle()
        with pytest.raises(ShareExhausted, match="mmctl share") as caught:
            await server.request("a")
        assert caught.value.retry_after_s > 0 and refused == ["a"]
        await server_request_other_model_waits_its_turn(server, hold)
        await asyncio.gather(busy, *waiting)

    async def server_request_other_model_waits_its_turn(server, hold):
        other = asyncio.create_task(server.request("b"))  # another model's queue is its own
        await settle()
        hold.set()
        await other
        assert server.started.index("b") == 1

    asyncio.run(go())
