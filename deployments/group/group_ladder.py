"""The quality ladder's switch on a group (docs/architecture.md, "Rungs"): `GroupLadder` is what the chunk loop
asks each chunk's rung and tells each chunk's cost, and what the leases ask for admission and capacities; it
holds the ladder that runs (ladder.py's QualityLadder, None while off), one turned off while sessions still
borrow its decoders, and the costs the ranks measured at the group's start. Plain Python."""
from __future__ import annotations

import dataclasses
from typing import Any, Optional

from .ladder import ChunkRung, QualityLadder, chunk_rung


class GroupLadder:
    """The group's quality ladder as its chunk loop runs it: the switch (`mode`: off or auto, from the settings,
    turned on or off by `set_mode` while sessions run), the ladder that runs (`active`, None while off) and one
    turned off while sessions still borrow its decoders (`winding`). The chunk loop asks each chunk's rung
    (`rung_for`) and tells what each chunk cost (`ran`); the leases ask `admits` and `capacities`."""

    def __init__(self, settings, model: Optional[Any] = None):
        self.settings, self.model = settings, model
        self.model_sink = 0 if model is None else model.sink_chunks
        self.loaded = ("wan",) if model is None else tuple(model.decoders)
        self.active = QualityLadder.of(settings, model)      # None: every chunk at full (or its pinned rung)
        self.winding: Optional[QualityLadder] = None          # turned off while sessions borrow its decoders
        self.start_costs: dict[str, float] = {}               # the ranks' measure of each rung at the start

    def measured_at_start(self, costs: dict[str, float]) -> None:
        """The ranks measured a chunk of these rungs (their names; a decoder rung's name without steps is a sink
        chunk on that decoder) before any session ran: the ladder admits from them, not from the seeds."""
        self.start_costs = dict(costs)
        if self.active is not None:
            self.active.seed(self.start_costs)

    @property
    def mode(self) -> str:
        return "off" if self.active is None else "auto"

    def set_mode(self, mode: str) -> None:
        """Turn the ladder off or on (auto) from each session's next chunk, sessions running (ConfigError for another
        mode, checked as the setting is): off, every session not pinned to a rung is at full from its next chunk,
        except one on a borrowed decoder, which first winds down (QualityLadder.wind_down); on, a new ladder
        starts every session at full (a climb under way carried over) and learns this group's costs again."""
        if mode == self.mode:
            return
        ladder = QualityLadder.of(dataclasses.replace(self.settings, quality_ladder=mode), self.model)
        if ladder is not None:
            ladder.seed(self.start_costs)
        if ladder is None:
            self.winding = self.active
        else:
            if self.winding is not None:
                ladder.carry_from(self.winding)
            self.winding = None
        self.active = ladder

    def rung_for(self, session, sessions, index: int) -> ChunkRung:
        """What `session`'s chunk `index` runs at, beside `sessions`: winding down from a borrowed decoder, else
        chunk_rung of the active ladder."""
        winding = self.winding.wind_down(session) if self.winding is not None else None
        return winding or chunk_rung(self.active, session, sessions, index, self.model_sink, self.loaded)

    def ran(self, session, sessions, index: int, chunk: ChunkRung, seconds: float, warm: Optional[bool] = None,
            timings: Optional[dict] = None) -> None:
        """Chunk `index` of `session` ran at `chunk` (QualityLadder.ran); the winding ladder is dropped once none of
        `sessions` runs on a decoder it lent."""
        for ladder in (self.active, self.winding):
            if ladder is not None:
                ladder.ran(session, index, chunk, seconds, warm, timings)
        if self.winding is not None and not self.winding.lending(sessions):
            self.winding = None                       # every session runs on its own decoder again

    def forget(self, session_id: str) -> None:
        for ladder in (self.active, self.winding):
            if ladder is not None:
                ladder.forget(session_id)

    def admits(self, start, sessions, opening: int = 0) -> bool:
        """Whether the group takes a session of `start` (QualityLadder.admits; always with the ladder off: the cap
        alone decides)."""
        return self.active is None or self.active.admits(start, sessions, opening, self.settings.fps)

    def capacities(self, cap: int) -> dict[str, int]:
        """Sessions at the deployment's fps the group holds at real time at the top rung and at the floor (the
        ladder on, as measured here; off, `cap` for both)."""
        if self.active is None:
            return {"top": cap, "floor": cap}
        return self.active.capacities(self.settings.fps, cap)
