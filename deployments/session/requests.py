"""What a client asks for, whichever protocol it speaks: the start of a session and its interactions, as
typed values. The dialects' parsers (deployments/ingress/) build them; the group schedules them.

Plain Python: no Ray, no Starlette."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from lingbot.camera import CameraEvent, Trajectory
from lingbot.io.frames import FMP4, FrameFormat


@dataclass
class StartRequest:
    prompt: str
    image: np.ndarray                     # float32 [3, H, W] at the session size (lingbot.io.images)
    width: int
    height: int
    chunks: Optional[int]                 # None = endless
    num_frames: Optional[int]
    fps: float
    seed: int
    flow_shift: Optional[float]
    action_script: list[tuple[str, ...]]  # keys per chunk (one set per latent frame)
    model: Optional[str] = None
    profile: bool = False                 # stage timings with device synchronisation (extra_params.profile_stages)
    trajectory: Optional[Trajectory] = None   # offline camera path (extra_params.camera_trajectory)
    output: FrameFormat = FMP4                # fmp4 (this protocol) or the second protocol's frame format
    decoder: Optional[str] = None             # a loaded frame decoder (extra_params.decoder); None: the default
    paced: bool = True                        # False: each chunk as soon as it is made (realtime_output_pacing)
    window: Optional[tuple[int, int]] = None  # its own K/V window (sink, window chunks); None: the model's
    quality: str = "auto"                     # auto: the ladder's choice; else a rung pinned (extra_params.quality)
    spectators: bool = False                  # shared from its start (extra_params.spectators; session.share later)
    record: Optional[bool] = None             # recorded (extra_params.record); None: the deployment's record_sessions
    world_id: Optional[str] = None            # a saved world to resume (worlds.py): its start replaces this
    unknown_fields: tuple[str, ...] = ()      # start fields this server does not know (ignored; counted, logged)


@dataclass
class Interaction:
    event_id: str
    prompt: Optional[str] = None
    camera: Optional[CameraEvent] = None
    keys: Optional[list[str]] = None      # one key set per latent frame, from the next chunk on
    hold: Optional[list[str]] = None      # held keys: the key set after each transition (the level holds)
    transition_chunks: Optional[float] = None
    seq: int = 0                          # arrival order at the ingress (mailbox posts may land out of order)
