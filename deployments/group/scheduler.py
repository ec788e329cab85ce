"""A group's sessions and which one runs a chunk next: earliest-deadline-first within each session's lead.

Plain Python (no Ray): the group's chunk loop (chunk_loop.py) owns one `Scheduler` of `ScheduledSession`s; tests
drive it directly. A ScheduledSession is made of one part per job: its playback clock (playback.py), its
controls (planner.py), the replay of a resumed session, and the snapshot references on their way to the
ingress; it coordinates them at a chunk's commit and at a resume.

Playback clock: a session's player starts when its first chunk is delivered; chunk k (k >= 1) is due
when the video before it has played out: deadline = first_delivery + frames before it / fps. The
scheduler runs the session with the earliest deadline among those within their lead, and never lets a
session's video run further ahead of playback than its lead (it idles instead), so no session runs far
ahead while another is late.

The lead trades stalls against interactivity: everything generated ahead of playback plays before a new
control can show. With `pacing: fixed` it is `pacing_lead_s`. With `pacing: adaptive` each session's
`Pacer` learns it. A chunk becomes eligible when it is within the lead of its due time (and the session's
in-flight bound allows it); what the lead must cover is the time from then to the chunk's delivery: the
wait for the device (other sessions' chunks) plus its own generation, encode and send. Each delivery
records that time; the lead becomes the `pacing_quantile` of the recent ones plus `pacing_margin_s`,
within [`pacing_margin_s`, `pacing_lead_s`]. A stall raises it at once by the time the player waited.
So the buffer the player holds, and with it the control-to-display latency, follow the measured jitter
instead of a fixed worst case.

A chunk is generated when the ranks return it, and delivered when its fMP4 fragment reaches the session's
stream; between the two (device-to-host copy, encode, send) the ranks already run the next chunk. At most
`max_in_flight` chunks of a session are generated but not yet delivered.
"""
from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Iterable
from typing import Optional

from lingbot.config import LINGBOT_GEOMETRY, ChunkGeometry

from ..session.events import ChunkControls, Resume, SnapshotRef
from ..session.requests import StartRequest
from .ladder import AT_FULL, ChunkRung
from .pacer import Pacer
from .planner import ChunkPlan, ControlPlanner
from .playback import PlaybackClock


class Replay:
    """A resumed session's delivered chunks after its restore point, run again (nothing delivered) before it
    goes on: their controls (the journal's), when the replay started, and the chunk the snapshots put it at."""

    def __init__(self):
        self.chunks: deque[ChunkControls] = deque()
        self.started: Optional[float] = None
        self.restored = 0

    def __bool__(self) -> bool:
        return bool(self.chunks)


class SnapshotBuffer:
    """The snapshot references the ranks reported (with a chunk's replies, or flushed when the session moves),
    until they go to the ingress with the next delivered chunk (or with Moving)."""

    def __init__(self):
        self.refs: list[SnapshotRef] = []

    def take(self, per_rank: Iterable[Iterable[SnapshotRef]]) -> None:
        self.refs += [ref for stored in per_rank for ref in stored]

    def give(self) -> tuple[SnapshotRef, ...]:
        out, self.refs = tuple(self.refs), []
        return out


