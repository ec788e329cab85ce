"""Access: what a connection must pass at the ingress before its session may start. Who may connect (an API key,
the page's origin) and limits per tenant (an API key, or the client's address when no keys are configured): how
many sessions it may hold at once and how many it may start per minute. Plain Python, one per ingress
replica: the app runs one; with several (or an old one draining through a redeploy) each enforces the limits
on its own connections."""
from __future__ import annotations

import base64
import hmac
import ipaddress
import random
from collections import deque
from typing import Optional

from ..session.codes import CLOSE_TRY_AGAIN, ErrorCode, ProtocolError

WINDOW_S = 60.0


class TenantLimits:
    def __init__(self, max_sessions: int = 0, max_starts_per_minute: int = 0):
        self.max_sessions = max_sessions                    # 0: no limit
        self.max_starts = max_starts_per_minute             # 0: no limit (no start times kept)
        self.active: dict[str, int] = {}
        self.starts: dict[str, deque] = {}
        self.swept_at = 0.0                                 # when tenants without a recent start were last dropped

    def admit(self, tenant: str, now: float) -> Optional[ProtocolError]:
        """Take a session slot for `tenant`, or the refusal (the slot is not taken)."""
        if now - self.swept_at >= WINDOW_S:                 # every tenant ever seen would stay otherwise
            self.swept_at = now
            for stale in [t for t, s in self.starts.items() if not s or now - s[-1] >= WINDOW_S]:
                del self.starts[stale]
        active = self.active.get(tenant, 0)
        if self.max_sessions and active >= self.max_sessions:
            return ProtocolError(ErrorCode.TOO_MANY_SESSIONS, f"this key already holds {active} sessions (the "
                                 f"limit is {self.max_sessions}); end one first", close=CLOSE_TRY_AGAIN,
                                 retry_after_s=5)
        if self.max_starts:
            starts = self.starts.setdefault(tenant, deque())
            while starts and now - starts[0] >= WINDOW_S:
                starts.popleft()
            if len(starts) >= self.max_starts:
                wait = WINDOW_S - (now - starts[0])
                return ProtocolError(ErrorCode.RATE_LIMITED,
                                     f"this key started {len(starts)} sessions in the last minute "
                                     f"(the limit is {self.max_starts})", close=CLOSE_TRY_AGAIN,
                                     retry_after_s=round(max(wait, 0.0), 1))
            starts.append(now)
        self.active[tenant] = active + 1
        return None

    def release(self, tenant: str) -> None:
        self.active[tenant] -= 1
        if self.active[tenant] <= 0:
            del self.active[tenant]


def busy(live: int, max_sessions: int, retry_after_s: float, rng: random.Random,
         who: str = "this server") -> Optional[ProtocolError]:
    """The refusal of a connection that finds `who` (the ingress replica; a proxy's door: front.py) holding
    `max_sessions` WebSockets already (`live` counts it), answered at once: server_busy with a retry_after_s of 1
    to 1.5 times the setting, so that a refused crowd does not come back all at once; None while there is room."""
    if live <= max_sessions:
        return None
    wait = round(retry_after_s * (1.0 + rng.random() / 2), 1)
    return ProtocolError(ErrorCode.SERVER_BUSY, f"{who} holds {max_sessions} sessions already; retry in "
                         f"{wait:g} s", close=CLOSE_TRY_AGAIN, retry_after_s=wait)


def _utf8(text: str) -> bytes:
    """A key as bytes, for hmac.compare_digest (which refuses str beyond ASCII); lone surrogates included."""
    return text.encode("utf-8", "surrogatepass")


PAGE_SUBPROTOCOL = "lingbot"        # what the page offers, and the ingress accepts, as its WebSocket subprotocol
KEY_SUBPROTOCOL = "lingbot-key."    # + the key as unpadded base64url of its UTF-8: a second subprotocol offered


def _subprotocols(headers: dict) -> list[str]:
    return [p.strip() for p in headers.get("sec-websocket-protocol", "").split(",") if p.strip()]


def subprotocol_key(headers: dict) -> str:
    """The key a page offers as a subprotocol (browsers cannot set a WebSocket's headers, and a key in a URL ends
    up in the history and in proxies' logs); "" when it offers none or one that is not base64url."""
    for offered in _subprotocols(headers):
        if offered.startswith(KEY_SUBPROTOCOL):
            encoded = offered[len(KEY_SUBPROTOCOL):]
            try:
                return base64.urlsafe_b64decode(encoded + "=" * (-len(encoded) % 4)).decode("utf-8")
            except (ValueError, UnicodeDecodeError):
                return ""
    return ""


def accepted_subprotocol(headers: dict) -> Optional[str]:
    """The subprotocol the ingress answers with: the page's when offered (a browser that offered subprotocols
    drops a connection whose answer names none), else none."""
    return PAGE_SUBPROTOCOL if PAGE_SUBPROTOCOL in _subprotocols(headers) else None


