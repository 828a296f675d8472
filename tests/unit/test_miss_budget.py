"""The per-client miss budget: token buckets with a fake clock, and who counts as a client."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from multidict import CIMultiDict

from domain.router_errors import RateLimited
from router.frontends.peers import client_identity, grpc_client, http_client, named_client
from router.serving.miss_budget import CLIENT, MissBudget
from router.serving.router_config import RouterConfig


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


def test_the_client_of_the_current_call_is_asked_of_the_context_on_a_miss():
    budget = MissBudget(0.1, clock=Clock())
    asked = []
    token = CLIENT.set(lambda: asked.append("who") or "203.0.113.9")
    try:
        budget.spend("m")  # the one miss of its burst (1)
        with pytest.raises(RateLimited):
            budget.spend("m")
    finally:
        CLIENT.reset(token)
    assert asked == ["who", "who"]  # once per miss: a hit never works out who its client is
    budget.spend("m")  # no client in this context: not counted


def test_a_budget_turned_off_never_asks_who_the_client_is():
    token = CLIENT.set(lambda: pytest.fail("the client was worked out for a budget that is off"))
    try:
        MissBudget(0.0, clock=Clock()).spend("m")
    finally:
        CLIENT.reset(token)


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
    assert client_identity("ipv6:[2001:db8::2]:80") == "2001:db8::/64"
    assert client_identity("unix:/run/router.sock") is None
    assert named_client("198.51.100.1, 203.0.113.5") == "203.0.113.5"  # what the proxy saw
    assert named_client("") is None


# What a stand-in transport needs: aiohttp's request (headers, remote) and gRPC's servicer
# context (invocation_metadata, peer).
XFF = RouterConfig(client_header="X-Forwarded-For")


def http_request(remote: str, *lines: str) -> SimpleNamespace:
    return SimpleNamespace(remote=remote,
                           headers=CIMultiDict(("X-Forwarded-For", line) for line in lines))


def grpc_context(peer: str, *lines: str) -> SimpleNamespace:
    metadata = (("user-agent", "grpc-python"), *(("x-forwarded-for", line) for line in lines))
    return SimpleNamespace(peer=lambda: peer, invocation_metadata=lambda: metadata)


@pytest.mark.parametrize("lines, expected", [
    (("203.0.113.5",), "203.0.113.5"),
    (("198.51.100.1, 203.0.113.5",), "203.0.113.5"),  # the proxy appended to the client's line
    (("198.51.100.1", "203.0.113.5"), "203.0.113.5"),  # ... or sent a line of its own
    (("198.51.100.1, 192.0.2.9", "10.0.0.1, 203.0.113.5"), "203.0.113.5"),
    (("198.51.100.1", ""), "198.51.100.1"),  # an empty last line names no one
    ((), "10.0.0.7"),  # no header: the peer
])
def test_the_trusted_header_is_the_last_entry_of_all_its_lines(lines, expected):
    assert http_client(XFF, http_request("10.0.0.7", *lines)) == expected
    assert grpc_client(XFF, grpc_context("ipv4:10.0.0.7:5000", *lines)) == expected


@pytest.mark.parametrize("client_of", [
    lambda forged: http_client(XFF, http_request("127.0.0.1", forged, "203.0.113.5")),
    lambda forged: grpc_client(XFF, grpc_context("ipv4:127.0.0.1:5000", forged, "203.0.113.5")),
], ids=["http", "grpc"])
def test_a_client_that_forges_its_own_x_forwarded_for_line_gets_no_fresh_budget(client_of):
    # The attack: a new first line each request, before the one the proxy on this host adds.
    budget = MissBudget(0.1, clock=Clock())  # one miss at once
    budget.spend("cust002", client_of("198.51.100.0"))
    with pytest.raises(RateLimited) as exc:
        for i in range(1, 50):
            budget.spend(f"cust{i:03d}", client_of(f"198.51.100.{i}"))
    assert "203.0.113.5" in exc.value.message


@pytest.mark.parametrize("peer, named, expected", [
    ("2001:db8:1:2::1", None, "2001:db8:1:2::/64"),  # aiohttp's remote
    ("ipv6:[2001:db8:1:2:ffff:ffff:ffff:ffff]:443", None, "2001:db8:1:2::/64"),  # gRPC's peer
    ("ipv6:[fe80::1%eth0]:443", None, "fe80::/64"),
    ("10.0.0.7", "2001:db8:1:2:abcd::7", "2001:db8:1:2::/64"),  # named by the header
    ("10.0.0.7", "[2001:db8:1:2::7]:51000", "2001:db8:1:2::/64"),
    ("ipv6:[::ffff:203.0.113.5]:80", None, "203.0.113.5"),  # IPv4-mapped: the IPv4 address
    ("10.0.0.7", "::ffff:203.0.113.5", "203.0.113.5"),
    ("::ffff:127.0.0.1", None, None),  # loopback over a dual-stack socket: not counted
    ("10.0.0.7", "203.0.113.5", "203.0.113.5"),  # IPv4 stays the full address
    ("10.0.0.7", "alice", "alice"),  # a name, not an address: as is
    ("10.0.0.7", "x" * 300, "x" * 200),
])
def test_ipv6_clients_count_as_their_64(peer, named, expected):
    assert client_identity(peer, named) == expected


def test_a_client_cycling_through_the_addresses_of_its_64_shares_one_budget():
    budget = MissBudget(0.1, clock=Clock())  # one miss at once
    peers = [f"ipv6:[2001:db8:1:2:{i:x}::1]:5000" for i in range(1, 50)]
    budget.spend("cust002", grpc_client(XFF, grpc_context(peers[0])))
    with pytest.raises(RateLimited) as exc:
        for i, peer in enumerate(peers[1:], start=3):
            budget.spend(f"cust{i:03d}", grpc_client(XFF, grpc_context(peer)))
    assert "2001:db8:1:2::/64" in exc.value.message
    budget.spend("cust002", "2001:db8:1:3::/64")  # the next /64 is another client


def spending_table(clock: Clock, size: int) -> MissBudget:
    """A budget whose table is full of ``size`` clients that have each just spent a miss."""
    budget = MissBudget(1.0, clock=clock)  # 10 misses at once, 10 s to refill
    budget.MAX_CLIENTS = size
    for i in range(size):
        budget.spend("m", f"10.0.0.{i}")
    return budget


def test_a_flood_of_new_clients_does_not_reset_the_budget_of_those_spending():
    clock = Clock()
    budget = spending_table(clock, 100)
    for _ in range(9):
        budget.spend("m", "10.0.0.0")  # this one's burst is spent
    with pytest.raises(RateLimited):
        budget.spend("m", "10.0.0.0")
    for i in range(1000):  # the flood: new addresses, each told no once the overflow is spent
        try:
            budget.spend("m", f"198.51.{i // 250}.{i % 250}")
        except RateLimited:
            pass
    assert len(budget._buckets) == 100  # no memory grew
    with pytest.raises(RateLimited):
        budget.spend("m", "10.0.0.0")  # ... and no budget was given back
    budget.spend("m", "10.0.0.1")  # the others keep what they had left


def test_new_clients_share_the_overflow_bucket_while_the_table_is_full_of_spenders():
    clock = Clock()
    budget = spending_table(clock, 100)
    for i in range(10):  # one burst, shared by all of them
        budget.spend("m", f"198.51.100.{i}")
    with pytest.raises(RateLimited) as exc:
        budget.spend("m", "198.51.100.99")
    assert "198.51.100.99 among them" in exc.value.message and "share" in exc.value.message
    clock.now += 1.0  # it earns like any bucket
    budget.spend("m", "198.51.100.77")
    with pytest.raises(RateLimited):
        budget.spend("m", "198.51.100.78")
    budget.spend("m", "10.0.0.5")  # a client in the table still has its own


def test_room_comes_back_as_buckets_refill_least_recently_touched_first():
    clock = Clock()
    budget = spending_table(clock, 100)
    clock.now += 5.0
    budget.spend("m", "10.0.0.0")  # touched again: now the most recent
    clock.now += 5.0  # the other 99 untouched for 10 s: full again, dropped
    budget.spend("m", "192.0.2.1")  # room again: its own bucket, not the overflow
    assert list(budget._buckets) == ["10.0.0.0", "192.0.2.1"]
    assert budget._overflow is None
    for _ in range(9):
        budget.spend("m", "192.0.2.1")
    with pytest.raises(RateLimited) as exc:
        budget.spend("m", "192.0.2.1")
    assert "client 192.0.2.1 has" in exc.value.message
