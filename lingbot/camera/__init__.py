"""Camera control: poses -> per-pixel rays [o, d] -> camera patches for `patch_embedding_wancamctrl`.

Conventions (docs/architecture.md, "Camera and keys"): poses are 4x4 camera-to-world matrices in OpenCV axes (x right,
y down, z forward), one per latent frame. Each chunk's poses are preceded by an anchor (the previous
chunk's last pose; identity for a new session) and turned into frame-to-frame relative transforms
inv(P[i-1]) @ P[i]. Translations are scaled as the reference runtime scales them: a chunk moved by a live
SE3 event divides them by the 0.05 controller unit; a chunk moved by keys (live or scripted) divides them
by its largest frame-to-frame step (when that is non-zero), so a held key gives unit steps.

By concern, from the bottom: the pose math and the frame-to-frame transforms (poses.py), intrinsics, rays
and patches (rays.py), offline trajectories (offline.py), keys and SE3 events (controls.py), and a
session's rig, which turns a chunk's controls into its poses and rays (rig.py). Every public name is
re-exported here: `from lingbot.camera import CameraRig, Controls`.
"""
from .controls import (
    KEY_STEP,
    PITCH_LIMIT_DEG,
    PITCH_STEP_DEG,
    VALID_KEYS,
    YAW_STEP_DEG,
    CameraEvent,
    Controls,
    keyboard_step,
    parse_key_script,
    parse_keys,
)
from .offline import ROTATION_TOLERANCE, Trajectory, TrajectoryError, check_trajectory, resample_poses
from .poses import (
    STILL,
    TRANSLATION_UNIT,
    CameraError,
    make_pose,
    matrix_to_quat,
    nlerp,
    quat_to_matrix,
    relative_poses,
    rot_x,
    rot_y,
    slerp,
    yaw_pitch_deg,
)
from .rays import KEYBOARD_FOCAL, REFERENCE_SIZE, Intrinsics, camera_patches, intrinsics_table, ray_map
from .rig import CameraRig, CameraState, ChunkPoses, trajectory

__all__ = [
    "KEYBOARD_FOCAL", "KEY_STEP", "PITCH_LIMIT_DEG", "PITCH_STEP_DEG", "REFERENCE_SIZE", "ROTATION_TOLERANCE", "STILL",
    "TRANSLATION_UNIT", "VALID_KEYS", "YAW_STEP_DEG",
    "CameraError", "CameraEvent", "CameraRig", "CameraState", "ChunkPoses", "Controls", "Intrinsics", "Trajectory",
    "TrajectoryError",
    "camera_patches", "check_trajectory", "intrinsics_table", "keyboard_step", "make_pose", "matrix_to_quat", "nlerp",
    "parse_key_script", "parse_keys", "quat_to_matrix", "ray_map", "relative_poses", "resample_poses", "rot_x", "rot_y",
    "slerp", "trajectory", "yaw_pitch_deg",
]
