"""Where a call comes from: the address in a peer as gRPC or aiohttp gives it, whether it
is on this host's loopback interface, and which client a call counts against (the miss
budget, ``router.serving.miss_budget``)."""

from __future__ import annotations

import ipaddress


def peer_host(address: str | None) -> str | None:
    """The address of a peer: an IP as aiohttp gives it ("10.0.0.7", "::1") or gRPC's peer
    ("ipv4:10.0.0.7:5000", "ipv6:[::1]:5000"); "unix:" for a Unix socket's; None if none."""
    if not address:
        return None
    if address.startswith("unix:"):
        return "unix:"
    if address.startswith(("ipv4:", "ipv6:")):
        address = address[5:].rsplit(":", 1)[0]
    return address.strip("[]") or None


def loopback_peer(address: str | None) -> bool:
    """Whether the peer ``address`` (as ``peer_host`` takes it) is on this host: a loopback
    address or a Unix socket."""
    host = peer_host(address)
    if host is None:
        return False
    if host == "unix:":
        return True
    try:
        return ipaddress.ip_address(host.split("%", 1)[0]).is_loopback
    except ValueError:
        return False


def client_identity(peer: str | None, named: str | None = None) -> str | None:
    """Who a call counts against: the trusted header's value when the operator named one and
    the call carries it, else the peer's address (``peers.peer_host``); None for a peer on
    this host."""
    if named:
        return named[:200]
    if loopback_peer(peer):
        return None
    return peer_host(peer)


def named_client(value: str | None) -> str | None:
    """The client a trusted header names: its last comma-separated entry (a proxy appends
    the address it saw to what the client sent, so only the last one is its own)."""
    if not value:
        return None
    return value.rsplit(",", 1)[-1].strip() or None


def grpc_client(router_config, context) -> str | None:
    """The client of a gRPC call, as ``client_identity`` says."""
    header = (router_config.client_header or "").lower()
    named = None
    if header:
        named = named_client(next((v for k, v in context.invocation_metadata() or ()
                                   if k == header), None))
    return client_identity(context.peer(), named)


def http_client(router_config, request) -> str | None:
    """The client of an HTTP request (aiohttp), as ``client_identity`` says."""
    header = router_config.client_header
    named = named_client(request.headers.get(header)) if header else None
    return client_identity(request.remote, named)
