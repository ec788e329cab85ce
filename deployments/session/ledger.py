"""A session's continuity ledger: what it takes to continue the session on another group after its group failed
or was stopped (docs/architecture.md, "Sessions that survive faults").

- the journal: every delivered chunk's controls, in order (a new group replays the ones after its restore
  point, without delivering them, and so reaches exactly the state the client saw); a prompt held over many
  chunks is one str in it, so a resume's pickle carries its text once;
- the interaction state after the last delivered chunk, and the interactions sent but not started yet
  (posted again, in order, to the new group);
- the snapshot keys worth keeping: per chunk and rank its K/V slot and its state, held by the ingress's keeper.
  A continuation after chunk k needs the state of k and the slots of the chunks k+1 attends (the model's
  window, as the group's ranks reported it: ModelFacts), every rank's; older keys are let go (`release`,
  which frees the snapshots at the keeper).

Plain Python: the ingress keeps one per session; tests drive it through faults, drains and resumes.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import replace
from typing import Optional

from .events import (
    ChunkControls,
    ChunkReady,
    InteractionState,
    ModelFacts,
    RankRestore,
    Resume,
    SnapshotOwner,
    SnapshotRef,
)
from .requests import Interaction


class ContinuityLedger:
    def __init__(self, ranks: int, release: Callable[[list[str]], None] = lambda keys: None):
        self.ranks = ranks                               # ranks per group: a restore point needs each one's share
        self.facts: Optional[ModelFacts] = None          # the admitting group's model (its K/V window)
        self.journal: list[ChunkControls] = []
        self._prompts: dict[str, str] = {}               # each prompt text journaled -> its one str
        self.interactions: Optional[InteractionState] = None
        self.frames_delivered = 0
        self.unstarted: list[Interaction] = []
        self.slots: dict[int, dict[int, str]] = {}       # chunk -> rank -> the key of its K/V slot snapshot
        self.states: dict[int, dict[int, str]] = {}      # chunk -> rank -> the key of the state after it
        self.release = release                           # keys let go: the keeper frees their snapshots
        self.play_end: Optional[float] = None            # when the client's player runs out of video (monotonic)

    @property
    def chunks(self) -> int:
        """Chunks delivered to the client."""
        return len(self.journal)

    # ---- interactions ---------------------------------------------------------------------------
    def posted(self, interaction: Interaction) -> None:
        """An interaction went to the group: owed until a delivered chunk starts it."""
        self.unstarted.append(interaction)

    def refused(self, event_id: str) -> None:
        """The group refused an interaction: it is not owed any more."""
        self.unstarted = [i for i in self.unstarted if i.event_id != event_id]

    # ---- chunks ---------------------------------------------------------------------------------
    def delivered(self, event: ChunkReady, fps: float, now: Optional[float] = None) -> None:
        """A chunk reached the client: it joins the journal; the interactions it started are no longer owed;
        the client's player (which starts at the first chunk and waits when it runs dry) plays it."""
        now = time.monotonic() if now is None else now
        self.play_end = max(self.play_end or now, now) + event.num_frames / fps
        self.journal.append(self._interned(event.controls))
        self.interactions = event.interactions
        self.frames_delivered += event.num_frames
        self.keep(event.snapshots)
        if event.started:
            started = set(event.started)
            self.unstarted = [i for i in self.unstarted if i.event_id not in started]

    def _interned(self, controls: Optional[ChunkControls]) -> Optional[ChunkControls]:
        """`controls` with its prompt the journal's own str for that text (each chunk's came over Ray as a new str,
        and pickle writes a str once per object, not once per text)."""
        if controls is None or controls.prompt is None:
            return controls
        return replace(controls, prompt=self._prompts.setdefault(controls.prompt, controls.prompt))

    # ---- snapshots ------------------------------------------------------------------------------
    def keep(self, refs: Iterable[SnapshotRef]) -> None:
        """Hold the keys a resume would restore from; older ones are let go (those that came in this call and
        are already older too: a reply may carry several snapshots)."""
        refs = list(refs)
        held = self._keys() | {r.slot for r in refs} | {r.state for r in refs if r.state is not None}
        for ref in refs:
            self.slots.setdefault(ref.chunk, {})[ref.rank] = ref.slot
            if ref.state is not None:                # None: a slot copied by a later chunk's snapshot
                self.states.setdefault(ref.chunk, {})[ref.rank] = ref.state
        if self.facts is not None:
            self._forget_old()
        gone = held - self._keys()                   # (a key replaced by a newer snapshot of its chunk, too)
        if gone:
            self.release(sorted(gone))

    def _keys(self) -> set[str]:
        return {k for by_rank in (*self.slots.values(), *self.states.values()) for k in by_rank.values()}

    def _forget_old(self) -> None:
        newest = self.restorable()
        last = self.chunks - 1
        keep = set(self.facts.restore_chunks(newest)) if newest is not None else set()
        # the newest set, and the slots newer than it (a later set in the making); while no set is complete (a
        # rank's snapshot is late or failed), still only the sink and the window's worth of recent chunks:
        # memory stays bounded (lingbot/runtime/snapshot_budget.py counts what a session holds)
        sink, window = self.facts.sink_chunks, self.facts.window_chunks
        self.slots = {i: refs for i, refs in self.slots.items()
                      if i in keep or i < sink or (i > last - window and (newest is None or i > newest))}
        self.states = {i: refs for i, refs in self.states.items()
                       if i >= (newest if newest is not None else last - 2)}

    def restorable(self) -> Optional[int]:
        """The newest delivered chunk whose continuation every rank can restore from snapshots."""
        if self.facts is None:
            return None
        slots = {i for i, refs in self.slots.items() if len(refs) == self.ranks}
        for index in sorted((i for i, refs in self.states.items() if len(refs) == self.ranks and i < self.chunks),
                            reverse=True):
            if all(c in slots for c in self.facts.restore_chunks(index)):
                return index
        return None

    def restore_keys(self) -> Optional[tuple[int, list[list[str]], list[str]]]:
        """The newest restore point: (its chunk, each rank's slot keys of the chunks it attends, each rank's state
        key); None while there is none."""
        index = self.restorable()
        if index is None:
            return None
        chunks = self.facts.restore_chunks(index)
        return index, [[self.slots[c][rank] for c in chunks] for rank in range(self.ranks)], \
            [self.states[index][rank] for rank in range(self.ranks)]

    # ---- resuming -------------------------------------------------------------------------------
    def resume(self, owner: Optional[SnapshotOwner] = None, now: Optional[float] = None,
               wall: Optional[float] = None) -> Resume:
        """What a new group needs to continue: the newest restore point (or none: replay all; its snapshots at
        `owner`, the session's keeper), the journal, the interaction state, and when the client's player runs out
        (wall clock, for the new group's pacing)."""
        now = time.monotonic() if now is None else now
        wall = time.time() if wall is None else wall
        index = self.restorable()
        restore = () if index is None else tuple(
            RankRestore(tuple(self.slots[c][rank] for c in self.facts.restore_chunks(index)), self.states[index][rank],
                        owner) for rank in range(self.ranks))
        playback_end = None if self.play_end is None else wall + (self.play_end - now)
        return Resume(tuple(self.journal), self.interactions, self.frames_delivered,
                      -1 if index is None else index, restore, playback_end,
                      fresh_stream=self.frames_delivered == 0)      # (a saved world's: nothing sent yet)
