"""Controls, which act at chunk boundaries:
- keys, one set per latent frame: W/S forward/back and A/D right/left by 0.05 in the yaw plane;
  I/K pitch +/-4 deg (a cumulative pitch counter: a step that would pass +/-85 deg is dropped), L/J yaw
  +/-6 deg;
  R' = Ry(dyaw) . R . Rx(dpitch). Rx(+) tilts the view up in OpenCV axes, Ry(+) turns right.
- SE3 events (the vLLM-Omni `camera` interaction): mode "target" moves to an absolute pose
  (lerp of translation, nlerp of the (x, y, z, w) quaternion) over transition_chunks * 3 latent
  frames; mode "velocity" right-multiplies a delta pose once per latent frame until replaced.
  As in vLLM-Omni the pose is used as given, in the model's camera frame.
The rig (rig.py) applies them to a session's camera.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import numpy as np

from .poses import CameraError, make_pose, quat_to_matrix, rot_x, rot_y

KEY_STEP = 0.05
PITCH_STEP_DEG = 4.0
YAW_STEP_DEG = 6.0
PITCH_LIMIT_DEG = 85.0
VALID_KEYS = frozenset("wasdijkl")


@dataclass(frozen=True)
class CameraEvent:
    """An SE3 control: mode 'target' (absolute pose) or 'velocity' (delta per latent frame)."""
    mode: str
    translation: tuple[float, float, float]
    rotation: tuple[float, float, float, float]          # (x, y, z, w)
    transition_chunks: float = 1.0

    def __post_init__(self):
        if self.mode not in ("target", "velocity"):
            raise CameraError(f"camera mode {self.mode!r} must be 'target' or 'velocity'")
        if len(self.translation) != 3 or not all(math.isfinite(v) for v in self.translation):
            raise CameraError(f"camera translation {list(self.translation)} must be 3 finite numbers")
        if len(self.rotation) != 4 or not all(math.isfinite(v) for v in self.rotation):
            raise CameraError(f"camera rotation {list(self.rotation)} must be a quaternion [x, y, z, w]")
        if math.sqrt(sum(v * v for v in self.rotation)) < 1e-8:
            raise CameraError("camera rotation quaternion has zero length")
        if not (math.isfinite(self.transition_chunks) and self.transition_chunks >= 0):
            raise CameraError(f"transition_chunks {self.transition_chunks} must be >= 0")

    def matrix(self) -> np.ndarray:
        return make_pose(quat_to_matrix(self.rotation), self.translation)

    def transition_frames(self, frames_per_chunk: int) -> int:
        """Latent frames a target move takes (0: snap at once)."""
        if self.transition_chunks == 0:
            return 0
        return max(1, round(self.transition_chunks * frames_per_chunk))


@dataclass(frozen=True)
class Controls:
    """Controls applied to one chunk: keys per latent frame and/or a new SE3 event."""
    keys: Optional[tuple[str, ...]] = None
    camera: Optional[CameraEvent] = None


def parse_keys(frame_keys: str) -> str:
    """Normalise one latent frame's key set ('wa', 'W', '') and reject unknown keys."""
    keys = frame_keys.lower().replace("+", "").replace(" ", "")
    bad = sorted(set(keys) - VALID_KEYS)
    if bad:
        raise CameraError(f"unknown key(s) {''.join(bad)!r} in {frame_keys!r}; use W/A/S/D, I/J/K/L")
    return keys


def parse_key_script(script: str, chunks: int, frames_per_chunk: int) -> list[tuple[str, ...]]:
    """"w,w,wa,,j" (one key set per latent frame, comma-separated) -> key sets per chunk, padded with no
    keys to chunks * frames_per_chunk latent frames."""
    frames = [parse_keys(k) for k in script.split(",")] if script else []
    total = chunks * frames_per_chunk
    if len(frames) > total:
        raise CameraError(f"the key script has {len(frames)} key sets but {chunks} chunks hold {total} latent frames")
    frames += [""] * (total - len(frames))
    return [tuple(frames[i:i + frames_per_chunk]) for i in range(0, total, frames_per_chunk)]


def keyboard_step(pose: np.ndarray, keys: str, pitch_deg: float = 0.0) -> tuple[np.ndarray, float]:
    """Apply one latent frame's keys to an absolute pose whose key pitch counter is `pitch_deg`. Returns
    (new pose, new pitch counter). A pitch step that would take the counter past +/-85 deg is dropped."""
    keys = parse_keys(keys)
    d_pitch = PITCH_STEP_DEG * (("i" in keys) - ("k" in keys))
    if abs(pitch_deg + d_pitch) > PITCH_LIMIT_DEG:
        d_pitch = 0.0
    new_pitch = pitch_deg + d_pitch
    d_yaw = YAW_STEP_DEG * (("l" in keys) - ("j" in keys))
    r = rot_y(d_yaw) @ pose[:3, :3] @ rot_x(d_pitch)
    # movement stays in the yaw plane (non-degenerate: the pitch limit keeps the view off the vertical)
    forward = np.array([r[0, 2], 0.0, r[2, 2]])
    right = np.array([r[0, 0], 0.0, r[2, 0]])
    forward /= np.linalg.norm(forward)
    right /= np.linalg.norm(right)
    t = pose[:3, 3] + KEY_STEP * forward * (("w" in keys) - ("s" in keys)) \
        + KEY_STEP * right * (("d" in keys) - ("a" in keys))
    return make_pose(r, t), new_pitch
