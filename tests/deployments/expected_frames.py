"""The frames a served session should show, made in process: the same session through the in-process pipeline
(SP-1), and frames as a client sees them after the muxer's H.264 encoder; a camera path to send."""
import io

import numpy as np

from lingbot.config import LINGBOT_GEOMETRY
from lingbot.io.video import read_frames
from tests.deployments.clients import H, W, png


def orbit_trajectory(frames):
    """Per video frame poses yawing 3 deg and stepping 0.02 along z, intrinsics at 832x480 (JSON lists)."""
    from lingbot.camera import make_pose, rot_y
    return {"poses": [make_pose(rot_y(3 * i), (0.0, 0.0, 0.02 * i)).tolist() for i in range(frames)],
            "intrinsics": [[480.0, 480.0, 416.0, 240.0]] * frames}


def in_process_frames(chunks, seed, prompt, flow_shift=None, trajectory_json=None, prompt_change=None,
                      controls=None, decoder="tae", rungs=None):
    """The same session through the in-process pipeline (SP-1): the frames the served one should show.
    `prompt_change`: (chunk, text, transition_chunks) applied at that chunk; `controls`: per chunk; `rungs`: per
    chunk, (denoising steps, decoder) (the tiny decoder beside the session's own)."""
    from lingbot.builder import build_pipeline
    from lingbot.camera import CameraRig, Trajectory
    from lingbot.io.images import open_image, resize_image
    pipeline = build_pipeline("tiny", decoder=decoder if rungs is None else (decoder, "tae"))
    image = resize_image(open_image(png()), W, H)
    traj = None
    if trajectory_json is not None:
        traj = Trajectory.from_video_frames(trajectory_json["poses"], trajectory_json["intrinsics"], W, H,
                                            max_video_frames=LINGBOT_GEOMETRY.video_frames(chunks))
    world = pipeline.new_session(image, prompt, seed=seed, rig=CameraRig.default(W, H, traj), flow_shift=flow_shift,
                                 switch_to=() if rungs is None else ("tae",))
    frames = []
    for k in range(chunks):
        change = prompt_change[1:] if prompt_change is not None and prompt_change[0] == k else None
        steps, rung_decoder = (None, None) if rungs is None else rungs[k]
        frames.append(world.step(controls[k] if controls else None, prompt=change, steps=steps,
                                 decoder=rung_decoder).frames.numpy())
    return np.concatenate(frames)


def through_h264(frames, fps=16.0):
    """Frames as a client sees them after the muxer's encoder (same codec, CRF, preset and frame rate)."""
    from lingbot.io.video import H264Writer
    buf = io.BytesIO()
    writer = H264Writer(buf, W, H, fps)
    writer.write(frames)
    writer.close()
    return read_frames(buf.getvalue()).astype(float)
