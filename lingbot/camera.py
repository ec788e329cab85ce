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

Pose math is float64 numpy (a handful of 4x4s); ray maps are built in float32 on the target device, from
poses and intrinsics copied there asynchronously (lingbot/transfer.py).
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

from .transfer import to_device

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


def intrinsics_table(intrinsics, frames: int) -> np.ndarray:
    """One Intrinsics for every frame, or per-frame (fx, fy, cx, cy) rows -> [frames, 4] float64."""
    if isinstance(intrinsics, Intrinsics):
        row = [intrinsics.fx, intrinsics.fy, intrinsics.cx, intrinsics.cy]
        return np.tile(np.asarray(row, dtype=np.float64), (frames, 1))
    table = np.asarray(intrinsics, dtype=np.float64)
    if table.shape != (frames, 4):
        raise CameraError(f"intrinsics of shape {list(table.shape)} for {frames} frames; expected [{frames}, 4]")
    return table


def ray_map(rel: np.ndarray, intrinsics, height: int, width: int, device="cpu") -> Tensor:
    """Per pixel centre rays [o, d] of each relative pose: [6, F, H, W] float32. `intrinsics`: one
    Intrinsics for all frames or an [F, 4] table of (fx, fy, cx, cy)."""
    # the host's pose math reaches the device by one asynchronous copy each (lingbot/transfer.py): no host sync
    k = to_device(intrinsics_table(intrinsics, len(rel)), device, torch.float32)                  # [F, 4]
    ys = (torch.arange(height, dtype=torch.float32, device=device)[None] + 0.5 - k[:, 3:4]) / k[:, 1:2]  # [F, H]
    xs = (torch.arange(width, dtype=torch.float32, device=device)[None] + 0.5 - k[:, 2:3]) / k[:, 0:1]   # [F, W]
    f = len(rel)
    cam = torch.stack([xs[:, None, :].expand(f, height, width), ys[:, :, None].expand(f, height, width),
                       torch.ones(f, height, width, device=device)], dim=-1)         # [F, H, W, 3]
    cam = F.normalize(cam, dim=-1)
    rel_t = to_device(rel, device, torch.float32)                                       # [F, 4, 4]
    d = F.normalize(torch.einsum("fij,fhwj->fhwi", rel_t[:, :3, :3], cam), dim=-1)    # [F, H, W, 3]
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
# offline trajectories (the reference's poses.npy / intrinsics.npy input)
# ---------------------------------------------------------------------------------------------------
ROTATION_TOLERANCE = 1e-3            # max |R^T R - I| entry (and |det R - 1|) of a pose accepted as rigid


