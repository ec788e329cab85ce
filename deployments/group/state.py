"""A group's own phase, from serving to its end (docs/architecture.md, "Draining" and "Sessions that survive
faults"):

    SERVING --Serve stops it--> STOPPING --drain due--> FILLING --buffers full--> HANDING_ON
       any ------------------- a rank, the muxer or the mailbox died -------------------> FAILED

SERVING takes sessions; STOPPING takes none and runs the ones it has; FILLING runs them ahead of their
playback (drain_lead_s) so their viewers play the move out of the buffer; HANDING_ON starts no chunk and hands
each session on (Moving); FAILED tells every session and exits. The stop watcher's thread and the event loop
both move it: transitions are checked and atomic (deployments/session/phases.py).
"""
from __future__ import annotations

from enum import Enum
from typing import Optional

from ..session.phases import PhaseMachine


class GroupPhase(Enum):
    SERVING = "serving"
    STOPPING = "stopping"
    FILLING = "filling"
    HANDING_ON = "handing_on"
    FAILED = "failed"


_NEXT = {
    GroupPhase.SERVING: {GroupPhase.STOPPING, GroupPhase.FAILED},
    GroupPhase.STOPPING: {GroupPhase.FILLING, GroupPhase.FAILED},
    GroupPhase.FILLING: {GroupPhase.HANDING_ON, GroupPhase.FAILED},
    GroupPhase.HANDING_ON: {GroupPhase.FAILED},
    GroupPhase.FAILED: set(),
}


class GroupState:
    def __init__(self):
        self._phases = PhaseMachine(GroupPhase.SERVING, _NEXT)

    @property
    def phase(self) -> GroupPhase:
        return self._phases.phase

    @property
    def failure(self) -> Optional[str]:
        """Why it FAILED (None before)."""
        return self._phases.why if self.failed else None

    def move(self, phase: GroupPhase, failure: Optional[str] = None) -> bool:
        """Go to `phase` if that is a transition from the current one; False (nothing changes) otherwise."""
        return self._phases.move(phase, failure if phase is GroupPhase.FAILED else None)

    @property
    def failed(self) -> bool:
        return self.phase is GroupPhase.FAILED

    @property
    def takes_sessions(self) -> bool:
        return self.phase is GroupPhase.SERVING

    @property
    def runs_chunks(self) -> bool:
        """The chunk loop goes on (it stops for the hand-on and at a failure)."""
        return self.phase in (GroupPhase.SERVING, GroupPhase.STOPPING, GroupPhase.FILLING)
