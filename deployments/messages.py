"""What crosses between the actors of the app, typed: one dataclass per message, plain data (no Ray here).

    ingress --SessionRequest--> group.session (the lease) --GroupEvent*--> ingress
    group --ChunkControls--> RankWorker.run_chunk --ChunkReply--> group
    rank 0 --frames--> Muxer.encode --Fragment--> group         (the reply carries a reference to it)
    group --> RankWorker.join --RankInfo--> group;  RankWorker.device_stats --DeviceStats--> group
    ingress --Interaction--> ControlMailbox --> group           (protocol.Interaction; off Serve's routing)
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Union

from lingbot.camera import CameraEvent
from lingbot.io.frames import FrameBatch

from .protocol import StartRequest


@dataclass(frozen=True)
class Planner:
    """A session's interaction state after a chunk (sessions.ScheduledSession): the events still running
    (what is left of each) and the held keys. With the journal it lets another group continue exactly."""
    events: dict
    held: Optional[str]


@dataclass(frozen=True)
class Resume:
    """Continue a session whose group failed: replay the delivered chunks' controls (the journal, one per
    chunk 0..next_index-1) without delivering them, then go on from chunk next_index."""
    journal: tuple[ChunkControls, ...]
    planner: Optional[Planner]
    frames_delivered: int          # video frames the client has (the fMP4 stream continues from there)
    snapshot_index: int = -1       # restore the ranks to after this chunk from snapshots (-1: replay from 0)
    snapshots: tuple = ()          # per rank: (its K/V slot refs, its state ref) (lingbot.runtime.snapshot)
    playback_end: Optional[float] = None   # wall clock (time.time()) when the client's player runs out of video

    @property
    def next_index(self) -> int:
        return len(self.journal)


@dataclass(frozen=True)
class SessionRequest:
    """The ingress asks a group to run one session (the argument of the streaming lease call)."""
    session_id: str
    start: StartRequest
    resume: Optional[Resume] = None
    keeper: Any = None             # the ingress's actor that owns the session's snapshots (None: no snapshots)


# ---- group <-> ranks ------------------------------------------------------------------------------
@dataclass(frozen=True)
class RankInfo:
    """A rank's reply to `join`: what it serves and how many sessions fit on it."""
    capacity: int                  # sessions that fit this rank's memory budget
    session_bytes: int             # one session's footprint on this rank
    device: str
    width: int
    height: int
    frames_per_chunk: int          # latent frames per chunk
    warmup_s: float = 0.0          # the warm-up run before the rank reported ready


@dataclass
class ChunkControls:
    """What every rank applies to one chunk."""
    keys: Optional[tuple[str, ...]] = None
    camera: Optional[CameraEvent] = None
    prompt: Optional[str] = None
    prompt_transition_chunks: int = 0
    profile: bool = False          # synchronise the device at stage boundaries (exact stage times)


@dataclass
class ChunkReply:
    """A rank's reply to `run_chunk`. `fragment` (rank 0 only) is a reference to the muxer's Fragment."""
    stopped: bool
    timings: dict[str, float] = field(default_factory=dict)
    engine_s: float = 0.0          # wall time of the chunk inside the rank
    fragment: Any = None           # ray.ObjectRef[Optional[Fragment]]
    snapshots: tuple = ()          # (chunk, slot ref, state ref) per snapshot stored since the last reply


@dataclass(frozen=True)
class DeviceStats:
    """One rank's accelerator, as that rank sees it (its own device, whatever the node numbers it)."""
    utilization: float             # percent of the last sample period a kernel was running
    memory_used: int               # bytes


@dataclass(frozen=True)
class Fragment:
    """The muxer's encoding of one chunk: fMP4 bytes (the first one starts with the init segment), or for a
    session of the second protocol its frame batches (and no bytes)."""
    index: int
    data: bytes
    frames: int
    encode_s: float
    transfer_s: float              # rank 0 -> muxer
    batches: tuple[FrameBatch, ...] = ()


# ---- group -> ingress: the events of a session lease ---------------------------------------------
@dataclass(frozen=True)
class Admitted:
    group: str
    mailbox: Any                   # the group's ControlMailbox actor: where the session's controls go
    mime: str
    capacity: int


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
    planner: Optional[Planner] = None                       # the interaction state after the chunk
    snapshots: tuple = ()                                   # (chunk, rank, slot ref, state ref) stored meanwhile

    @property
    def keys(self) -> Optional[tuple[str, ...]]:
        """The key set of each latent frame (None: no keys)."""
        return None if self.controls is None else self.controls.keys


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
    the resume path. The chunks in flight were delivered first; `snapshots` are the ones stored since
    (chunk, rank, slot ref, state ref), so the next group restores the last delivered chunk."""
    reason: str
    snapshots: tuple = ()


@dataclass(frozen=True)
class SessionDone:
    chunks: int


@dataclass(frozen=True)
class SessionError:
    code: str
    message: str
    event_id: Optional[str] = None   # set when the error concerns one interaction (the session goes on)


GroupEvent = Union[Admitted, ChunkReady, Resumed, Moving, SessionDone, SessionError]
