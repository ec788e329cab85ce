"""How far ahead of its playback a session may generate: `Pacer` (fixed, or learned from the session's own
chunks; deployments/group/scheduler.py's docstring tells the whole pacing story). Plain Python."""
from __future__ import annotations

from collections import deque

from lingbot.stats import percentile


class Pacer:
    """How far ahead of its playback a session may generate (seconds): fixed, or learned from how long its
    recent chunks took from eligible to delivered (module docstring)."""

    def __init__(self, max_lead_s: float, adaptive: bool = False, margin_s: float = 0.1, q: float = 0.9,
                 window: int = 8, min_samples: int = 4):
        self.max_lead_s = max_lead_s
        self.adaptive = adaptive
        self.margin_s = min(margin_s, max_lead_s)
        self.q = q
        self.min_samples = min_samples
        self.needs: deque[float] = deque(maxlen=window)
        self.lead_s = max_lead_s                      # until the session has shown what it needs

    def hold_lead(self, lead_s: float) -> None:
        """From now on exactly `lead_s`, whatever the chunks need (a group that is about to hand the session
        on fills its viewer's buffer first)."""
        self.adaptive = False
        self.max_lead_s = max(self.max_lead_s, lead_s)
        self.lead_s = lead_s

    def observe(self, need_s: float, slack_s: float) -> None:
        """A chunk took `need_s` from eligible to delivered and arrived `slack_s` before it was due
        (negative: the player waited that long)."""
        self.needs.append(need_s)
        if not self.adaptive:
            return
        wanted = self.lead_s
        if len(self.needs) >= self.min_samples:
            wanted = percentile(self.needs, self.q) + self.margin_s
        if slack_s < 0:                               # a stall: more lead at once, by the wait it caused
            wanted = max(wanted, self.lead_s - slack_s)
        self.lead_s = min(self.max_lead_s, max(self.margin_s, wanted))
