"""Camera and keyboard math against hand-computed values."""
import math

import numpy as np
import pytest
import torch

from lingbot.camera import (
    CameraError,
    CameraEvent,
    CameraRig,
    Controls,
    Intrinsics,
    Trajectory,
    TrajectoryError,
    camera_patches,
    keyboard_step,
    make_pose,
    matrix_to_quat,
    parse_key_script,
    parse_keys,
    quat_to_matrix,
    ray_map,
    relative_poses,
    resample_poses,
    rot_x,
    rot_y,
)

C4, S4 = math.cos(math.radians(4)), math.sin(math.radians(4))
C6, S6 = math.cos(math.radians(6)), math.sin(math.radians(6))
I4 = np.eye(4)


def test_rotation_matrices_by_hand():
    np.testing.assert_allclose(rot_x(4), [[1, 0, 0], [0, C4, -S4], [0, S4, C4]], atol=1e-15)
    np.testing.assert_allclose(rot_y(6), [[C6, 0, S6], [0, 1, 0], [-S6, 0, C6]], atol=1e-15)


@pytest.mark.parametrize("keys,translation", [
    ("w", (0, 0, 0.05)), ("s", (0, 0, -0.05)), ("d", (0.05, 0, 0)), ("a", (-0.05, 0, 0)),
    ("wd", (0.05, 0, 0.05)), ("ws", (0, 0, 0)), ("", (0, 0, 0))])
def test_keyboard_translation(keys, translation):
    pose, pitch = keyboard_step(I4, keys)
    np.testing.assert_allclose(pose[:3, 3], translation, atol=1e-15)
    np.testing.assert_allclose(pose[:3, :3], np.eye(3), atol=1e-15)
    assert pitch == 0.0


def test_keyboard_yaw_turns_right_and_moves_along_new_heading():
    pose, _ = keyboard_step(I4, "lw")
    np.testing.assert_allclose(pose[:3, :3], [[C6, 0, S6], [0, 1, 0], [-S6, 0, C6]], atol=1e-15)
    np.testing.assert_allclose(pose[:3, 3], [0.05 * S6, 0, 0.05 * C6], atol=1e-15)
    pose, _ = keyboard_step(I4, "j")
    np.testing.assert_allclose(pose[:3, :3], [[C6, 0, -S6], [0, 1, 0], [S6, 0, C6]], atol=1e-15)


def test_keyboard_pitch_up_keeps_movement_horizontal():
    pose, pitch = keyboard_step(I4, "iw")
    assert pitch == pytest.approx(4.0, abs=1e-12)
    np.testing.assert_allclose(pose[:3, :3] @ [0, 0, 1], [0, -S4, C4], atol=1e-15)   # looks up (y is down)
    np.testing.assert_allclose(pose[:3, 3], [0, 0, 0.05], atol=1e-15)
    # R' = Ry(yaw) . R . Rx(pitch): yaw about the world axis after pitch about the camera axis
    pose2, _ = keyboard_step(pose, "l")
    np.testing.assert_allclose(pose2[:3, :3], rot_y(6) @ rot_x(4), atol=1e-15)


def test_a_pitch_step_past_85_degrees_is_dropped():
    """The pitch lives in its own counter; a step that would pass +/-85 is dropped, not cut short:
    21 presses of i give 84, the 22nd is dropped (88 > 85), then k gives 80."""
    pose, pitch = I4, 0.0
    pitches = []
    for _ in range(22):
        pose, pitch = keyboard_step(pose, "i", pitch)
        pitches.append(pitch)
    assert pitches[19:] == [80.0, 84.0, 84.0]
    np.testing.assert_allclose(pose[:3, :3], rot_x(84), atol=1e-9)
    pose, pitch = keyboard_step(pose, "k", pitch)
    assert pitch == 80.0
    np.testing.assert_allclose(pose[:3, :3], rot_x(80), atol=1e-9)
    down = np.eye(4)
    down[:3, :3] = rot_y(30) @ rot_x(-84)
    pose, pitch = keyboard_step(down, "k", -84.0)                      # -88 would pass -85: dropped
    assert pitch == -84.0
    np.testing.assert_allclose(pose[:3, :3], rot_y(30) @ rot_x(-84), atol=1e-9)
    pose, pitch = keyboard_step(down, "kj", -84.0)                     # the yaw of the same frame still applies
    np.testing.assert_allclose(pose[:3, :3], rot_y(-6) @ rot_y(30) @ rot_x(-84), atol=1e-9)


