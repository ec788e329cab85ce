"""A phase machine: an enum's phase that moves only along a table of transitions, each move checked and atomic.
A session's life at the ingress (life.py; its table at the end here) is one; a group's own phase
(deployments/group/state.py) is another.

Plain Python: no Ray."""
from __future__ import annotations

import threading
from collections.abc import Collection, Mapping
from enum import Enum
from typing import Generic, Optional, TypeVar

P = TypeVar("P", bound=Enum)


class PhaseError(RuntimeError):
    """A transition the table does not allow, where that is a bug (never a client's doing)."""


class PhaseMachine(Generic[P]):
    """The current phase, and the phases each phase may move to (the table names every phase of the enum; a
    phase with no way out lists none). Threads may move it: a group's stop watcher and its event loop do."""

    def __init__(self, start: P, transitions: Mapping[P, Collection[P]]):
        if set(transitions) != set(type(start)):
            raise ValueError(f"the transitions of {type(start).__name__} must list every phase, "
                             f"got {sorted(p.name for p in transitions)}")
        self.transitions = {phase: frozenset(next_phases) for phase, next_phases in transitions.items()}
        self._lock = threading.Lock()
        self._phase = start
        self._why: Optional[str] = None

    @property
    def phase(self) -> P:
        return self._phase

    @property
    def why(self) -> Optional[str]:
        """What the last move gave as its reason (None: none given)."""
        return self._why

    def move(self, phase: P, why: Optional[str] = None) -> bool:
        """Go to `phase` if the table allows it from the current one, with its reason; False (nothing changes)
        otherwise."""
        with self._lock:
            if phase not in self.transitions[self._phase]:
                return False
            self._why = why                 # before the phase: whoever sees the phase sees its reason
            self._phase = phase
            return True

    def enter(self, phase: P, who: str) -> None:
        """Go to `phase`; PhaseError (naming `who` and both phases) where the table does not allow it."""
        current = self._phase
        if not self.move(phase):
            raise PhaseError(f"{who}: {current.value} -> {phase.value} is not a transition")


# a session's life at the ingress (life.py has the diagram)
class Phase(Enum):
    WAITING_FOR_START = "waiting_for_start"
    ADMITTING = "admitting"
    STREAMING = "streaming"
    RESUMING = "resuming"
    ENDED = "ended"


NEXT_PHASES = {
    Phase.WAITING_FOR_START: {Phase.ADMITTING, Phase.ENDED},
    Phase.ADMITTING: {Phase.STREAMING, Phase.ENDED},
    Phase.STREAMING: {Phase.RESUMING, Phase.ENDED},
    Phase.RESUMING: {Phase.STREAMING, Phase.ENDED},
    Phase.ENDED: {Phase.ENDED},
}
