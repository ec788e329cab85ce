"""A session's playback clock at its group: when its next chunk is due at the player, how many of its chunks are
in flight (generated, not yet delivered), and what each delivery says about the player (slack, stalls), which
its Pacer learns from (scheduler.py's docstring tells the whole pacing story). Plain Python."""
from __future__ import annotations

import time
from collections import deque
from typing import Optional

from .pacer import Pacer


class PlaybackClock:
    """Playback of one session: its player starts when the first chunk is delivered; chunk k (k >= 1) is due
    when the video before it has played out."""

    def __init__(self, fps: float, max_in_flight: int = 2, now: Optional[float] = None, pacer: Optional[Pacer] = None):
        self.fps = fps
        self.max_in_flight = max_in_flight
        self.created = time.monotonic() if now is None else now
        self.frames_generated = 0                    # frames of the chunks the ranks returned
        self.frames_delivered = 0                    # frames of the chunks whose fragment reached the stream
        self.in_flight = 0
        self.first_delivery: Optional[float] = None
        self.stalls = 0
        self.stall_seconds = 0.0
        self.pacer = pacer                           # set by the Scheduler when it takes the session
        self.last_slack: Optional[float] = None     # how early the last delivered chunk arrived (s)
        self.ready_since = self.created             # since when the in-flight bound allows another chunk
        self.picked_eligible: Optional[float] = None    # set by Scheduler.pick for the chunk it hands out
        self.eligible_times: deque[float] = deque()     # per chunk in flight: when it became eligible

    @property
    def below_bound(self) -> bool:
        """Whether the in-flight bound allows another chunk."""
        return self.in_flight < self.max_in_flight

    def deadline(self) -> float:
        """When the next chunk to generate is due at the player."""
        if self.first_delivery is None:
            return self.created                      # the first chunk is due at once
        return self.first_delivery + self.frames_generated / self.fps

    def resume_at(self, playback_end: float, now: Optional[float] = None, wall: Optional[float] = None) -> None:
        """Go on where the client's player is: `playback_end` (wall clock) is when it runs out of video."""
        now = time.monotonic() if now is None else now
        wall = time.time() if wall is None else wall
        self.first_delivery = now + (playback_end - wall)

    def generated(self, frames: int, now: Optional[float] = None) -> None:
        """The ranks returned a chunk of `frames` frames; it is in flight until delivered."""
        now = time.monotonic() if now is None else now
        self.frames_generated += frames
        self.in_flight += 1
        self.eligible_times.append(now if self.picked_eligible is None else self.picked_eligible)
        self.picked_eligible = None
        if self.in_flight < self.max_in_flight:
            self.ready_since = now

    def _released(self, now: float) -> float:
        """A chunk left the in-flight count: if that freed the bound, the session is ready from now. Returns
        the time from when the chunk became eligible to now."""
        if self.in_flight == self.max_in_flight:
            self.ready_since = now
        self.in_flight = max(0, self.in_flight - 1)
        eligible = self.eligible_times.popleft() if self.eligible_times else now
        return now - eligible

    def delivered(self, frames: int, now: Optional[float] = None) -> None:
        now = time.monotonic() if now is None else now
        need = self._released(now)
        if self.first_delivery is None:
            self.first_delivery = now
        else:
            late = now - (self.first_delivery + self.frames_delivered / self.fps)
            self.last_slack = -late
            if self.pacer is not None:
                self.pacer.observe(need, -late)
            if late > 0:                             # the player ran dry before this chunk arrived
                self.stalls += 1
                self.stall_seconds += late
                self.first_delivery += late          # playback resumes now
        self.frames_delivered += frames

    def undelivered(self) -> None:
        """A chunk in flight will not be delivered (the session ended or failed meanwhile)."""
        self._released(time.monotonic())