class TrajectoryError(CameraError):
    """A bad offline trajectory; `code` names the violation (stable, sent to WebSocket clients)."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


def check_trajectory(poses, intrinsics) -> tuple[np.ndarray, np.ndarray]:
    """Camera-to-world poses [F, 4, 4] and intrinsics [F, 4] (fx, fy, cx, cy) as float64, or the first
    violation found: trajectory_shape, trajectory_not_finite, trajectory_not_rigid, trajectory_intrinsics."""
    try:
        poses = np.asarray(poses, dtype=np.float64)
        intrinsics = np.asarray(intrinsics, dtype=np.float64)
    except (TypeError, ValueError, OverflowError) as e:
        raise TrajectoryError("trajectory_shape", f"poses and intrinsics must be arrays of numbers ({e})") from None
    if poses.ndim != 3 or poses.shape[1:] != (4, 4) or len(poses) == 0:
        raise TrajectoryError("trajectory_shape", f"poses must be [frames, 4, 4], got {list(poses.shape)}")
    if intrinsics.shape != (len(poses), 4):
        raise TrajectoryError("trajectory_shape", f"intrinsics must be [{len(poses)}, 4] (fx, fy, cx, cy per pose), "
                              f"got {list(intrinsics.shape)}")
    if not (np.isfinite(poses).all() and np.isfinite(intrinsics).all()):
        raise TrajectoryError("trajectory_not_finite", "poses and intrinsics must be finite numbers")
    r = poses[:, :3, :3]
    gram = np.abs(np.swapaxes(r, 1, 2) @ r - np.eye(3)).max(axis=(1, 2))
    det = np.linalg.det(r)
    bottom = np.abs(poses[:, 3] - np.array([0.0, 0.0, 0.0, 1.0])).max(axis=1)
    bad = np.flatnonzero((gram > ROTATION_TOLERANCE) | (np.abs(det - 1) > ROTATION_TOLERANCE)
                         | (bottom > ROTATION_TOLERANCE))
    if len(bad):
        i = int(bad[0])
        raise TrajectoryError("trajectory_not_rigid", f"pose {i} is not a rigid camera-to-world transform (rotation "
                              f"orthonormal with det +1 within {ROTATION_TOLERANCE}, last row 0 0 0 1)")
    bad = np.flatnonzero((intrinsics <= 0).any(axis=1))
    if len(bad):
        raise TrajectoryError("trajectory_intrinsics", f"intrinsics {int(bad[0])} must be positive (fx, fy, cx, cy), "
                              f"got {intrinsics[bad[0]].tolist()}")
    return poses, intrinsics


def slerp(q0: np.ndarray, q1: np.ndarray, alpha: float) -> np.ndarray:
    """Spherical linear interpolation of unit quaternions (q1 already on q0's hemisphere)."""
    cos = float(np.clip(np.dot(q0, q1), -1.0, 1.0))
    if cos > 1 - 1e-12:
        return q0 if alpha == 0 else nlerp(q0, q1, alpha)
    theta = math.acos(cos)
    q = (math.sin((1 - alpha) * theta) * q0 + math.sin(alpha * theta) * q1) / math.sin(theta)
    return q / np.linalg.norm(q)


def resample_poses(poses: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """Poses at fractional indices `targets` of `poses`: SLERP of the rotation (along a quaternion chain made
    sign-continuous), linear translation."""
    quats = [matrix_to_quat(p[:3, :3]) for p in poses]
    for i in range(1, len(quats)):
        if np.dot(quats[i], quats[i - 1]) < 0:
            quats[i] = -quats[i]
    out = []
    for t in targets:
        i = min(math.floor(t), len(poses) - 1)
        alpha = t - i
        if alpha <= 0 or i == len(poses) - 1:
            out.append(poses[i].copy())
            continue
        q = slerp(quats[i], quats[i + 1], alpha)
        out.append(make_pose(quat_to_matrix(q), (1 - alpha) * poses[i, :3, 3] + alpha * poses[i + 1, :3, 3]))
    return np.stack(out)


@dataclass(frozen=True)
class Trajectory:
    """An offline camera path, one entry per latent frame, ready for the rig: poses relative to the first
    (so the session starts at the identity), intrinsics at the served size, and the clip's translation unit."""
    poses: np.ndarray                       # [L, 4, 4]
    intrinsics: np.ndarray                  # [L, 4] fx, fy, cx, cy
    unit: float                             # the clip's largest frame-to-frame step (1.0 for a still clip)

    def __len__(self) -> int:
        return len(self.poses)

    @classmethod
    def from_video_frames(cls, poses, intrinsics, width: int, height: int, temporal_stride: int = 4,
                          max_video_frames: Optional[int] = None,
                          reference: tuple[int, int] = REFERENCE_SIZE) -> Trajectory:
        """Per video frame poses [F, 4, 4] (OpenCV camera-to-world) and intrinsics [F, 4] (at the 832x480
        reference size), as the reference's offline path reads them: cut to 4n+1 frames (and to the
        session's video frames), resampled to (F-1)/4+1 latent frames over the clip (SLERP rotation,
        linear translation and intrinsics), intrinsics scaled to width x height, translations normalised
        by the clip's largest frame-to-frame step."""
        poses, intrinsics = check_trajectory(poses, intrinsics)
        used = (len(poses) - 1) // temporal_stride * temporal_stride + 1
        if max_video_frames is not None:
            used = min(used, max_video_frames)
        poses, intrinsics = poses[:used], intrinsics[:used]
        latent = (used - 1) // temporal_stride + 1
        targets = np.linspace(0, used - 1, latent)
        sampled = resample_poses(poses, targets)
        sampled = np.linalg.inv(sampled[0]) @ sampled                      # relative to the first frame
        sampled[0] = np.eye(4)
        k = np.stack([np.interp(targets, np.arange(used), column) for column in intrinsics.T], axis=1)
        k = k * np.array([width / reference[0], height / reference[1]] * 2)
        steps = np.linalg.norm((np.linalg.inv(sampled[:-1]) @ sampled[1:])[:, :3, 3], axis=1)
        largest = float(steps.max()) if len(steps) else 0.0
        return cls(sampled, k, largest if largest >= STILL else 1.0)


def yaw_pitch_deg(pose: np.ndarray) -> tuple[float, float]:
    """(yaw, pitch) in degrees of a pose's viewing direction (OpenCV axes: yaw + turns right, pitch + up)."""
    forward = pose[:3, 2]
    return (math.degrees(math.atan2(forward[0], forward[2])),
            math.degrees(math.asin(float(np.clip(-forward[1], -1.0, 1.0)))))


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


def trajectory(keys_per_chunk: Sequence[Sequence[str]], width: int, height: int,
               offline: Optional[Trajectory] = None) -> list[dict]:
    """What the model receives, one entry per latent frame, for a key script (and an offline path placing
    the first frames): the camera-to-world pose, the frame-to-frame translation as scaled for the model,
    the intrinsics, the pitch (the keys' counter; for offline frames the pose's) and the cumulative yaw."""
    rig = CameraRig.default(width, height, offline)
    out, yaw = [], 0.0
    for keys in keys_per_chunk:
        planned = rig.plan(Controls(keys=tuple(keys)), len(keys))
        relative, table = rig.relative(planned), rig.frame_intrinsics(planned)
        for i, (pose, rel, pitch, frame_keys) in enumerate(zip(planned.poses, relative, planned.pitch_deg, keys)):
            if i < planned.scripted:
                pose_yaw, pitch = yaw_pitch_deg(pose)
                yaw += (pose_yaw - yaw + 180.0) % 360.0 - 180.0            # unwrapped across frames
            else:
                pressed = parse_keys(frame_keys)
                yaw += YAW_STEP_DEG * (("l" in pressed) - ("j" in pressed))
            out.append({"frame": len(out), "c2w": pose.tolist(), "translation": rel[:3, 3].tolist(),
                        "intrinsics": table[i].tolist(), "pitch_deg": pitch, "yaw_deg": yaw})
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
    frame: int = 0                          # latent frames committed (the position in an offline trajectory)


class PlannedChunk(NamedTuple):
    poses: np.ndarray                       # absolute poses [frames, 4, 4]
    state: CameraState                      # the rig's state once the chunk is committed
    live_event: bool                        # an SE3 event moved the camera in this chunk (fixed unit)
    pitch_deg: tuple[float, ...] = ()       # the key pitch counter after each frame
    scripted: int = 0                       # leading frames of this chunk placed by the offline trajectory


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
    """A session's camera: intrinsics at the target size, the committed CameraState and, for an offline
    path, the Trajectory that places the first len(trajectory) latent frames (controls then act from its
    last pose)."""

    def __init__(self, intrinsics: Intrinsics, translation_unit: float = TRANSLATION_UNIT,
                 trajectory: Optional[Trajectory] = None):
        self.intrinsics = intrinsics
        self.translation_unit = translation_unit          # for chunks moved by live SE3 events
        self.trajectory = trajectory
        self.reset()

    @classmethod
    def default(cls, width: int, height: int, trajectory: Optional[Trajectory] = None) -> CameraRig:
        if trajectory is not None:
            fx, fy, cx, cy = trajectory.intrinsics[-1]
            return cls(Intrinsics(fx, fy, cx, cy), trajectory=trajectory)
        return cls(Intrinsics.keyboard(width, height))

    def reset(self) -> None:
        self.state = CameraState(pose=np.eye(4))

    def scripted_frames(self, start: int, frames: int) -> int:
        """How many of the `frames` latent frames from `start` the offline trajectory places."""
        return 0 if self.trajectory is None else max(0, min(frames, len(self.trajectory) - start))

    def plan(self, controls: Optional[Controls], frames: int) -> PlannedChunk:
        """Absolute poses [frames, 4, 4] of the next chunk and the state after it; hand the plan to rays()
        and, once the chunk succeeded, to commit()."""
        state = self.state
        if controls is not None and controls.camera is not None:
            state = dataclasses.replace(state, motion=controls.camera, motion_start=state.pose, motion_step=0)
        keys = controls.keys if controls is not None and controls.keys is not None else ("",) * frames
        if len(keys) != frames:
            raise CameraError(f"{len(keys)} key sets for a chunk of {frames} latent frames")
        scripted = self.scripted_frames(state.frame, frames)
        pose, step, motion, pitch = state.pose, state.motion_step, state.motion, state.pitch_deg
        poses, pitches, live = [], [], False
        for i, frame_keys in enumerate(keys):
            if i < scripted:                           # the offline path places this frame
                pose = self.trajectory.poses[state.frame + i]
                poses.append(pose)
                pitches.append(pitch)
                continue
            if motion is not None:
                live = True
                step += 1
                pose = self._motion_pose(motion, state.motion_start, pose, step, frames)
                if motion.mode == "target" and step >= motion.transition_frames(frames):
                    motion = None                      # arrived: keys move the camera from here on
            pose, pitch = keyboard_step(pose, frame_keys, pitch)
            poses.append(pose)
            pitches.append(pitch)
        after = dataclasses.replace(state, pose=pose, motion=motion, motion_step=step, pitch_deg=pitch,
                                    frame=state.frame + frames)
        return PlannedChunk(np.stack(poses), after, live, tuple(pitches), scripted)

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
        """The chunk's frame-to-frame transforms as the model receives them [frames, 4, 4]: translations of
        offline frames in the clip's unit; of the others in the live controller's unit, or (keys) by their
        largest step."""
        n = planned.scripted
        unit = self.translation_unit if planned.live_event else None
        if n == 0:
            return relative_poses(self.state.pose, planned.poses, unit)
        head = relative_poses(self.state.pose, planned.poses[:n], self.trajectory.unit)
        if n == len(planned.poses):
            return head
        return np.concatenate([head, relative_poses(planned.poses[n - 1], planned.poses[n:], unit)])

    def frame_intrinsics(self, planned: PlannedChunk) -> np.ndarray:
        """(fx, fy, cx, cy) of each frame of the chunk [frames, 4]."""
        table = intrinsics_table(self.intrinsics, len(planned.poses))
        n, start = planned.scripted, self.state.frame
        if n:
            table[:n] = self.trajectory.intrinsics[start:start + n]
        return table

    def rays(self, planned: PlannedChunk, height: int, width: int, device="cpu") -> Tensor:
        return ray_map(self.relative(planned), self.frame_intrinsics(planned), height, width, device)

    def commit(self, planned: PlannedChunk) -> None:
        self.state = planned.state