def test_the_rig_keeps_the_pitch_counter_across_chunks():
    rig = CameraRig.default(112, 64)
    for _ in range(7):                                                 # 21 presses of i
        planned = rig.plan(Controls(keys=("i", "i", "i")), 3)
        rig.commit(planned)
    assert rig.state.pitch_deg == 84.0
    planned = rig.plan(Controls(keys=("i", "k", "")), 3)
    assert planned.state.pitch_deg == 80.0
    rig.reset()
    assert rig.state.pitch_deg == 0.0


@pytest.mark.parametrize("keys,steps", [
    (("wd", "wd", "wd"), [1.0, 1.0, 1.0]),                             # a held diagonal: unit steps
    (("wd", "w", ""), [1.0, 0.05 / math.hypot(0.05, 0.05), 0.0]),     # [1, 0.707, 0]
    (("w", "w", "w"), [1.0, 1.0, 1.0]),
    (("", "", ""), [0.0, 0.0, 0.0]),                                   # no move: nothing to divide by
    (("i", "i", "l"), [0.0, 0.0, 0.0]),                                # turning only: the inverse's rounding is no move
])
def test_key_moves_are_scaled_by_the_chunks_largest_step(keys, steps):
    rig = CameraRig.default(112, 64)
    rel = rig.relative(rig.plan(Controls(keys=keys), 3))
    np.testing.assert_allclose(np.linalg.norm(rel[:, :3, 3], axis=1), steps, atol=1e-12)


def test_live_se3_moves_keep_the_fixed_unit():
    rig = CameraRig.default(112, 64)
    planned = rig.plan(Controls(camera=CameraEvent("velocity", (0.0, 0.0, 0.1), (0, 0, 0, 1))), 3)
    assert planned.live_event
    np.testing.assert_allclose(rig.relative(planned)[:, :3, 3], [[0, 0, 2]] * 3, atol=1e-12)   # 0.1 / 0.05


def test_bad_keys_are_refused():
    assert parse_keys("W+A") == "wa"
    with pytest.raises(CameraError, match="unknown key\\(s\\) 'qx' in 'wqx'"):
        parse_keys("wqx")


def test_relative_poses_chain_from_anchor_and_scale_translation():
    anchor = np.eye(4)
    anchor[:3, :3] = rot_y(90)
    anchor[:3, 3] = [1, 2, 3]
    step = np.eye(4)
    step[:3, 3] = [0, 0, 0.05]
    poses = np.stack([anchor @ step, anchor @ step @ step])
    rel = relative_poses(anchor, poses)
    for r in rel:          # each frame moved 0.05 forward in its own frame: one controller unit
        np.testing.assert_allclose(r[:3, :3], np.eye(3), atol=1e-12)
        np.testing.assert_allclose(r[:3, 3], [0, 0, 1], atol=1e-12)


def test_ray_map_by_hand():
    rel = np.eye(4)[None].repeat(2, 0)
    rel[1, :3, :3] = rot_y(90)
    rel[1, :3, 3] = [1, 0, 0]
    rays = ray_map(rel, Intrinsics(fx=1, fy=2, cx=1, cy=1), height=2, width=2)
    assert rays.shape == (6, 2, 2, 2)
    n = math.sqrt(0.25 + 0.0625 + 1)
    d00 = np.array([-0.5, -0.25, 1]) / n                          # pixel (x=0, y=0), centre (0.5, 0.5)
    np.testing.assert_allclose(rays[3:, 0, 0, 0], d00, atol=1e-6)
    np.testing.assert_allclose(rays[:3, 0, 0, 0], [0, 0, 0], atol=0)
    d11 = np.array([0.5, 0.25, 1]) / n                            # pixel (x=1, y=1)
    np.testing.assert_allclose(rays[3:, 0, 1, 1], d11, atol=1e-6)
    np.testing.assert_allclose(rays[3:, 1, 0, 0], [d00[2], d00[1], -d00[0]], atol=1e-6)   # Ry(90) . d
    np.testing.assert_allclose(rays[:3, 1].reshape(3, -1).T, [[1, 0, 0]] * 4, atol=0)


def test_intrinsics_scale_from_reference_size():
    k = Intrinsics(500, 500, 416, 240).scaled(416, 240)
    assert k == Intrinsics(250, 250, 208, 120)
    assert Intrinsics.keyboard(112, 64) == Intrinsics(500, 500, 56, 32)


