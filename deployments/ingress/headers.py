"""Security headers on every HTTP answer of the ingress (the page, its static files, health, readiness, config,
and the 404s and 405s): an ASGI middleware, so no route can forget them.

The Content-Security-Policy fits the page (deployments/ingress/static): its scripts and the config come from
the server itself, the WebSockets go back to it ('self' covers ws: and wss: on the page's host), the video plays
from a MediaSource (blob:), the first-frame preview and the favicon are data: URLs; its one <style> block and
three style attributes need inline styles. Nothing else loads, no page may frame it (frame-ancestors, and
X-Frame-Options for older browsers), no response is sniffed into another type, and no Referer leaves it (the
page's URL may carry ?api_key=)."""
from __future__ import annotations

CONTENT_SECURITY_POLICY = "; ".join([
    "default-src 'none'",
    "script-src 'self'",
    "style-src 'self' 'unsafe-inline'",
    "img-src 'self' data: blob:",
    "media-src 'self' blob:",
    "connect-src 'self'",
    "base-uri 'none'",
    "form-action 'none'",
    "frame-ancestors 'none'",
])
HEADERS = [(name.encode(), value.encode()) for name, value in [
    ("content-security-policy", CONTENT_SECURITY_POLICY),
    ("x-content-type-options", "nosniff"),
    ("x-frame-options", "DENY"),
    ("referrer-policy", "no-referrer"),
]]
NAMES = frozenset(name for name, _ in HEADERS)


class SecurityHeaders:
    """ASGI middleware: HEADERS on the start of every HTTP response (WebSockets pass through untouched)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def send_with_headers(message):
            if message["type"] == "http.response.start":       # a route's own values give way to these
                kept = [h for h in message.get("headers", []) if bytes(h[0]).lower() not in NAMES]
                message = {**message, "headers": [*kept, *HEADERS]}
            await send(message)
        return await self.app(scope, receive, send_with_headers)
