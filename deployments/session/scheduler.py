"""A group's sessions: interaction lifecycle, per-chunk controls, earliest-deadline-first pacing.

Plain Python (no Ray): the WorldGroup replica owns one `Scheduler` of `ScheduledSession`s; tests drive it
directly.

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
from dataclasses import dataclass, replace
from typing import Optional

from lingbot.config import LINGBOT_GEOMETRY, ChunkGeometry

from .events import ChunkControls, InteractionState, Resume, SnapshotRef
from .pacer import Pacer
from .requests import Interaction, StartRequest


@dataclass
class _Progress:
    """What is left of one interaction's parts."""
    event_id: str
    camera_chunks: Optional[int] = None         # None: no camera part; -1: until replaced (velocity)
    keys: Optional[list] = None                 # latent-frame key sets not yet applied
    prompt_chunks: Optional[int] = None

    def done(self) -> bool:
        return self.camera_chunks in (None, 0) and not self.keys and self.prompt_chunks in (None, 0)


@dataclass
class ChunkPlan:
    index: int
    controls: ChunkControls
    started: list[str]
    active: list[str]
    completed: list[str]
    restarted: bool = False                     # run again once, with a control that arrived in its probes
    interactions: Optional[InteractionState] = None   # the interaction state once the chunk is committed


