"""What crosses between a group's replica and its actors, typed (plain data, no Ray here).

    group --> RankWorker.join --RankInfo--> group;  RankWorker.device_stats --DeviceStats--> group
    group --ChunkControls--> RankWorker.run_chunk --ChunkReply--> group
    rank 0 --frames--> Muxer.encode --Fragment--> group         (the reply carries a reference to it)
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from lingbot.io.frames import FrameBatch

from ..session.events import ModelFacts, SnapshotRef


@dataclass(frozen=True)
class RankInfo:
    """A rank's reply to `join`: what it runs and how many sessions fit on it."""
    capacity: int                  # sessions that fit this rank's memory budget
    session_bytes: int             # one session's footprint on this rank
    device: str
    facts: ModelFacts              # the model as loaded (after any checkpoint config.json)
    warmup_s: float = 0.0          # the warm-up run before the rank reported ready
    snapshot_sessions: Optional[int] = None   # sessions whose snapshots fit the host budget (None: no snapshots)


@dataclass
class ChunkReply:
    """A rank's reply to `run_chunk`. `fragment` (rank 0 only) is a reference to the muxer's Fragment."""
    stopped: bool
    timings: dict[str, float] = field(default_factory=dict)
    engine_s: float = 0.0          # wall time of the chunk inside the rank
    fragment: Any = None           # ray.ObjectRef[Optional[Fragment]]
    snapshots: tuple[SnapshotRef, ...] = ()   # stored since the last reply


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
