"""Pose math in float64 numpy (a handful of 4x4s per chunk): rotations, quaternions, camera-to-world poses,
and the frame-to-frame transforms the model receives, with their translation unit.

Poses are 4x4 camera-to-world matrices in OpenCV axes (x right, y down, z forward); quaternions are
(x, y, z, w).
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Optional

import numpy as np

TRANSLATION_UNIT = 0.05              # one controller step; live translations are divided by it
STILL = 1e-9                         # a frame-to-frame translation shorter than this is no move


class CameraError(ValueError):
    """Bad camera input (keys, quaternion, mode); the message says what is wrong."""


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


def slerp(q0: np.ndarray, q1: np.ndarray, alpha: float) -> np.ndarray:
    """Spherical linear interpolation of unit quaternions (q1 already on q0's hemisphere)."""
    cos = float(np.clip(np.dot(q0, q1), -1.0, 1.0))
    if cos > 1 - 1e-12:
        return q0 if alpha == 0 else nlerp(q0, q1, alpha)
    theta = math.acos(cos)
    q = (math.sin((1 - alpha) * theta) * q0 + math.sin(alpha * theta) * q1) / math.sin(theta)
    return q / np.linalg.norm(q)


def make_pose(rotation: np.ndarray, translation: Sequence[float]) -> np.ndarray:
    pose = np.eye(4)
    pose[:3, :3] = rotation
    pose[:3, 3] = translation
    return pose


def yaw_pitch_deg(pose: np.ndarray) -> tuple[float, float]:
    """(yaw, pitch) in degrees of a pose's viewing direction (OpenCV axes: yaw + turns right, pitch + up)."""
    forward = pose[:3, 2]
    return (math.degrees(math.atan2(forward[0], forward[2])),
            math.degrees(math.asin(float(np.clip(-forward[1], -1.0, 1.0)))))


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
