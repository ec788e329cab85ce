"""What crosses between a group's replica and its actors, typed (plain data, no Ray here). Each call from the
group to its ranks is one method of RankExecutor (executor.py) with one of these as its argument or answer:

    group --join(init_method)--> every rank --RankInfo--> group
    group --OpenSession--> every rank --the chunk it continues from--> group
    group --RunChunk(ChunkControls)--> every rank --ChunkReply--> group
    rank 0 --frames--> Muxer.encode --Fragment--> group         (the reply carries a reference to it)
    group --device_stats--> every rank --DeviceStats--> group
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from lingbot.io.frames import FrameBatch
from lingbot.runtime.snapshot_budget import SnapshotHost

from ..session.events import ChunkControls, ModelFacts, RankRestore, SnapshotOwner, SnapshotRef
from ..session.requests import StartRequest


@dataclass(frozen=True)
class RankInfo:
    """A rank's reply to `join`: what it runs and how many sessions fit on it."""
    capacity: int                  # sessions that fit this rank's memory budget
    session_bytes: int             # one session's footprint on this rank
    device: str
    facts: ModelFacts              # the model as loaded (after any checkpoint config.json)
    warmup_s: float = 0.0          # the warm-up run before the rank reported ready
    snapshot_host: Optional[SnapshotHost] = None   # what one session's snapshots cost the group's host, at the
    #                                                 served interval (rank 0 only, with snapshots on; else None)
    rung_s: Optional[dict] = None  # with the quality ladder on: seconds a chunk took here per rung (measure_rungs)


@dataclass(frozen=True)
class SnapshotSchedule:
    """How a session's ranks snapshot it: after every `every_chunks`-th chunk (the group's
    snapshot_interval_chunks), handed to the ingress's keeper that holds them for the session (`owner`)."""
    owner: SnapshotOwner
    every_chunks: int = 1


@dataclass(frozen=True)
class OpenSession:
    """Build one session on a rank: from the client's start (image, prompt, seed, flow shift, camera trajectory,
    frame decoder), restored from this rank's share of a resumed session's snapshots when there is one."""
    session_id: str
    start: StartRequest
    snapshots: Optional[SnapshotSchedule] = None   # None: the session keeps no snapshots
    restore: Optional[RankRestore] = None


@dataclass(frozen=True)
class RunChunk:
    """Run chunk `index` of a session with its controls; rank 0 hands the frames to `muxer` (None on the others,
    and for a replayed chunk: nothing is delivered)."""
    session_id: str
    index: int
    controls: ChunkControls
    muxer: Any = None              # ray.actor.ActorHandle[Muxer]


@dataclass
class ChunkReply:
    """A rank's reply to `run_chunk`. `fragment` (rank 0 only) is a reference to the muxer's Fragment."""
    stopped: bool
    timings: dict[str, float] = field(default_factory=dict)
    engine_s: float = 0.0          # wall time of the chunk inside the rank
    fragment: Any = None           # ray.ObjectRef[Optional[Fragment]]
    snapshots: tuple[SnapshotRef, ...] = ()   # stored since the last reply
    warm: Optional[bool] = None    # with controls.prewarm: whether a switch to that decoder decodes nothing more


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
