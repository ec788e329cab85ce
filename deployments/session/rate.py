"""How fast a session's client may send: a token bucket of `per_s` messages a second, holding at most
`2 * per_s` (a burst, e.g. a keyboard's repeat after a pause). A message past it is dropped; the client hears
`rate_limited` at most once a second, so a flood is not answered with a flood. Keepalives count too: each is
an answer the server sends. Plain Python."""
from __future__ import annotations

from typing import Optional

from .codes import ErrorCode, ProtocolError


class MessageRate:
    def __init__(self, per_s: float, now: float):
        self.per_s = per_s
        self.capacity = 2.0 * per_s
        self.tokens = self.capacity
        self.at = now
        self.dropped = 0                                # messages dropped over the session's life
        self._told_at: Optional[float] = None

    def take(self, now: float) -> bool:
        """Whether a message arriving now may be handled (False: it is dropped)."""
        self.tokens = min(self.capacity, self.tokens + (now - self.at) * self.per_s)
        self.at = now
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return True
        self.dropped += 1
        return False

    def refusal(self, now: float) -> Optional[ProtocolError]:
        """The rate_limited refusal for a dropped message, or None when the client was told within a second."""
        if self._told_at is not None and now - self._told_at < 1.0:
            return None
        self._told_at = now
        return ProtocolError(ErrorCode.RATE_LIMITED, f"more than {self.per_s:g} messages a second; messages are "
                             "dropped until the rate falls", retry_after_s=round((1.0 - self.tokens) / self.per_s, 3))