class ScheduledSession:
    """A session as its group schedules it: start request, pacing clock, queued and running interactions."""

    def __init__(self, session_id: str, start: StartRequest, geometry: ChunkGeometry = LINGBOT_GEOMETRY,
                 max_queued_controls: int = 64, now: Optional[float] = None, max_in_flight: int = 2,
                 pacer: Optional[Pacer] = None):
        self.id = session_id
        self.start = start
        self.geometry = geometry
        self.frames_per_chunk = geometry.latent_frames
        self.max_queued = max_queued_controls
        self.max_in_flight = max_in_flight
        self.created = time.monotonic() if now is None else now
        self.next_chunk = 0
        self.frames_generated = 0                    # chunks the ranks returned
        self.frames_delivered = 0                    # chunks whose fragment reached the stream
        self.in_flight = 0
        self.first_delivery: Optional[float] = None
        self.pending: deque[Interaction] = deque()
        self.events: dict[str, _Progress] = {}
        self.held: Optional[str] = None              # held keys (None: no key-state event yet, or a script replaced it)
        self.replay: deque[ChunkControls] = deque()  # a resumed session's delivered chunks, to run again first
        self.replay_started: Optional[float] = None
        self.restored = 0                            # the chunk a resumed session's snapshots put it at
        self.snapshots: list[SnapshotRef] = []       # stored by the ranks, not yet passed on to the ingress
        self.stopped = False
        self.stalls = 0
        self.stall_seconds = 0.0
        self.pacer = pacer
        self.last_slack: Optional[float] = None     # how early the last delivered chunk arrived (s)
        self.ready_since = self.created             # since when the in-flight bound allows another chunk
        self.picked_eligible: Optional[float] = None    # set by Scheduler.pick for the chunk it hands out
        self.eligible_times: deque[float] = deque()     # per chunk in flight: when it became eligible
        # plan_next_chunk's outcome, taken over by commit_plan once the ranks ran the chunk
        self._planned: dict[str, _Progress] = {}
        self._planned_held: Optional[str] = None

    # ---- pacing ---------------------------------------------------------------------------------
    @property
    def finished(self) -> bool:
        return self.stopped or (self.start.chunks is not None and self.next_chunk >= self.start.chunks)

    @property
    def ready(self) -> bool:
        """Whether the session may start another chunk (not finished, in-flight bound not reached)."""
        return not self.finished and self.in_flight < self.max_in_flight

    def deadline(self) -> float:
        """When the next chunk to generate is due at the player."""
        if self.first_delivery is None:
            return self.created                      # the first chunk is due at once
        return self.first_delivery + self.frames_generated / self.start.fps

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
            late = now - (self.first_delivery + self.frames_delivered / self.start.fps)
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

    # ---- interactions -------------------------------------------------------------------------
    def queue(self, interaction: Interaction) -> bool:
        """Queue an interaction for the next chunk boundary; False when the queue is full."""
        if len(self.pending) >= self.max_queued:
            return False
        self.pending.append(interaction)
        return True

    def plan_next_chunk(self) -> ChunkPlan:
        """Controls of the next chunk and the event ids it starts, runs and completes. Pure planning:
        call commit_plan() once the chunk succeeded."""
        k = self.next_chunk
        events = {eid: _Progress(p.event_id, p.camera_chunks, None if p.keys is None else list(p.keys),
                                 p.prompt_chunks) for eid, p in self.events.items()}
        controls = ChunkControls(profile=self.start.profile)
        started, completed = [], []
        held, transitions = self.held, []
        for inter in self.pending:
            started.append(inter.event_id)
            prog = _Progress(inter.event_id)
            if inter.hold is not None:                  # key state replaces a running key script, and back
                for other in events.values():
                    other.keys = None if other.keys is None else []
                transitions += inter.hold
            if inter.camera is not None:
                for other in events.values():           # a new camera event replaces the active one
                    other.camera_chunks = None if other.camera_chunks is None else 0
                controls.camera = inter.camera
                if inter.camera.mode == "velocity":
                    prog.camera_chunks = -1
                else:
                    prog.camera_chunks = max(1, math.ceil(inter.camera.transition_chunks))
            if inter.keys is not None:
                for other in events.values():
                    other.keys = None if other.keys is None else []
                prog.keys = list(inter.keys)
                held, transitions = None, []
            if inter.prompt is not None:
                for other in events.values():
                    other.prompt_chunks = None if other.prompt_chunks is None else 0
                chunks = int(inter.transition_chunks or 0)    # a fractional count is truncated, as the reference
                controls.prompt, controls.prompt_transition_chunks = inter.prompt, chunks
                prog.prompt_chunks = max(1, chunks)
            events[inter.event_id] = prog
        # replaced events end here
        for eid, prog in list(events.items()):
            if eid not in started and prog.done():
                completed.append(eid)
                del events[eid]
        # keys for this chunk: the active keys event, else the held keys, else the start script
        n = self.frames_per_chunk
        if transitions:                              # a press and release between two chunks still shows:
            before, held = self.held or "", transitions[-1]     # on the first latent frame, with what is held
            taps = "".join(sorted(set("".join(transitions)) - set(before) - set(held)))
            hold_frames = [held + taps] + [held] * (n - 1)
        else:
            hold_frames = None if held is None else [held] * n
        keys_event = next((p for p in events.values() if p.keys), None)
        if keys_event is not None:
            frames = keys_event.keys[:n]
            keys_event.keys = keys_event.keys[n:]
            controls.keys = tuple(frames + [""] * (n - len(frames)))
        elif hold_frames is not None:
            controls.keys = tuple(hold_frames)
        elif k < len(self.start.action_script):
            controls.keys = tuple(self.start.action_script[k])
        self._planned_held = held
        active = list(events)
        for prog in events.values():                 # one chunk of every running part has now run
            if prog.camera_chunks is not None and prog.camera_chunks > 0:
                prog.camera_chunks -= 1
            if prog.prompt_chunks is not None and prog.prompt_chunks > 0:
                prog.prompt_chunks -= 1
        completed += [eid for eid, prog in events.items() if prog.done()]
        self._planned = {eid: p for eid, p in events.items() if not p.done()}
        return ChunkPlan(k, controls, started, active, completed)

    def commit_plan(self, plan: ChunkPlan) -> None:
        """The ranks ran the planned chunk: its controls are spent, and the chunk is in flight."""
        for _ in plan.started:
            self.pending.popleft()
        self.events = self._planned
        self.held = self._planned_held
        plan.interactions = InteractionState({eid: replace(p, keys=None if p.keys is None else list(p.keys))
                                for eid, p in self.events.items()}, self.held)
        self.next_chunk = plan.index + 1
        self.generated(self.geometry.pixel_frames(plan.index))

    # ---- resuming on another group ------------------------------------------------------------
    def resume_from(self, resume: Resume, restored: int = 0, now: Optional[float] = None,
                    wall: Optional[float] = None) -> None:
        """Continue a session another group ran, its ranks restored to chunk `restored` (from snapshots; 0:
        none): the delivered chunks after it are replayed first (replayed()), then planning goes on from the
        interaction state after the last of them. The playback clock goes on where the client's player is
        (resume.playback_end, a wall-clock time): the next chunk is due when the video the client holds has
        played out, not at once (so a session moved with a full buffer does not run further ahead)."""
        if resume.playback_end is not None:
            now = time.monotonic() if now is None else now
            wall = time.time() if wall is None else wall
            self.first_delivery = now + (resume.playback_end - wall)
        self.restored = self.next_chunk = restored
        self.replay = deque(resume.journal[restored:])
        if resume.interactions is not None:
            self.events = {eid: replace(p, keys=None if p.keys is None else list(p.keys))
                           for eid, p in resume.interactions.events.items()}
            self.held = resume.interactions.held

    def take_snapshots(self, per_rank: Iterable[Iterable[SnapshotRef]]) -> None:
        """The snapshot references the ranks reported: with a chunk's replies, or flushed when the session
        moves."""
        self.snapshots += [ref for stored in per_rank for ref in stored]

    def give_snapshots(self) -> tuple:
        out, self.snapshots = tuple(self.snapshots), []
        return out

    def replayed(self) -> None:
        """The ranks ran the next replay chunk again (nothing is delivered)."""
        self.replay.popleft()
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
        if state.pacer is None:
            state.pacer = Pacer(self.pacing_lead_s, self.adaptive, self.margin_s, self.q)
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
        waits = {s.id: 0.0 if s.replay else s.deadline() - now - s.pacer.lead_s for s in ready}
        eligible = [s for s in ready if waits[s.id] <= 0]
        if not eligible:
            return None, min(waits.values())

        def due(s: ScheduledSession) -> float:
            # a resumed session's replay fills the gaps: never "late", so due chunks of others go first
            return now + s.pacer.lead_s if s.replay else s.deadline()
        # a session whose player would wait goes first; then one with a control queued (it shows a chunk
        # sooner and never waits behind more than the chunk running now); then earliest deadline first
        best = min(eligible, key=lambda s: (due(s) >= now, not s.pending, due(s)))
        best.picked_eligible = max(best.deadline() - best.pacer.lead_s, best.ready_since)
        return best, 0.0
