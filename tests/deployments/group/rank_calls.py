"""The group's typed calls to a rank (deployments/group/messages.py), built the way tests need them."""
from typing import Optional

import numpy as np

from deployments.group.messages import OpenSession, RunChunk, SnapshotSchedule
from deployments.session.events import ChunkControls, RankRestore, SnapshotOwner
from deployments.session.requests import StartRequest


def opening(session_id: str, image: np.ndarray, prompt: str, seed: int, keeper=None, every_chunks: int = 1,
            restore: Optional[RankRestore] = None, decoder: Optional[str] = None,
            window: Optional[tuple[int, int]] = None) -> OpenSession:
    """Open a session of the tiny preset's size (an endless one; the rank reads only what it builds from)."""
    start = StartRequest(prompt, image, 112, 64, None, None, 16.0, seed, None, [], decoder=decoder, window=window)
    plan = None if keeper is None else SnapshotSchedule(SnapshotOwner(keeper, session_id), every_chunks)
    return OpenSession(session_id, start, plan, restore)


def chunk(session_id: str, index: int, controls: Optional[ChunkControls] = None, muxer=None) -> RunChunk:
    return RunChunk(session_id, index, controls or ChunkControls(), muxer)
