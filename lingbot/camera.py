"""Camera control: poses -> per-pixel rays [o, d] -> camera patches for `patch_embedding_wancamctrl`.

Conventions (docs/architecture.md, "Camera and keys"): poses are 4x4 camera-to-world matrices in OpenCV axes (x right,
y down, z forward), one per latent frame. Each chunk's poses are preceded by an anchor (the previous
chunk's last pose; identity for a new session) and turned into frame-to-frame relative transforms
inv(P[i-1]) @ P[i]. Translations are scaled as the reference runtime scales them: a chunk moved by a live
SE3 event divides them by the 0.05 controller unit; a chunk moved by keys (live or scripted) divides them
by its largest frame-to-frame step (when that is non-zero), so a held key gives unit steps. Rays per pixel centre:
d = normalize(R . normalize(((x+.5)-cx)/fx, ((y+.5)-cy)/fy, 1)), o = t; channels [o, d].

Controls act at chunk boundaries:
- keys, one set per latent frame: W/S forward/back and A/D right/left by 0.05 in the yaw plane;
  I/K pitch +/-4 deg (a cumulative pitch counter: a step that would pass +/-85 deg is dropped), L/J yaw
  +/-6 deg;
  R' = Ry(dyaw) . R . Rx(dpitch). Rx(+) tilts the view up in OpenCV axes, Ry(+) turns right.
- SE3 events (the vLLM-Omni `camera` interaction): mode "target" moves to an absolute pose
  (lerp of translation, nlerp of the (x, y, z, w) quaternion) over transition_chunks * 3 latent
  frames; mode "velocity" right-multiplies a delta pose once per latent frame until replaced.
  As in vLLM-Omni the pose is used as given, in the model's camera frame.

Pose math is float64 numpy (a handful of 4x4s); ray maps are built in float32 on the target device.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple, Optional

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

REFERENCE_SIZE = (832, 480)          # (width, height) the checkpoint's intrinsics are given in
TRANSLATION_UNIT = 0.05              # one controller step; live translations are divided by it
KEY_STEP = 0.05
STILL = 1e-9                         # a frame-to-frame translation shorter than this is no move
PITCH_STEP_DEG = 4.0
YAW_STEP_DEG = 6.0
PITCH_LIMIT_DEG = 85.0
KEYBOARD_FOCAL = 500.0
VALID_KEYS = frozenset("wasdijkl")


class CameraError(ValueError):
    """Bad camera input (keys, quaternion, mode); the message says what is wrong."""


# ---------------------------------------------------------------------------------------------------
# rotation helpers (float64)
# ---------------------------------------------------------------------------------------------------
def rot_x(deg: float) -> np.ndarray:
    c, s = math.cos(math.radians(deg)), math.sin(math.radians(deg))
    return np.array([[1, 0, 0], [0, c, -s], [0, s, c]], dtype=np.float64)


def rot_y(deg: float) -> np.ndarray:
    c, s = math.cos(math.radians(deg)), math.sin(math.radians(deg))
    return np.array([[c, 0, s], [0, 1, 0], [-s, 0, c]], dtype=np.float64)


def quat_to_matrix(q: Sequence[float]) -> np.ndarray:
    """(x, y, z, w) -> 3x3 rotation; q is normalised first."""
    x, y, z, w = np.asarray(q, dtype=np.float64) / np.linalg.norm(q)
    return np.array([
        [1 - 2 * (y * y + z * z), 2 * (x * y - z * w), 2 * (x * z + y * w)],
        [2 * (x * y + z * w), 1 - 2 * (x * x + z * z), 2 * (y * z - x * w)],
        [2 * (x * z - y * w), 2 * (y * z + x * w), 1 - 2 * (x * x + y * y)]], dtype=np.float64)


def matrix_to_quat(r: np.ndarray) -> np.ndarray:
    """3x3 rotation -> unit (x, y, z, w) (Shepperd's method, the numerically safe branch)."""
    m = r
    trace = m[0, 0] + m[1, 1] + m[2, 2]
    if trace > 0:
        s = 2.0 * math.sqrt(trace + 1.0)
        q = [(m[2, 1] - m[1, 2]) / s, (m[0, 2] - m[2, 0]) / s, (m[1, 0] - m[0, 1]) / s, 0.25 * s]
    elif m[0, 0] > m[1, 1] and m[0, 0] > m[2, 2]:
        s = 2.0 * math.sqrt(1.0 + m[0, 0] - m[1, 1] - m[2, 2])
        q = [0.25 * s, (m[0, 1] + m[1, 0]) / s, (m[0, 2] + m[2, 0]) / s, (m[2, 1] - m[1, 2]) / s]
    elif m[1, 1] > m[2, 2]:
        s = 2.0 * math.sqrt(1.0 + m[1, 1] - m[0, 0] - m[2, 2])
        q = [(m[0, 1] + m[1, 0]) / s, 0.25 * s, (m[1, 2] + m[2, 1]) / s, (m[0, 2] - m[2, 0]) / s]
    else:
        s = 2.0 * math.sqrt(1.0 + m[2, 2] - m[0, 0] - m[1, 1])
        q = [(m[0, 2] + m[2, 0]) / s, (m[1, 2] + m[2, 1]) / s, 0.25 * s, (m[1, 0] - m[0, 1]) / s]
    q = np.asarray(q)
    return q / np.linalg.norm(q)


def nlerp(q0: np.ndarray, q1: np.ndarray, alpha: float) -> np.ndarray:
    """Normalised linear interpolation along the shorter arc."""
    if np.dot(q0, q1) < 0:
        q1 = -q1
    q = (1 - alpha) * q0 + alpha * q1
    return q / np.linalg.norm(q)


def make_pose(rotation: np.ndarray, translation: Sequence[float]) -> np.ndarray:
    pose = np.eye(4)
    pose[:3, :3] = rotation
    pose[:3, 3] = translation
    return pose


# ---------------------------------------------------------------------------------------------------
# intrinsics, relative poses, rays, patches
# ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Intrinsics:
    fx: float
    fy: float
    cx: float
    cy: float

    def scaled(self, width: int, height: int, reference: tuple[int, int] = REFERENCE_SIZE) -> Intrinsics:
        """Intrinsics given at the 832x480 reference size, rescaled to width x height (no crop)."""
        sx, sy = width / reference[0], height / reference[1]
        return Intrinsics(self.fx * sx, self.fy * sy, self.cx * sx, self.cy * sy)

    @staticmethod
    def keyboard(width: int, height: int) -> Intrinsics:
        """Keyboard control: focal 500 px at the target size, principal point at the centre."""
        return Intrinsics(KEYBOARD_FOCAL, KEYBOARD_FOCAL, width / 2, height / 2)


def relative_poses(anchor: np.ndarray, poses: np.ndarray,
                   translation_unit: Optional[float] = TRANSLATION_UNIT) -> np.ndarray:
    """Frame-to-frame transforms inv(P[i-1]) @ P[i] with P[-1] = anchor [F, 4, 4]; translations divided by
    `translation_unit`, or (None) by the largest step among them when that is non-zero (steps below
    STILL are rounding left by the inverse of a pose that did not move: zero)."""
    chain = np.concatenate([anchor[None], poses], axis=0)
    rel = np.linalg.inv(chain[:-1]) @ chain[1:]
    if translation_unit is None:
        steps = np.linalg.norm(rel[:, :3, 3], axis=1)
        rel[steps < STILL, :3, 3] = 0.0
        largest = steps.max()
        translation_unit = largest if largest >= STILL else 1.0
    rel[:, :3, 3] /= translation_unit
    return rel


def ray_map(rel: np.ndarray, intrinsics: Intrinsics, height: int, width: int, device="cpu") -> Tensor:
    """Per pixel centre rays [o, d] of each relative pose: [6, F, H, W] float32."""
    ys = (torch.arange(height, dtype=torch.float32, device=device) + 0.5 - intrinsics.cy) / intrinsics.fy
    xs = (torch.arange(width, dtype=torch.float32, device=device) + 0.5 - intrinsics.cx) / intrinsics.fx
    cam = torch.stack([xs[None, :].expand(height, width), ys[:, None].expand(height, width),
                       torch.ones(height, width, device=device)], dim=-1)           # [H, W, 3]
    cam = F.normalize(cam, dim=-1)
    rel_t = torch.as_tensor(rel, dtype=torch.float32, device=device)                  # [F, 4, 4]
    d = F.normalize(torch.einsum("fij,hwj->fhwi", rel_t[:, :3, :3], cam), dim=-1)     # [F, H, W, 3]
    o = rel_t[:, None, None, :3, 3].expand_as(d)
    return torch.cat([o, d], dim=-1).permute(3, 0, 1, 2).contiguous()               # [6, F, H, W]


def camera_patches(rays: Tensor, unshuffle: int = 8, patch: tuple[int, int] = (2, 2)) -> Tensor:
    """[6, F, H, W] rays -> [F*h*w, 1536] patches for patch_embedding_wancamctrl.

    pixel_unshuffle(8): channel c*64 + i*8 + j (row i, column j inside the 8x8 block) -> [384, F, H/8, W/8];
    then the 1x2x2 patch flattened in Conv3d weight order (channel, pt, ph, pw); tokens in (f, h, w) order.
    """
    _c, f, _h, _w = rays.shape
    x = F.pixel_unshuffle(rays.permute(1, 0, 2, 3), unshuffle)          # [F, 384, H/8, W/8]
    ph, pw = patch
    hh, ww = x.shape[2] // ph, x.shape[3] // pw
    x = x.view(f, x.shape[1], hh, ph, ww, pw)                           # [F, 384, h, ph, w, pw]
    x = x.permute(0, 2, 4, 1, 3, 5)                                     # [F, h, w, 384, ph, pw]
    return x.reshape(f * hh * ww, -1)                                   # [L, 1536]


# ---------------------------------------------------------------------------------------------------
# controls and the rig
# ---------------------------------------------------------------------------------------------------
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


def trajectory(keys_per_chunk: Sequence[Sequence[str]], width: int, height: int) -> list[dict]:
    """What the model receives for a key script, one entry per latent frame: the camera-to-world pose, the
    frame-to-frame translation as scaled for the model, the key pitch counter and the cumulative yaw."""
    rig = CameraRig.default(width, height)
    out, yaw = [], 0.0
    for keys in keys_per_chunk:
        planned = rig.plan(Controls(keys=tuple(keys)), len(keys))
        relative = rig.relative(planned)
        for pose, rel, pitch, frame_keys in zip(planned.poses, relative, planned.pitch_deg, keys):
            pressed = parse_keys(frame_keys)
            yaw += YAW_STEP_DEG * (("l" in pressed) - ("j" in pressed))
            out.append({"frame": len(out), "c2w": pose.tolist(), "translation": rel[:3, 3].tolist(),
                        "pitch_deg": pitch, "yaw_deg": yaw})
        rig.commit(planned)
    return out


@dataclass(frozen=True)
class Controls:
    """Controls applied to one chunk: keys per latent frame and/or a new SE3 event."""
    keys: Optional[tuple[str, ...]] = None
    camera: Optional[CameraEvent] = None


@dataclass(frozen=True)
class CameraState:
    """Everything the rig carries from chunk to chunk (immutable: a failed chunk changes nothing)."""
    pose: np.ndarray                        # the anchor: last committed absolute pose [4, 4]
    motion: Optional[CameraEvent] = None    # the active SE3 event (a finished target is dropped)
    motion_start: Optional[np.ndarray] = None
    motion_step: int = 0
    pitch_deg: float = 0.0                  # the keys' cumulative pitch (its own counter, as the reference)


class PlannedChunk(NamedTuple):
    poses: np.ndarray                       # absolute poses [frames, 4, 4]
    state: CameraState                      # the rig's state once the chunk is committed
    live_event: bool                        # an SE3 event moved the camera in this chunk (fixed unit)
    pitch_deg: tuple[float, ...] = ()       # the key pitch counter after each frame


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


class CameraRig:
    """A session's camera: intrinsics at the target size and the committed CameraState."""

    def __init__(self, intrinsics: Intrinsics, translation_unit: float = TRANSLATION_UNIT):
        self.intrinsics = intrinsics
        self.translation_unit = translation_unit          # for chunks moved by live SE3 events
        self.reset()

    @classmethod
    def default(cls, width: int, height: int) -> CameraRig:
        return cls(Intrinsics.keyboard(width, height))

    def reset(self) -> None:
        self.state = CameraState(pose=np.eye(4))

    def plan(self, controls: Optional[Controls], frames: int) -> PlannedChunk:
        """Absolute poses [frames, 4, 4] of the next chunk and the state after it; hand the plan to rays()
        and, once the chunk succeeded, to commit()."""
        state = self.state
        if controls is not None and controls.camera is not None:
            state = dataclasses.replace(state, motion=controls.camera, motion_start=state.pose, motion_step=0)
        keys = controls.keys if controls is not None and controls.keys is not None else ("",) * frames
        if len(keys) != frames:
            raise CameraError(f"{len(keys)} key sets for a chunk of {frames} latent frames")
        pose, step, motion, pitch = state.pose, state.motion_step, state.motion, state.pitch_deg
        poses, pitches, live = [], [], False
        for frame_keys in keys:
            if motion is not None:
                live = True
                step += 1
                pose = self._motion_pose(motion, state.motion_start, pose, step, frames)
                if motion.mode == "target" and step >= motion.transition_frames(frames):
                    motion = None                      # arrived: keys move the camera from here on
            pose, pitch = keyboard_step(pose, frame_keys, pitch)
            poses.append(pose)
            pitches.append(pitch)
        return PlannedChunk(np.stack(poses), dataclasses.replace(state, pose=pose, motion=motion, motion_step=step,
                                                                 pitch_deg=pitch), live, tuple(pitches))

    @staticmethod
    def _motion_pose(event: CameraEvent, start: np.ndarray, current: np.ndarray, step: int,
                     frames_per_chunk: int) -> np.ndarray:
        """Pose at latent frame `step` (1-based) of the active event."""
        if event.mode == "velocity":
            return current @ event.matrix()
        total = event.transition_frames(frames_per_chunk)
        if step >= total:
            return event.matrix()
        alpha = step / total
        target = event.matrix()
        t = (1 - alpha) * start[:3, 3] + alpha * target[:3, 3]
        q = nlerp(matrix_to_quat(start[:3, :3]), matrix_to_quat(target[:3, :3]), alpha)
        return make_pose(quat_to_matrix(q), t)

    def relative(self, planned: PlannedChunk) -> np.ndarray:
        """The chunk's frame-to-frame transforms as the model receives them [frames, 4, 4]."""
        unit = self.translation_unit if planned.live_event else None          # keys: by the largest step
        return relative_poses(self.state.pose, planned.poses, unit)

    def rays(self, planned: PlannedChunk, height: int, width: int, device="cpu") -> Tensor:
        return ray_map(self.relative(planned), self.intrinsics, height, width, device)

    def commit(self, planned: PlannedChunk) -> None:
        self.state = planned.state