class FailedKeys:
    """Wrong API keys per client address over the last minute: past `limit` the address is refused (rate_limited)
    before any key of it is compared, until the oldest failure leaves the window (a key guessed by trying is
    bounded by it). Addresses without a recent failure are forgotten."""

    def __init__(self, limit: int):
        self.limit = limit                                  # 0: no limit (nothing kept)
        self.times: dict[str, deque] = {}
        self.swept_at = 0.0

    def blocked(self, address: str, now: float) -> Optional[ProtocolError]:
        times = self.times.get(address)
        if not self.limit or not times:
            return None
        while times and now - times[0] >= WINDOW_S:
            times.popleft()
        if len(times) < self.limit:
            return None
        return ProtocolError(ErrorCode.RATE_LIMITED, f"{self.limit} wrong API keys from this address within a "
                             "minute; try again later", close=CLOSE_TRY_AGAIN,
                             retry_after_s=round(WINDOW_S - (now - times[0]), 1))

    def failed(self, address: str, now: float) -> None:
        if not self.limit:
            return
        if now - self.swept_at >= WINDOW_S:
            self.times = {a: t for a, t in self.times.items() if t and now - t[-1] < WINDOW_S}
            self.swept_at = now
        self.times.setdefault(address, deque(maxlen=self.limit)).append(now)


def presented_key(headers: dict, query: dict, keys: frozenset) -> Optional[str]:
    """The configured key the client presents: `Authorization: Bearer KEY` (or `X-API-Key: KEY`) for
    programs, a `lingbot-key.` subprotocol for pages (subprotocol_key), or `?api_key=KEY` (kept for clients
    that can do neither; a URL is logged where headers are not). None if it presents none of them; "" when no
    keys are configured (everyone is let in). Compared in constant time, as UTF-8 bytes: any text a client
    sends is a key that matches or not, never an error."""
    if not keys:
        return ""
    auth = headers.get("authorization", "")
    presented = {auth[7:].strip() if auth.lower().startswith("bearer ") else "", headers.get("x-api-key", ""),
                 subprotocol_key(headers), query.get("api_key", "")}
    return next((k for k in sorted(keys) for p in presented if p and hmac.compare_digest(_utf8(k), _utf8(p))), None)


def authorized(headers: dict, query: dict, keys: frozenset) -> bool:
    """True when no keys are configured, or the client presents one (see presented_key)."""
    return presented_key(headers, query, keys) is not None


def too_many_connections(cap: int) -> ProtocolError:
    """The refusal of a connection from an address that holds `cap` already (max_connections_per_address)."""
    return ProtocolError(ErrorCode.TOO_MANY_CONNECTIONS, f"this address holds {cap} connections already "
                         "(max_connections_per_address)", close=CLOSE_TRY_AGAIN, retry_after_s=5)


def host_allowed(headers: dict, allowed: frozenset) -> bool:
    """A WebSocket handshake's Host: an IP address (a page cannot rebind one), a name in `allowed` (the
    `allowed_hosts` setting, localhost by default), or anything when `allowed` holds "*". A name elsewhere is
    refused: under DNS rebinding a page's own name resolves to this server, so Origin and Host agree and only
    the name gives it away."""
    if "*" in allowed:
        return True
    host = headers.get("host", "").strip()
    if host.startswith("["):                                   # [v6]:port
        name = host[1:host.find("]")] if "]" in host else ""
    else:
        name = host.rsplit(":", 1)[0] if host.count(":") == 1 else host
    name = name.lower().rstrip(".")
    if not name:
        return False
    try:
        ipaddress.ip_address(name)
        return True
    except ValueError:
        return name in allowed


def origin_allowed(headers: dict, allowed: frozenset) -> bool:
    """A WebSocket handshake's Origin: absent (programs send none), the page's own (the same host and port
    as the request), listed in `allowed`, or anything when `allowed` holds "*"."""
    origin = headers.get("origin")
    if origin is None or "*" in allowed or origin.rstrip("/") in allowed:
        return True
    from urllib.parse import urlsplit
    return urlsplit(origin).netloc.lower() == headers.get("host", "").lower()


LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")


def beyond_loopback(host: str) -> bool:
    """Whether a listening address reaches beyond this machine (0.0.0.0, ::, a LAN or public address, a name)."""
    return not (host in LOOPBACK_NAMES or host.startswith("127."))


def exposure_refusal(host: str, keys: frozenset, allow_anonymous: bool) -> Optional[str]:
    """Why an app must not serve on `host` (None: it may): beyond this machine without api_keys, unless the
    deployment says allow_anonymous on purpose."""
    if keys or allow_anonymous or not beyond_loopback(host):
        return None
    return (f"lingbot-serve refuses to listen on {host} without api_keys: anyone who reaches it could open sessions "
            "on its model groups. Set api_keys (or LINGBOT_API_KEYS; the cluster manifests read them from their "
            "Secret), listen on 127.0.0.1 (http_options.host), or set allow_anonymous: true to serve everyone on "
            "purpose.")
