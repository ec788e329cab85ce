"""A session's controls at its group: the interactions queued for the next chunk boundary, what is left of each
running one (camera transition, key script, prompt transition), the held keys, and the controls every rank
applies to each chunk (`ChunkPlan`: its controls, rung included, and its interactions). Planning is pure; a plan
is committed once the ranks ran its chunk, so a chunk given up or failed leaves the interactions where they were.
Plain Python."""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, replace
from typing import Optional

from ..session.events import ChunkControls, InteractionState
from ..session.requests import Interaction
from .ladder import AT_FULL, ChunkRung


@dataclass
class _Progress:
    """What is left of one interaction's parts."""
    event_id: str
    camera_chunks: Optional[int] = None         # None: no camera part; -1: until replaced (velocity)
    keys: Optional[list] = None                 # latent-frame key sets not yet applied
    prompt_chunks: Optional[int] = None

    def done(self) -> bool:
        return self.camera_chunks in (None, 0) and not self.keys and self.prompt_chunks in (None, 0)


def _copy_events(events: dict) -> dict:
    return {eid: replace(p, keys=None if p.keys is None else list(p.keys)) for eid, p in events.items()}


@dataclass
class ChunkPlan:
    index: int
    controls: ChunkControls                     # what every rank applies, the rung's steps and decoder included
    started: list[str]
    active: list[str]
    completed: list[str]
    rung: ChunkRung = AT_FULL                   # the rung it runs at (what the ladder learns its cost at)
    restarted: bool = False                     # run again once, with a control that arrived in its probes
    interactions: Optional[InteractionState] = None   # the interaction state once the chunk is committed


class ControlPlanner:
    """One session's interactions and the controls of its chunks: `action_script` (keys per chunk, from the
    start) until an interaction replaces it; `frames_per_chunk` key sets per chunk."""

    def __init__(self, action_script: list, frames_per_chunk: int, max_queued: int = 64, profile: bool = False):
        self.action_script = action_script
        self.frames_per_chunk = frames_per_chunk
        self.max_queued = max_queued
        self.profile = profile
        self.pending: deque[Interaction] = deque()
        self.events: dict[str, _Progress] = {}
        self.held: Optional[str] = None          # held keys (None: no key-state event yet, or a script replaced it)
        # plan()'s outcome, taken over by commit() once the ranks ran the chunk
        self._planned: dict[str, _Progress] = {}
        self._planned_held: Optional[str] = None

    def queue(self, interaction: Interaction) -> bool:
        """Queue an interaction for the next chunk boundary; False when the queue is full."""
        if len(self.pending) >= self.max_queued:
            return False
        self.pending.append(interaction)
        return True

    def restore(self, state: InteractionState) -> None:
        """The interaction state another group left after a chunk (a resumed session; from a saved world its
        events are plain maps)."""
        self.events = _copy_events({eid: _Progress(eid, **p) if isinstance(p, dict) else p
                                    for eid, p in state.events.items()})
        self.held = state.held

    def plan(self, k: int, rung: ChunkRung = AT_FULL, restarted: bool = False) -> ChunkPlan:
        """Controls of chunk `k` at `rung` (its steps, decoder and a decoder to warm) and the event ids it starts,
        runs and completes; `restarted`: run again with a control that arrived in its probes. Pure planning: call
        commit() once the chunk succeeded."""
        events = {eid: _Progress(p.event_id, p.camera_chunks, None if p.keys is None else list(p.keys),
                                 p.prompt_chunks) for eid, p in self.events.items()}
        controls = ChunkControls(profile=self.profile, steps=rung.rung.steps, decoder=rung.decoder,
                                 prewarm=rung.prewarm)
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
        elif k < len(self.action_script):
            controls.keys = tuple(self.action_script[k])
        self._planned_held = held
        active = list(events)
        for prog in events.values():                 # one chunk of every running part has now run
            if prog.camera_chunks is not None and prog.camera_chunks > 0:
                prog.camera_chunks -= 1
            if prog.prompt_chunks is not None and prog.prompt_chunks > 0:
                prog.prompt_chunks -= 1
        completed += [eid for eid, prog in events.items() if prog.done()]
        self._planned = {eid: p for eid, p in events.items() if not p.done()}
        return ChunkPlan(k, controls, started, active, completed, rung, restarted)

    def commit(self, plan: ChunkPlan) -> None:
        """The ranks ran the planned chunk: its controls are spent; the plan records the state after it."""
        for _ in plan.started:
            self.pending.popleft()
        self.events = self._planned
        self.held = self._planned_held
        plan.interactions = InteractionState(_copy_events(self.events), self.held)
