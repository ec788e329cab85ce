"""The ingress's access checks by hand (deployments/ingress/access.py, deployments/addresses.py): tenants' start
windows and session counts, origins, keys (headers, the page's subprotocol), trusted proxies, Host names, and the
busy answer beyond an ingress's sessions. Served: tests/deployments/test_limits.py."""
import pytest


def test_tenants_without_a_recent_start_are_forgotten():
    """The start windows of tenants that have not started for a minute are dropped (a public server keyed by
    address would keep every address it ever saw otherwise)."""
    from deployments.ingress.access import TenantLimits
    limits = TenantLimits(max_starts_per_minute=5)
    for i in range(100):
        assert limits.admit(f"addr:{i}", 0.0) is None
        limits.release(f"addr:{i}")
    assert len(limits.starts) == 100
    assert limits.admit("addr:new", 59.0) is None and len(limits.starts) == 101      # within the minute: kept
    assert limits.admit("addr:later", 61.0) is None and set(limits.starts) == {"addr:new", "addr:later"}


def test_tenant_limits_by_hand():
    from deployments.ingress.access import TenantLimits
    limits = TenantLimits(max_sessions=2, max_starts_per_minute=3)
    assert limits.admit("a", 0.0) is None and limits.admit("a", 1.0) is None
    busy = limits.admit("a", 2.0)                                # a third at once
    assert (busy.code, busy.close, busy.extra["retry_after_s"]) == ("too_many_sessions", 1013, 5)
    assert limits.admit("b", 2.0) is None                        # another tenant is not affected
    limits.release("a")
    assert limits.admit("a", 10.0) is None                       # third start of "a" within the minute
    limits.release("a")
    rate = limits.admit("a", 30.0)                               # a fourth: the window holds 0, 1, 10
    assert (rate.code, rate.close, rate.extra["retry_after_s"]) == ("rate_limited", 1013, 30.0)
    assert limits.admit("a", 60.0) is None                       # the start at 0 has left the window
    assert limits.active == {"a": 2, "b": 1}
    unlimited = TenantLimits()
    assert all(unlimited.admit("x", float(t)) is None for t in range(100))


def test_origins_and_keys_by_hand():
    from deployments.ingress.access import origin_allowed, presented_key
    own = {"host": "127.0.0.1:8000"}
    assert origin_allowed(own, frozenset())                                          # programs: no Origin
    assert origin_allowed({**own, "origin": "http://127.0.0.1:8000"}, frozenset())   # the page's own
    assert not origin_allowed({**own, "origin": "https://evil.example"}, frozenset())
    assert origin_allowed({**own, "origin": "https://app.example"}, frozenset({"https://app.example"}))
    assert origin_allowed({**own, "origin": "https://evil.example"}, frozenset({"*"}))
    keys = frozenset({"k1", "k2"})
    assert presented_key({"authorization": "Bearer k2"}, {}, keys) == "k2"
    assert presented_key({}, {"api_key": "k1"}, keys) == "k1"
    assert presented_key({}, {}, keys) is None and presented_key({}, {}, frozenset()) == ""
    # text beyond ASCII (a query string decodes %C3%A9 to "é", headers arrive as Latin-1) is a key that does not
    # match, never an error; a configured key beyond ASCII matches itself only
    for text in ("é", "k1é", "\udce9", "\x00"):
        assert presented_key({"authorization": f"Bearer {text}", "x-api-key": text}, {"api_key": text}, keys) is None
    assert presented_key({}, {"api_key": "clé"}, frozenset({"clé"})) == "clé"


def test_the_client_behind_trusted_proxies_is_the_last_address_they_did_not_add():
    """X-Forwarded-For is read only from a trusted proxy, from the right, over every line of it (a proxy may add
    its own line after the client's): the first hop that is not a trusted proxy is the client; what a client
    wrote to the left of it is never read; a hop's port is dropped."""
    import ipaddress

    from deployments.addresses import client_address
    from deployments.settings import ServeSettings
    from lingbot.config import ConfigError
    trusted = (ipaddress.ip_network("10.0.0.0/8"), ipaddress.ip_network("::1/128"))

    def xff(*lines: str) -> list[str]:
        return list(lines)
    assert client_address("203.0.113.9", xff("198.51.100.1"), trusted) == "203.0.113.9"   # not from a proxy
    assert client_address("10.1.2.3", xff("198.51.100.1"), trusted) == "198.51.100.1"
    assert client_address("10.1.2.3", xff("1.1.1.1, 198.51.100.1, 10.9.9.9"), trusted) == "198.51.100.1"
    assert client_address("::1", xff("2001:db8::5"), trusted) == "2001:db8::5"
    assert client_address("10.1.2.3", [], trusted) == "10.1.2.3"                 # a proxy that names no one
    assert client_address("10.1.2.3", xff("6.6.6.6", "198.51.100.1"), trusted) == "198.51.100.1"  # its own line
    assert client_address("10.1.2.3", xff("198.51.100.1:5678"), trusted) == "198.51.100.1"
    assert client_address("10.1.2.3", xff("[2001:db8::5]:443, 10.9.9.9"), trusted) == "2001:db8::5"
    assert client_address("10.1.2.3", xff("10.0.0.7, 10.9.9.9"), trusted) == "10.0.0.7"    # all proxies: the first
    assert client_address("10.1.2.3", xff("1.1.1.1"), ()) == "10.1.2.3"          # trusted_proxies empty
    assert ServeSettings(trusted_proxies="10.0.0.0/8, ::1").trusted_proxy_networks == trusted
    with pytest.raises(ConfigError, match=r"trusted_proxies 'proxy\.local' must be addresses or networks"):
        ServeSettings(trusted_proxies="proxy.local")


