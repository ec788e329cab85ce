"""Offline trajectories: the reference's poses.npy / intrinsics.npy input, checked (each violation has a stable
code, sent to WebSocket clients) and resampled to one pose per latent frame.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import numpy as np

from .poses import STILL, CameraError, make_pose, matrix_to_quat, quat_to_matrix, slerp
from .rays import REFERENCE_SIZE

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
