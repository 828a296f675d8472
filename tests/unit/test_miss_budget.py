"""The per-client miss budget: token buckets with a fake clock, and who counts as a client."""

from __future__ import annotations

import pytest

from domain.router_errors import RateLimited
from router.frontends.peers import client_identity, named_client
from router.serving.miss_budget import CLIENT, MissBudget


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_a_client_past_its_budget_is_refused_with_the_reason_and_when_to_retry():
    clock, refused = Clock(), []
    budget = MissBudget(2.0, clock=clock, on_refused=lambda: refused.append(1))
    for _ in range(20):  # 10 s of the rate at once
        budget.spend("cust001", "10.0.0.7")
    with pytest.raises(RateLimited) as exc:
        budget.spend("cust021", "10.0.0.7")
    assert "10.0.0.7" in exc.value.message and "cust021" in exc.value.message
    assert "2 a second" in exc.value.message and 0 < exc.value.retry_after_s <= 0.5
    assert refused == [1]
    budget.spend("cust002", "10.0.0.8")  # another client has its own budget
    clock.now += 0.5  # one more miss earned
    budget.spend("cust022", "10.0.0.7")
    with pytest.raises(RateLimited):
        budget.spend("cust023", "10.0.0.7")


def test_no_budget_and_uncounted_clients_never_refuse():
    off = MissBudget(0.0, clock=Clock())
    for _ in range(1000):
        off.spend("m", "10.0.0.7")
    budget = MissBudget(1.0, clock=Clock())
    for _ in range(1000):
        budget.spend("m", None)  # a loopback peer with no trusted header


def test_the_client_of_the_current_call_is_read_from_the_context():
    budget = MissBudget(0.1, clock=Clock())
    token = CLIENT.set("203.0.113.9")
    try:
        budget.spend("m")  # the one miss of its burst (1)
        with pytest.raises(RateLimited):
            budget.spend("m")
    finally:
        CLIENT.reset(token)
    budget.spend("m")  # no client in this context: not counted


def test_clients_are_forgotten_before_the_table_grows_without_bound():
    clock = Clock()
    budget = MissBudget(1.0, clock=clock)
    budget.MAX_CLIENTS = 100
    for i in range(100):
        budget.spend("m", f"10.0.{i // 250}.{i % 250}")
    clock.now += 60  # every bucket full again
    budget.spend("m", "192.0.2.1")
    assert len(budget._buckets) == 1


@pytest.mark.parametrize("peer, named, expected", [
    ("127.0.0.1", None, None),
    ("::1", None, None),
    ("10.1.2.3", None, "10.1.2.3"),
    ("127.0.0.1", "alice", "alice"),  # a proxy on this host that names its clients
    (None, None, None),
])
def test_who_a_call_counts_against(peer, named, expected):
    assert client_identity(peer, named) == expected


def test_peer_strings_and_forwarded_chains():
    assert client_identity("ipv4:10.0.0.7:5123") == "10.0.0.7"
    assert client_identity("ipv6:[::1]:5123") is None
    assert client_identity("ipv6:[2001:db8::2]:80") == "2001:db8::2"
    assert client_identity("unix:/run/router.sock") is None
    assert named_client("198.51.100.1, 203.0.113.5") == "203.0.113.5"  # what the proxy saw
    assert named_client("") is None
