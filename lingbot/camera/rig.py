"""A session's camera: the rig plans a chunk's absolute poses from its controls (and an offline path), gives the
chunk's relative transforms, intrinsics and rays, and commits the state once the chunk succeeded; and
`trajectory`, what the model receives for a key script, frame by frame.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple, Optional

import numpy as np
from torch import Tensor

from .controls import YAW_STEP_DEG, CameraEvent, Controls, keyboard_step, parse_keys
from .offline import Trajectory
from .poses import (
    TRANSLATION_UNIT,
    CameraError,
    make_pose,
    matrix_to_quat,
    nlerp,
    quat_to_matrix,
    relative_poses,
    yaw_pitch_deg,
)
from .rays import Intrinsics, intrinsics_table, ray_map


@dataclass(frozen=True)
class CameraState:
    """Everything the rig carries from chunk to chunk (immutable: a failed chunk changes nothing)."""
    pose: np.ndarray                        # the anchor: last committed absolute pose [4, 4]
    motion: Optional[CameraEvent] = None    # the active SE3 event (a finished target is dropped)
    motion_start: Optional[np.ndarray] = None
    motion_step: int = 0
    pitch_deg: float = 0.0                  # the keys' cumulative pitch (its own counter, as the reference)
    frame: int = 0                          # latent frames committed (the position in an offline trajectory)


class ChunkPoses(NamedTuple):
    """One chunk's camera as the rig plans it (CameraRig.plan), committed once the chunk ran."""
    poses: np.ndarray                       # absolute poses [frames, 4, 4]
    state: CameraState                      # the rig's state once the chunk is committed
    live_event: bool                        # an SE3 event moved the camera in this chunk (fixed unit)
    pitch_deg: tuple[float, ...] = ()       # the key pitch counter after each frame
    scripted: int = 0                       # leading frames of this chunk placed by the offline trajectory


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

    def plan(self, controls: Optional[Controls], frames: int) -> ChunkPoses:
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
        return ChunkPoses(np.stack(poses), after, live, tuple(pitches), scripted)

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

    def relative(self, planned: ChunkPoses) -> np.ndarray:
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

    def frame_intrinsics(self, planned: ChunkPoses) -> np.ndarray:
        """(fx, fy, cx, cy) of each frame of the chunk [frames, 4]."""
        table = intrinsics_table(self.intrinsics, len(planned.poses))
        n, start = planned.scripted, self.state.frame
        if n:
            table[:n] = self.trajectory.intrinsics[start:start + n]
        return table

    def rays(self, planned: ChunkPoses, height: int, width: int, device="cpu") -> Tensor:
        return ray_map(self.relative(planned), self.frame_intrinsics(planned), height, width, device)

    def commit(self, planned: ChunkPoses) -> None:
        self.state = planned.state


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
