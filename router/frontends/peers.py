"""Where a call comes from: the address in a peer as gRPC or aiohttp gives it, whether it
is on this host's loopback interface, and which client a call counts against (the miss
budget, ``router.serving.miss_budget``).

A client is keyed by what it cannot cheaply change: an IPv4 address, an IPv6 address's /64
(one host is commonly handed a whole /64, so its 2^64 addresses are one client), an
IPv4-mapped IPv6 address (``::ffff:1.2.3.4``) as its IPv4 address.  With a trusted header
(``--client-header``) the client is the last comma-separated entry of every line of that
header joined in order: a proxy appends the address it saw, either to the line the client
sent or as a line of its own, so everything before its entry was written by the client."""

from __future__ import annotations

import ipaddress

MAX_NAMED_CHARS = 200  # a header value that is not an address is kept up to this length
IPV6_CLIENT_PREFIX = 64


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


def _ip(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """``text`` as an IP address ("203.0.113.5", "2001:db8::1", "[2001:db8::1]:443",
    "203.0.113.5:80", "fe80::1%eth0"; the port and zone dropped), an IPv4-mapped IPv6 address
    as its IPv4 one; None when it is not an address."""
    text = text.strip()
    if text.startswith("["):
        text = text[1:].split("]", 1)[0]
    elif text.count(":") == 1:  # an IPv4 address with a port
        text = text.split(":", 1)[0]
    try:
        address = ipaddress.ip_address(text.split("%", 1)[0])
    except ValueError:
        return None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def client_key(host: str) -> str:
    """The key a client's budget is kept under: an IPv4 address as is, an IPv6 address as its
    /64 ("2001:db8:1:2::/64"), an IPv4-mapped IPv6 address as the IPv4 address; anything else
    (a name a proxy gives its clients) as is, cut to ``MAX_NAMED_CHARS``."""
    address = _ip(host)
    if address is None:
        return host[:MAX_NAMED_CHARS]
    if isinstance(address, ipaddress.IPv6Address):
        return str(ipaddress.IPv6Network((address, IPV6_CLIENT_PREFIX), strict=False))
    return str(address)


def loopback_peer(address: str | None) -> bool:
    """Whether the peer ``address`` (as ``peer_host`` takes it) is on this host: a loopback
    address (``::ffff:127.0.0.1`` too) or a Unix socket."""
    host = peer_host(address)
    if host is None:
        return False
    if host == "unix:":
        return True
    ip = _ip(host)
    return ip is not None and ip.is_loopback


def client_identity(peer: str | None, named: str | None = None) -> str | None:
    """Who a call counts against (``client_key``): the trusted header's client when the
    operator named one and the call carries it, else the peer's address (``peer_host``); None
    for a peer on this host."""
    if named:
        return client_key(named)
    if loopback_peer(peer):
        return None
    host = peer_host(peer)
    return None if host is None else client_key(host)


def named_client(lines: list[str] | tuple[str, ...] | str | None) -> str | None:
    """The client a trusted header names: the last comma-separated entry of all its lines
    joined in order (a proxy appends the address it saw, to the client's line or as a line of
    its own, so only the last entry is the proxy's); None when the header is absent or empty."""
    if isinstance(lines, str):
        lines = [lines]
    value = ",".join(line for line in lines or () if line)
    return value.rsplit(",", 1)[-1].strip() or None


def grpc_client(router_config, context) -> str | None:
    """The client of a gRPC call, as ``client_identity`` says; the trusted header is every
    metadata entry with its (lower-case) name, in the order they came."""
    header = (router_config.client_header or "").lower()
    named = None
    if header:
        named = named_client([v for k, v in context.invocation_metadata() or ()
                              if k == header and isinstance(v, str)])
    return client_identity(context.peer(), named)


def http_client(router_config, request) -> str | None:
    """The client of an HTTP request (aiohttp), as ``client_identity`` says; the trusted
    header is every line with its name, in the order they came."""
    header = router_config.client_header
    named = named_client(request.headers.getall(header, [])) if header else None
    return client_identity(request.remote, named)