class ScheduledSession:
    """A session as its group schedules it: its start, its chunk counter, and one part per job (clock,
    planner, replay, snapshots)."""

    def __init__(self, session_id: str, start: StartRequest, geometry: ChunkGeometry = LINGBOT_GEOMETRY,
                 max_queued_controls: int = 64, now: Optional[float] = None, max_in_flight: int = 2,
                 pacer: Optional[Pacer] = None):
        self.id = session_id
        self.start = start
        self.geometry = geometry
        self.next_chunk = 0
        self.stopped = False
        self.clock = PlaybackClock(start.fps, max_in_flight, now, pacer)
        self.planner = ControlPlanner(start.action_script, geometry.latent_frames, max_queued_controls,
                                      start.profile)
        self.replay = Replay()
        self.snapshots = SnapshotBuffer()

    @property
    def finished(self) -> bool:
        return self.stopped or (self.start.chunks is not None and self.next_chunk >= self.start.chunks)

    @property
    def ready(self) -> bool:
        """Whether the session may start another chunk (not finished, in-flight bound not reached)."""
        return not self.finished and self.clock.below_bound

    def plan_next_chunk(self, rung: ChunkRung = AT_FULL, restarted: bool = False) -> ChunkPlan:
        """The whole plan of the session's next chunk at `rung` (ControlPlanner.plan)."""
        return self.planner.plan(self.next_chunk, rung, restarted)

    def commit_plan(self, plan: ChunkPlan) -> None:
        """The ranks ran the planned chunk: its controls are spent, and the chunk is in flight."""
        self.planner.commit(plan)
        self.next_chunk = plan.index + 1
        self.clock.generated(self.geometry.pixel_frames(plan.index))

    def resume_from(self, resume: Resume, restored: int = 0, now: Optional[float] = None,
                    wall: Optional[float] = None) -> None:
        """Continue a session another group ran, its ranks restored to chunk `restored` (from snapshots; 0:
        none): the delivered chunks after it are replayed first (replayed()), then planning goes on from the
        interaction state after the last of them. The playback clock goes on where the client's player is
        (resume.playback_end, a wall-clock time): the next chunk is due when the video the client holds has
        played out, not at once (so a session moved with a full buffer does not run further ahead)."""
        if resume.playback_end is not None:
            self.clock.resume_at(resume.playback_end, now, wall)
        self.replay.restored = self.next_chunk = restored
        self.replay.chunks = deque(resume.journal[restored:])
        if resume.interactions is not None:
            self.planner.restore(resume.interactions)

    def replayed(self) -> None:
        """The ranks ran the next replay chunk again (nothing is delivered)."""
        self.replay.chunks.popleft()
        self.next_chunk += 1

class Scheduler:
    """Picks the next session to run a chunk for, each within its lead: late sessions first, then those with
    a control queued, then earliest deadline first."""

    def __init__(self, pacing_lead_s: float, adaptive: bool = False, margin_s: float = 0.1, q: float = 0.9):
        self.pacing_lead_s = pacing_lead_s
        self.adaptive = adaptive
        self.margin_s = margin_s
        self.q = q
        self.sessions: dict[str, ScheduledSession] = {}

    def add(self, state: ScheduledSession) -> None:
        """A session to schedule; one that asked for no pacing (realtime_output_pacing: false) has an unbounded
        lead: always eligible, it runs after every paced session that may run (pick)."""
        if state.clock.pacer is None:
            state.clock.pacer = Pacer(self.pacing_lead_s, self.adaptive, self.margin_s, self.q) if state.start.paced \
                else Pacer(math.inf)
        self.sessions[state.id] = state

    def remove(self, session_id: str) -> Optional[ScheduledSession]:
        return self.sessions.pop(session_id, None)

    def pick(self, now: Optional[float] = None) -> tuple[Optional[ScheduledSession], float]:
        """(session to run now, 0) or (None, seconds to wait before the earliest becomes due)."""
        now = time.monotonic() if now is None else now
        ready = [s for s in self.sessions.values() if s.ready]
        if not ready:
            return None, math.inf
        # a resumed session's replay delivers nothing: it catches up at once, whatever its playback clock
        waits = {s.id: 0.0 if s.replay else s.clock.deadline() - now - s.clock.pacer.lead_s for s in ready}
        eligible = [s for s in ready if waits[s.id] <= 0]
        if not eligible:
            return None, min(waits.values())

        def due(s: ScheduledSession) -> float:
            # a resumed session's replay fills the gaps: never "late", so due chunks of others go first
            return now + s.clock.pacer.lead_s if s.replay else s.clock.deadline()
        # a session whose player would wait goes first; then one with a control queued (it shows a chunk
        # sooner and never waits behind more than the chunk running now); then earliest deadline first. An
        # unpaced session goes after every paced one that may run, its controls included: it takes only the
        # time the others leave
        best = min(eligible, key=lambda s: (due(s) >= now, not s.start.paced, not s.planner.pending, due(s)))
        best.clock.picked_eligible = max(best.clock.deadline() - best.clock.pacer.lead_s, best.clock.ready_since)
        return best, 0.0
