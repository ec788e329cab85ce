"""Who a client is, by address: the connection's own, or behind trusted proxies the one they name in
X-Forwarded-For. Light (the standard library only): the settings check trusted_proxies with it, the ingress and
the door in Serve's proxy (ingress/front.py) read the client's address with it."""
from __future__ import annotations

import ipaddress


def parse_networks(text: str) -> tuple:
    """trusted_proxies' value -> its networks ("10.0.0.0/8, ::1"); ValueError for a bad one."""
    return tuple(ipaddress.ip_network(p.strip(), strict=False) for p in text.split(",") if p.strip())


def limit_key(address: str) -> str:
    """Whose a connection is for the per-address limits: an IPv4 address itself, an IPv6 address's /64 (one
    host's interface usually holds a whole /64: a bound per /128 would bound nothing), anything else as it is."""
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return address
    if ip.version == 4:
        return str(ip)
    if ip.ipv4_mapped is not None:                          # ::ffff:a.b.c.d is the IPv4 client
        return str(ip.ipv4_mapped)
    return str(ipaddress.ip_network(f"{ip}/64", strict=False))


def scope_address(scope, trusted: tuple) -> str:
    """client_address of an ASGI connection `scope` (the ingress's WebSocket, or the proxy's door before it)."""
    client = scope.get("client")
    forwarded = [v.decode("latin-1") for k, v in scope.get("headers", ()) if k.lower() == b"x-forwarded-for"]
    return client_address(client[0] if client else "?", forwarded, trusted)


def client_address(peer: str, forwarded_for: list[str], trusted: tuple) -> str:
    """The client's address: the connection's own (`peer`), or, when that is a trusted proxy (`trusted`: the
    trusted_proxies networks), the last address in X-Forwarded-For (`forwarded_for`: every such header line, in
    order: a proxy may add a line of its own) that is not one. Each proxy appends the address it was reached
    from, so walking from the right, the first untrusted hop is the one a trusted proxy saw; what a client wrote
    to the left of it is never read. A hop's port (`1.2.3.4:5678`, `[::1]:443`) is dropped."""
    if not trusted or not _within(peer, trusted):
        return peer
    hops = [_host(h) for line in forwarded_for for h in line.split(",") if h.strip()]
    for hop in reversed(hops):
        if not _within(hop, trusted):
            return hop
    return hops[0] if hops else peer


def _host(hop: str) -> str:
    hop = hop.strip()
    if hop.startswith("["):                                 # [IPv6] or [IPv6]:port
        return hop[1:].partition("]")[0]
    if hop.count(":") == 1:                                 # IPv4:port (a bare IPv6 address has several)
        return hop.partition(":")[0]
    return hop


def _within(address: str, networks: tuple) -> bool:
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return False
    return any(ip in n for n in networks)
