"""What crosses between the ingress and a group for one session, typed: one frozen dataclass per message, plain
data (no Ray here).

    ingress --SessionRequest--> group.session (the lease) --GroupEvent*--> ingress
    ingress --Interaction--> ControlMailbox --> group       (session.requests.Interaction; off Serve's routing)

A lease yields Admitted first, then ChunkReady per chunk; Resumed when a resumed session caught up; and it
ends with SessionDone, SessionFailed (the session cannot go on at this group: a fault, a refusal at the door
of the group) or Moving (the group is being stopped). InteractionRefused concerns one interaction only: the
session goes on. The messages between a group and its ranks are the group's (deployments/group/messages.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Optional, Union

from lingbot.config import ChunkGeometry, Preset
from lingbot.io.frames import FrameBatch
from lingbot.runtime.journal import ChunkControls
from lingbot.runtime.snapshot import chunks_to_restore

from .codes import ErrorCode
from .requests import StartRequest


@dataclass(frozen=True)
class ModelFacts:
    """What a group's ranks actually run (their preset after any checkpoint `config.json`): reported by every
    rank when it joins, and the one source of the geometry, the K/V window and the size for the group and
    the ingress (nobody resolves the preset again)."""
    preset: str
    width: int
    height: int
    geometry: ChunkGeometry
    sink_chunks: int               # chunks kept forever at the start of the K/V window
    window_chunks: int             # chunks a chunk attends, itself included
    steps: int                     # denoising steps per chunk
    dtype: str
    random_weights: bool = False   # seeded random weights (no checkpoint): the video is noise by design
    decoders: tuple[str, ...] = ("wan",)   # the frame decoders loaded, the first the sessions' default
    vae_dtype: str = "float32"     # the VAE's (condition encoder and Wan decoder)

    @classmethod
    def of(cls, preset: Preset, random_weights: bool = False, decoders: tuple[str, ...] = ("wan",)) -> ModelFacts:
        t = preset.transformer
        return cls(preset.name, preset.width, preset.height, preset.geometry, t.sink_chunks, t.window_chunks,
                   len(preset.sampler.timesteps), preset.dtype, random_weights, tuple(decoders), preset.vae_dtype)

    @property
    def size(self) -> tuple[int, int]:
        return self.width, self.height

    def restore_chunks(self, index: int) -> list[int]:
        """The chunks whose K/V slots a continuation after chunk `index` attends (the engine's rule)."""
        return chunks_to_restore(index, self.sink_chunks, self.window_chunks)

    def windowed(self, window: Optional[tuple[int, int]]) -> ModelFacts:
        """These facts as a session of its own K/V window (sink_chunks, window_chunks) sees them (None: as
        they are): what its continuity ledger keeps for a continuation."""
        return self if window is None else replace(self, sink_chunks=window[0], window_chunks=window[1])


@dataclass(frozen=True)
class SnapshotOwner:
    """Where a session's snapshots are kept: the ingress's keeper actor (deployments/ingress/keeper.py) and the
    session's id there (the ingress's, the same across resumes, so that its end lets every one of them go)."""
    keeper: Any                    # ray.actor.ActorHandle[SnapshotKeeper]
    session_id: str


@dataclass(frozen=True)
class SnapshotRef:
    """One rank's snapshot of chunk `chunk` of a session: the keys under which the ingress's keeper holds the
    chunk's K/V slot and the rest of the session's state after it (lingbot.runtime.snapshot). A snapshot
    taken every k chunks (snapshot_interval_chunks) also copies the slots of earlier chunks that no snapshot
    copied yet: those come without a state."""
    chunk: int
    rank: int
    slot: str                      # the key of its SlotSnapshot
    state: Optional[str]           # the key of its StateSnapshot; None: the slot of a chunk without a snapshot


@dataclass(frozen=True)
class RankRestore:
    """What one rank of a new group restores a resumed session from: the keys of the K/V slots its
    continuation attends (oldest first) and of the state after the newest chunk, at `owner`."""
    slots: tuple[str, ...]
    state: str
    owner: Optional[SnapshotOwner] = None


@dataclass(frozen=True)
class InteractionState:
    """A session's interaction state after a chunk (deployments/group/planner.py): the events still
    running (what is left of each) and the held keys. With the journal it lets another group continue
    exactly."""
    events: dict
    held: Optional[str]


@dataclass(frozen=True)
class Resume:
    """Continue a session another group ran: restore the ranks to after chunk `snapshot_index` (-1: to the
    start), replay the delivered chunks after it (their controls: the journal, one per chunk
    0..next_index-1) without delivering them, then go on from chunk next_index."""
    journal: tuple[ChunkControls, ...]
    interactions: Optional[InteractionState]
    frames_delivered: int          # video frames the client has (the fMP4 stream continues from there)
    snapshot_index: int = -1
    restore: tuple[RankRestore, ...] = ()          # one per rank (empty: replay from chunk 0)
    playback_end: Optional[float] = None   # wall clock (time.time()) when the client's player runs out of video
    fresh_stream: bool = False     # a new client (a saved world resumed): its stream starts anew, init segment first

    @property
    def next_index(self) -> int:
        return len(self.journal)


@dataclass(frozen=True)
class SessionRequest:
    """The ingress asks a group to run one session (the argument of the streaming lease call)."""
    session_id: str
    start: StartRequest
    resume: Optional[Resume] = None
    keeper: Optional[SnapshotOwner] = None   # where its snapshots are kept (None: no snapshots)


# ---- group -> ingress: the events of a session lease ---------------------------------------------
@dataclass(frozen=True)
class Admitted:
    group: str
    mailbox: Any                   # the group's ControlMailbox actor: where the session's controls go
    mime: str
    capacity: int
    facts: Optional[ModelFacts] = None
    muxer: Any = None              # the group's Muxer actor: asked for a keyframe when a viewer joins (sharing.py)


@dataclass(frozen=True)
class ChunkReady:
    index: int                     # generation chunk index
    data: bytes
    num_frames: int
    started: list[str]             # event ids
    active: list[str]
    completed: list[str]
    timings: dict[str, float]
    wall_s: float
    clock: dict[str, float] = field(default_factory=dict)   # the group's monotonic clock: dispatched, fragment
    batches: tuple[FrameBatch, ...] = ()                    # the second protocol's frames (then data is empty)
    controls: Optional[ChunkControls] = None                # what the chunk applied (the ingress's journal)
    interactions: Optional[InteractionState] = None         # the interaction state after the chunk
    snapshots: tuple[SnapshotRef, ...] = ()                 # stored since the last event that carried some

    @property
    def keys(self) -> Optional[tuple[str, ...]]:
        """The key set of each latent frame (None: no keys)."""
        return None if self.controls is None else self.controls.keys

    @property
    def steps(self) -> Optional[int]:
        """The denoising forwards the chunk ran (None: all the model's)."""
        return None if self.controls is None else self.controls.steps

    @property
    def quality(self) -> str:
        """The name of the rung the chunk ran at (`full`: the top)."""
        return "full" if self.controls is None else self.controls.quality


@dataclass(frozen=True)
class Resumed:
    """A resumed session caught up: restored from snapshots to chunk `restored` (0: none), then `replayed`
    chunks were run again, in `replay_s` seconds."""
    replayed: int
    replay_s: float
    restored: int = 0


@dataclass(frozen=True)
class Moving:
    """The group is being stopped (a scale-down or a redeploy): the session must go on on another group, by
    the resume path. The chunks in flight were delivered first; `snapshots` are the ones stored since, so
    the next group restores the last delivered chunk."""
    reason: str
    snapshots: tuple[SnapshotRef, ...] = ()


@dataclass(frozen=True)
class SessionDone:
    chunks: int


@dataclass(frozen=True)
class SessionFailed:
    """The session cannot go on at this group (its group failed, is full, or is being stopped): the lease
    ends here. The ingress resumes it elsewhere, or refuses with the code. `seat_held`: the group has a free seat
    its quality ladder holds back until its load allows (a session's sink passing, a session ending), so a session
    refused for it waits for a seat, whether or not a group may be added."""
    code: ErrorCode
    message: str
    seat_held: bool = False


@dataclass(frozen=True)
class InteractionRefused:
    """One interaction was refused (the session goes on)."""
    code: ErrorCode
    message: str
    event_id: str


GroupEvent = Union[Admitted, ChunkReady, Resumed, Moving, SessionDone, SessionFailed, InteractionRefused]
# the events after which a lease yields nothing more
FINAL_EVENTS = (SessionDone, SessionFailed, Moving)
