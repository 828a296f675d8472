"""Where a call comes from: the address in a peer as gRPC or aiohttp gives it, and whether it
is on this host's loopback interface."""

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
