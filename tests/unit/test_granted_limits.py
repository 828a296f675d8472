"""Rate limits across router workers (``router.serving.granted_limits``), with a fake
control plane: requests that wait beside each other for a grant share it and ask again when
it ran out, so none is refused while the bucket still has tokens."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from domain.router_errors import RateLimited
from domain.token_bucket import TokenBucket
from router.serving.granted_limits import GrantedLimiter
from router.serving.state_client import ControlPlaneAway
from tests.conftest import run

SPEC = {"qps": 1000, "burst": 1000}


class FakeControlPlane:
    """``RemoteState``'s surface the limiter uses: the limits, the workers, grants from one
    bucket (each answered after a short wait); ``away``: every grant fails as when the
    leader was just killed."""

    def __init__(self, spec=SPEC, workers=2, away=False):
        self.table = SimpleNamespace(limits={"m": spec})
        self.workers = workers
        self.away = away
        self.bucket = TokenBucket(spec["qps"], spec["burst"])
        self.asked: list[int] = []

    async def grant(self, name, want):
        self.asked.append(want)
        await asyncio.sleep(0.005)
        if self.away:
            raise ControlPlaneAway("no control plane answers")
        granted, retry_after_s = 0, 0.0
        while granted < want:
            ok, retry_after_s = self.bucket.try_acquire()
            if not ok:
                break
            granted += 1
        return granted, retry_after_s


async def outcomes(limiter, requests):
    async def one():
        try:
            await limiter.acquire(["m"])
            return "served"
        except RateLimited as exc:
            return exc.message

    return await asyncio.gather(*(one() for _ in range(requests)))


@pytest.mark.parametrize("away", [False, True], ids=["leader-answers", "leader-away"])
def test_requests_waiting_beside_each_other_are_all_served_while_the_bucket_has_tokens(away):
    # 40 requests at once against a batch of 25 (1000 qps over 2 workers): before, each one
    # past the first grant was refused with "retry in 0.000s"; with the leader away (its
    # local share, 500 tokens) every waiter but one was.
    state = FakeControlPlane(away=away)
    answers = run(outcomes(GrantedLimiter(state), 40))
    assert answers == ["served"] * 40


def test_an_empty_bucket_still_refuses_with_the_time_until_the_next_token():
    state = FakeControlPlane(spec={"qps": 10, "burst": 3}, workers=1)
    limited: list[str] = []
    answers = run(outcomes(GrantedLimiter(state, on_limited=limited.append), 8))
    assert answers.count("served") == 3
    refusals = [a for a in answers if a != "served"]
    assert len(refusals) == 5 and limited == ["m"] * 5
    for message in refusals:
        assert message.startswith("rate limit for m is 10 requests/s (burst 3); retry in 0.")
        assert float(message.rsplit("retry in ", 1)[1].rstrip("s")) > 0


def test_with_the_leader_away_a_worker_keeps_its_share_of_the_limit_and_no_more():
    state = FakeControlPlane(spec={"qps": 10, "burst": 8}, workers=2, away=True)
    answers = run(outcomes(GrantedLimiter(state), 10))
    assert answers.count("served") == 4  # its half of the burst