def test_camera_patches_layout():
    f, h, w = 2, 32, 48
    rays = torch.randn(6, f, h, w, generator=torch.Generator().manual_seed(0))
    patches = camera_patches(rays)
    hp, wp = h // 16, w // 16
    assert patches.shape == (f * hp * wp, 1536)
    # feature (c, i, j, a, b) of token (t, y, x) is the ray value at pixel
    # row (2y + a) * 8 + i, column (2x + b) * 8 + j: unshuffle channel c*64 + i*8 + j, then patch (a, b)
    for (t, y, x, c, i, j, a, b) in [(0, 0, 0, 0, 0, 0, 0, 0), (1, 1, 2, 5, 7, 3, 1, 0), (0, 1, 1, 3, 2, 6, 0, 1),
                                     (1, 0, 2, 1, 4, 4, 1, 1)]:
        token = (t * hp + y) * wp + x
        feature = (c * 64 + i * 8 + j) * 4 + a * 2 + b
        assert patches[token, feature] == rays[c, t, (2 * y + a) * 8 + i, (2 * x + b) * 8 + j]


def test_quaternion_round_trip():
    q = np.array([0.1, -0.4, 0.3, 0.85])
    q /= np.linalg.norm(q)
    r = quat_to_matrix(q)
    np.testing.assert_allclose(r @ r.T, np.eye(3), atol=1e-12)
    np.testing.assert_allclose(matrix_to_quat(r), q, atol=1e-12)
    np.testing.assert_allclose(quat_to_matrix([0, math.sin(math.pi / 4), 0, math.cos(math.pi / 4)]), rot_y(90),
                               atol=1e-12)


def test_target_mode_interpolates_over_transition_chunks():
    rig = CameraRig.default(112, 64)
    q90 = (0.0, math.sin(math.pi / 4), 0.0, math.cos(math.pi / 4))
    event = CameraEvent("target", (0.0, 0.0, 3.0), q90, transition_chunks=1)
    planned = rig.plan(Controls(camera=event), 3)
    poses, state = planned.poses, planned.state
    np.testing.assert_allclose(poses[:, :3, 3], [[0, 0, 1], [0, 0, 2], [0, 0, 3]], atol=1e-12)
    q_third = np.array([0, q90[1] / 3, 0, 2 / 3 + q90[3] / 3])            # nlerp at alpha 1/3
    q_third /= np.linalg.norm(q_third)
    np.testing.assert_allclose(poses[0, :3, :3], quat_to_matrix(q_third), atol=1e-12)
    np.testing.assert_allclose(poses[2, :3, :3], rot_y(90), atol=1e-12)
    rig.commit(rig.plan(Controls(camera=event), 3))
    later = rig.plan(None, 3).poses                                          # stays at the target
    np.testing.assert_allclose(later[:, :3, 3], [[0, 0, 3]] * 3, atol=1e-12)
    assert state.motion is None                                           # arrived: the event is done
    moved = rig.plan(Controls(keys=("w", "w", "w")), 3).poses                # keys move on from the target
    np.testing.assert_allclose(moved[:, 2, 3], [3, 3, 3], atol=1e-12)      # yaw 90: forward is +x
    np.testing.assert_allclose(moved[:, 0, 3], [0.05, 0.10, 0.15], atol=1e-12)
    snap = CameraRig.default(112, 64).plan(
        Controls(camera=CameraEvent("target", (1.0, 0.0, 0.0), (0, 0, 0, 1), 0)), 3).poses
    np.testing.assert_allclose(snap[:, :3, 3], [[1, 0, 0]] * 3, atol=0)


def test_velocity_mode_applies_delta_every_latent_frame_until_replaced():
    rig = CameraRig.default(112, 64)
    planned = rig.plan(Controls(camera=CameraEvent("velocity", (0.0, 0.0, 0.05), (0, 0, 0, 1))), 3)
    np.testing.assert_allclose(planned[0][:, 2, 3], [0.05, 0.10, 0.15], atol=1e-12)
    rig.commit(planned)
    planned = rig.plan(None, 3)
    np.testing.assert_allclose(planned[0][:, 2, 3], [0.20, 0.25, 0.30], atol=1e-12)
    rig.commit(planned)
    stop = CameraEvent("velocity", (0.0, 0.0, 0.0), (0, 0, 0, 1))
    planned = rig.plan(Controls(camera=stop, keys=("d", "", "")), 3)
    np.testing.assert_allclose(planned[0][:, :3, 3], [[0.05, 0, 0.30]] * 3, atol=1e-12)