def test_a_page_offers_its_key_as_a_subprotocol():
    """A browser cannot set a WebSocket's headers; the page offers `lingbot` and `lingbot-key.` + the key's UTF-8
    in unpadded base64url as subprotocols (a key in a URL ends up in the history and in proxies' logs), and the
    ingress answers `lingbot`."""
    import base64

    from deployments.ingress.access import accepted_subprotocol, presented_key, subprotocol_key

    def offer(key: str) -> dict:
        encoded = base64.urlsafe_b64encode(key.encode()).decode().rstrip("=")
        return {"sec-websocket-protocol": f"lingbot, lingbot-key.{encoded}"}
    keys = frozenset({"k1", "clé/+?"})
    assert offer("clé/+?")["sec-websocket-protocol"] == "lingbot, lingbot-key.Y2zDqS8rPw"
    assert presented_key(offer("clé/+?"), {}, keys) == "clé/+?" and presented_key(offer("k1"), {}, keys) == "k1"
    assert presented_key(offer("k2"), {}, keys) is None
    for junk in ("lingbot-key.", "lingbot-key.@@@", "lingbot-key.gA", "lingbot-key.k1", "lingbot-key.a"):
        assert subprotocol_key({"sec-websocket-protocol": junk}) == ""     # not base64url of UTF-8: no key
        assert presented_key({"sec-websocket-protocol": junk}, {}, keys) is None
    assert accepted_subprotocol(offer("k1")) == "lingbot" and accepted_subprotocol({}) is None
    assert accepted_subprotocol({"sec-websocket-protocol": "chat, superchat"}) is None
    assert presented_key({}, {"api_key": "cle"}, frozenset({"clé"})) is None


def test_a_connection_beyond_the_ingress_sessions_is_busy_with_a_jittered_retry():
    import random

    from deployments.ingress.access import busy
    rng = random.Random(5)
    assert busy(64, 64, 10.0, rng) is None                    # the 64th is served
    refusals = [busy(65, 64, 10.0, rng) for _ in range(200)]
    assert all(r.code == "server_busy" and r.close == 1013 for r in refusals)
    waits = [r.extra["retry_after_s"] for r in refusals]
    assert 10.0 <= min(waits) < 10.5 and 14.5 < max(waits) <= 15.0 and len(set(waits)) > 20
    assert refusals[0].message == f"this server holds 64 sessions already; retry in {waits[0]:g} s"


def test_hosts_by_hand():
    from deployments.ingress.access import host_allowed
    local = frozenset({"localhost"})
    for host in ("localhost:8000", "LOCALHOST", "localhost.", "127.0.0.1:8000", "10.1.2.3", "[::1]:8000", "[::1]",
                 "::1"):
        assert host_allowed({"host": host}, local), host
    for host in ("evil.example:8000", "localhost.evil.example", "127.0.0.1.nip.io:8000", "", "[::1", ":8000"):
        assert not host_allowed({"host": host}, local), host
    assert not host_allowed({}, local)                                   # no Host at all
    assert host_allowed({"host": "world.example.com:443"}, frozenset({"world.example.com"}))
    assert host_allowed({"host": "anything.example"}, frozenset({"*"}))


def test_an_ipv6_client_is_its_64_for_the_per_address_limits_and_no_proxy_is_trusted_for_everyone():
    from deployments.addresses import limit_key
    from deployments.settings import ServeSettings
    from lingbot.config import ConfigError
    assert limit_key("2001:db8:1:2::1") == limit_key("2001:db8:1:2:ffff:1:2:3") == "2001:db8:1:2::/64"
    assert limit_key("2001:db8:1:3::1") == "2001:db8:1:3::/64"
    assert limit_key("203.0.113.7") == "203.0.113.7" and limit_key("::ffff:203.0.113.7") == "203.0.113.7"
    assert limit_key("?") == "?"
    for everyone in ("0.0.0.0/0", "10.0.0.0/8, ::/0"):
        with pytest.raises(ConfigError, match="trusts every address"):
            ServeSettings(trusted_proxies=everyone)
    assert ServeSettings(trusted_proxies="10.0.0.0/8").trusted_proxy_networks


def test_a_tenant_holds_at_most_the_deployments_seats():
    """max_sessions_per_key (8) bounds a tenant, and so do the deployment's seats: with 2 seats one tenant cannot
    hold 2 sessions and 6 more in the queue."""
    from deployments.settings import ServeSettings
    assert ServeSettings(max_groups=1, max_sessions_per_group=2).tenant_session_limit == 2
    assert ServeSettings(max_groups=4, max_sessions_per_group=4).tenant_session_limit == 8
    assert ServeSettings(max_sessions_per_key=0).tenant_session_limit == 0
