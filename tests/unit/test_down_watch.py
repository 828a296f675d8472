"""Requests waiting on a server the control plane declares down are cut short
(router.serving.down_watch)."""

import asyncio

import pytest

from router.serving.down_watch import DownWatch, ServerDown


class Server:
    def __init__(self, name: str):
        self.name = name
        self.up = True


def run(coro):
    return asyncio.run(coro)


def test_a_request_waiting_on_a_server_declared_down_ends_with_server_down_and_its_task_goes_on():
    a, b = Server("a"), Server("b")
    watch = DownWatch(lambda: [a, b], interval_s=0.001)

    async def go():
        on_a = asyncio.get_running_loop().create_future()
        on_b = asyncio.get_running_loop().create_future()

        async def request(server, answer):
            try:
                return await watch.wait(server, answer)
            except ServerDown:
                # The task is no longer being cancelled: what it awaits next is not cut.
                assert asyncio.current_task().cancelling() == 0
                await asyncio.sleep(0)
                return "sent elsewhere"

        first = asyncio.create_task(request(a, on_a))
        second = asyncio.create_task(request(b, on_b))
        await asyncio.sleep(0.01)
        a.up = False
        assert await first == "sent elsewhere"
        assert on_a.cancelled()  # its send was cancelled with it
        on_b.set_result("answer")  # a request on a server that is up waits on
        assert await second == "answer"

    run(go())
    assert not watch._waiting and not watch._cut


def test_a_client_that_goes_away_is_a_cancellation_not_a_server_down():
    server = Server("a")
    watch = DownWatch(lambda: [server], interval_s=0.001)

    async def go():
        task = asyncio.create_task(watch.wait(server, asyncio.get_running_loop().create_future()))
        await asyncio.sleep(0.005)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    run(go())
    assert not watch._waiting and not watch._cut