def test_plan_does_not_change_state_until_commit():
    rig = CameraRig.default(112, 64)
    a = rig.plan(Controls(keys=("w", "w", "l")), 3).poses
    b = rig.plan(Controls(keys=("w", "w", "l")), 3).poses
    np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(rig.state.pose, np.eye(4))
    with pytest.raises(CameraError, match="2 key sets for a chunk of 3 latent frames"):
        rig.plan(Controls(keys=("w", "w")), 3)


@pytest.mark.parametrize("kwargs,message", [
    (dict(mode="orbit"), "camera mode 'orbit' must be 'target' or 'velocity'"),
    (dict(translation=(0.0, 1.0)), "camera translation \\[0.0, 1.0\\] must be 3 finite numbers"),
    (dict(rotation=(0.0, 0.0, 0.0, 0.0)), "camera rotation quaternion has zero length"),
    (dict(translation=(0.0, float("nan"), 0.0)), "must be 3 finite numbers"),
    (dict(transition_chunks=-1), "transition_chunks -1 must be >= 0"),
])
def test_bad_camera_events_are_refused(kwargs, message):
    args = dict(mode="target", translation=(0.0, 0.0, 0.0), rotation=(0.0, 0.0, 0.0, 1.0))
    args.update(kwargs)
    with pytest.raises(CameraError, match=message):
        CameraEvent(**args)


def test_key_script_parsing():
    assert parse_key_script("w,w,wa,,J", chunks=2, frames_per_chunk=3) == [("w", "w", "wa"), ("", "j", "")]
    assert parse_key_script("", chunks=1, frames_per_chunk=3) == [("", "", "")]
    with pytest.raises(CameraError, match="the key script has 7 key sets but 2 chunks hold 6 latent frames"):
        parse_key_script("w,w,w,w,w,w,w", chunks=2, frames_per_chunk=3)
    with pytest.raises(CameraError, match="unknown key"):
        parse_key_script("w,x", chunks=1, frames_per_chunk=3)


# ---- offline trajectories ---------------------------------------------------------------------------
def orbit_clip(frames=14):
    """A clip yawing 10 deg and moving 0.1 along world z per video frame, starting away from the origin,
    with intrinsics (500 + i, 400, 416, 240) at 832x480."""
    poses = np.stack([make_pose(rot_y(30 + 10 * i), (1.0, 2.0, 3.0 + 0.1 * i)) for i in range(frames)])
    intrinsics = np.array([[500.0 + i, 400.0, 416.0, 240.0] for i in range(frames)])
    return poses, intrinsics


def test_offline_trajectory_resampled_relative_and_normalised_by_hand():
    poses, intrinsics = orbit_clip(14)                      # 14 frames: cut to 4n+1 = 13 -> 4 latent frames
    traj = Trajectory.from_video_frames(poses, intrinsics, width=416, height=240)
    assert len(traj) == 4
    for k in range(4):                                      # video frames 0, 4, 8, 12 relative to frame 0
        expected = np.linalg.inv(poses[0]) @ poses[4 * k]
        np.testing.assert_allclose(traj.poses[k][:3, :3], rot_y(40 * k), atol=1e-12)
        np.testing.assert_allclose(traj.poses[k], expected, atol=1e-12)
        np.testing.assert_allclose(traj.intrinsics[k], [(500 + 4 * k) / 2, 200, 208, 120], atol=1e-12)
    assert traj.unit == pytest.approx(0.4, abs=1e-12)      # every latent step moves 4 x 0.1
    rig = CameraRig.default(416, 240, traj)
    planned = rig.plan(None, 3)
    rel = rig.relative(planned)
    np.testing.assert_allclose(rel[0], np.eye(4), atol=1e-12)
    for k in (1, 2):                                        # unit steps along the previous frame's view
        a = math.radians(30 + 40 * (k - 1))
        np.testing.assert_allclose(rel[k][:3, 3], [-math.sin(a), 0, math.cos(a)], atol=1e-12)
        np.testing.assert_allclose(rel[k][:3, :3], rot_y(40), atol=1e-12)
    np.testing.assert_allclose(rig.frame_intrinsics(planned)[:, 0], [250, 252, 254], atol=1e-12)
    rig.commit(planned)
    planned = rig.plan(Controls(keys=("w", "w", "w")), 3)  # frame 3 is the clip's last; keys move from there
    rel = rig.relative(planned)
    a = math.radians(30 + 80)
    np.testing.assert_allclose(rel[0][:3, 3], [-math.sin(a), 0, math.cos(a)], atol=1e-12)
    np.testing.assert_allclose(rel[1:, :3, 3], [[0, 0, 1], [0, 0, 1]], atol=1e-12)   # keys: their own unit
    np.testing.assert_allclose(planned.poses[0], traj.poses[3], atol=0)
    np.testing.assert_allclose(rig.frame_intrinsics(planned)[:, 0], [256, 256, 256], atol=1e-12)
    # the session's length cuts the clip first, as the reference cuts it to num_frames
    assert len(Trajectory.from_video_frames(poses, intrinsics, 416, 240, max_video_frames=9)) == 3


def test_slerp_resampling_between_frames():
    start = np.eye(4)
    end = make_pose(rot_y(90), (2.0, 0.0, 0.0))
    mid = resample_poses(np.stack([start, end]), np.array([0.0, 0.5, 0.25, 1.0]))
    np.testing.assert_allclose(mid[1][:3, :3], rot_y(45), atol=1e-12)
    np.testing.assert_allclose(mid[1][:3, 3], [1, 0, 0], atol=1e-12)
    np.testing.assert_allclose(mid[2][:3, :3], rot_y(22.5), atol=1e-12)
    np.testing.assert_allclose(mid[3], end, atol=1e-12)
    # a quaternion chain that flips sign between samples still takes the short way (170 -> 190 deg via 180)
    flip = resample_poses(np.stack([make_pose(rot_y(170), (0, 0, 0)), make_pose(rot_y(190), (0, 0, 0))]),
                          np.array([0.5]))
    np.testing.assert_allclose(flip[0][:3, :3], rot_y(180), atol=1e-12)


def test_offline_trajectory_rays_use_each_frames_intrinsics():
    poses, intrinsics = orbit_clip(5)                      # 2 latent frames
    intrinsics[4] = [800.0, 600.0, 300.0, 200.0]
    traj = Trajectory.from_video_frames(poses, intrinsics, width=832, height=480)
    rig = CameraRig.default(832, 480, traj)
    rays = rig.rays(rig.plan(None, 3), 16, 32)            # 16x32 pixels, principal points far off: skewed rays
    d = rays[3:, 1, 0, 0].double()                        # frame 1, pixel (0, 0): direction in frame 0's axes
    cam = torch.tensor([(0.5 - 300) / 800, (0.5 - 200) / 600, 1.0], dtype=torch.float64)
    expected = torch.as_tensor(rot_y(40)) @ (cam / cam.norm())
    torch.testing.assert_close(d, expected, atol=1e-6, rtol=0)


@pytest.mark.parametrize("mutate,code", [
    (lambda p, k: (p[:, :3], k), "trajectory_shape"),
    (lambda p, k: (p, k[:-1]), "trajectory_shape"),
    (lambda p, k: (p[:0], k[:0]), "trajectory_shape"),
    (lambda p, k: (p, k[:, :3]), "trajectory_shape"),
    (lambda p, k: (np.where(np.arange(4) == 3, np.nan, p), k), "trajectory_not_finite"),
    (lambda p, k: (p, np.where(np.arange(4) == 0, np.inf, k)), "trajectory_not_finite"),
    (lambda p, k: (p * np.array([1.01, 1, 1, 1])[:, None], k), "trajectory_not_rigid"),        # scaled rows
    (lambda p, k: (p @ np.diag([-1.0, 1, 1, 1]), k), "trajectory_not_rigid"),                 # a mirror
    (lambda p, k: (p + np.array([[0, 0, 0, 0]] * 3 + [[0, 0, 0.5, 0]]), k), "trajectory_not_rigid"),
    (lambda p, k: (p, k * np.array([1, 1, -1, 1])), "trajectory_intrinsics"),
    (lambda p, k: (p, k * np.array([0, 1, 1, 1])), "trajectory_intrinsics"),
])
def test_bad_offline_trajectories_have_their_codes(mutate, code):
    poses, intrinsics = mutate(*orbit_clip(5))
    with pytest.raises(TrajectoryError) as e:
        Trajectory.from_video_frames(poses, intrinsics, 112, 64)
    assert e.value.code == code
    poses, intrinsics = orbit_clip(5)
    poses[2, :3, :3] = rot_y(30 + 20) @ (np.eye(3) + 2e-4)           # within the 1e-3 rigidity tolerance: taken
    assert len(Trajectory.from_video_frames(poses, intrinsics, 112, 64)) == 2
