"""What a served session's inputs do to its frames, against the in-process pipeline (SP-1) for the same inputs:
image, prompt, seed, flow shift and camera path; key interactions from the chunk that started them; a camera
trajectory (its refusals, and the Python client's offline path); a prompt change blended in."""
import json

import numpy as np
from PIL import Image

from deployments.client import RealtimeClient
from lingbot.config import LINGBOT_GEOMETRY
from lingbot.io.video import read_frames
from tests.deployments.clients import (
    H,
    W,
    chunk_frames,
    expect_error,
    png_url,
    run,
    session,
    start_msg,
    streaming_session,
)
from tests.deployments.expected_frames import in_process_frames, orbit_trajectory, through_h264


def test_interaction_changes_frames_from_its_chunk_and_runs_repeat(serve_app):
    plain = run(session(serve_app, 4, seed=5))

    async def steer(client, result, meta):
        if meta["generation_chunk_index"] == 0:
            await client.interact("turn-1", keys=["l", "l", "l"])

    steered = run(session(serve_app, 4, seed=5, on_chunk=steer))
    assert steered.error is None
    assert any(m["type"] == "session.interaction.queued" and m["event_id"] == "turn-1" for m in steered.messages)
    starts = [c["generation_chunk_index"] for c in steered.chunks if "turn-1" in c["started_event_ids"]]
    assert len(starts) == 1 and starts[0] >= 1
    k = starts[0]
    assert "turn-1" in steered.chunks[k]["active_event_ids"] and "turn-1" in steered.chunks[k]["completed_event_ids"]
    a, b = chunk_frames(plain), chunk_frames(steered)
    for i in range(k):
        assert np.array_equal(a[i], b[i]), f"chunk {i} changed before the interaction started"
    for i in range(k, 4):
        assert np.abs(a[i].astype(int) - b[i].astype(int)).mean() > 1.0, f"chunk {i} did not change"
    # the same seed and the same controls give the same frames
    script = [["w", "w", "wa"], ["", "l", "l"], ["i", "", ""]]
    first = run(session(serve_app, 3, seed=9, script=script))
    second = run(session(serve_app, 3, seed=9, script=script))
    assert np.array_equal(read_frames(first.video), read_frames(second.video))
    assert not np.array_equal(read_frames(first.video), read_frames(run(session(serve_app, 3, seed=9)).video))


def test_served_frames_are_the_in_process_pipelines(serve_app):
    """A served session (SP-2, sharded decode, muxer) shows the frames of the in-process pipeline (SP-1) for
    the same image, prompt, seed, flow shift and camera path, both through the same H.264 encoder; changing
    any of the inputs changes them. (The tiny model's random-weight frames are noise-like, so H.264 itself
    moves them by ~13 levels: the comparison is after the codec on both sides.)"""
    traj = orbit_trajectory(33)
    base = dict(seed=4, prompt="a forest path", flow_shift=4.0)
    served = run(session(serve_app, 3, camera_trajectory=traj, **base))
    assert served.error is None, served.error
    served_frames = read_frames(served.video).astype(float)
    expected = through_h264(in_process_frames(3, trajectory_json=traj, **base))
    assert served_frames.shape == expected.shape == (33, H, W, 3)
    assert np.abs(served_frames - expected).mean() < 0.25      # identical here; room for +-1 rounding of SP-2
    for change in (dict(seed=5), dict(prompt="a desert road"), dict(flow_shift=8.0)):
        other = through_h264(in_process_frames(3, trajectory_json=traj, **{**base, **change}))
        assert np.abs(served_frames - other).mean() > 2.0, change
    still = through_h264(in_process_frames(3, trajectory_json=orbit_trajectory(1), **base))
    assert np.abs(served_frames[9:] - still[9:]).mean() > 2.0   # the camera path moved the later chunks


def test_camera_trajectory_refusals_leave_live_sessions_alone(serve_app):
    bad_rotation = orbit_trajectory(5)
    bad_rotation["poses"][2][0][0] = 2.0
    bad_focal = orbit_trajectory(5)
    bad_focal["intrinsics"][1][0] = 0.0
    cases = [({"poses": [[1, 2]], "intrinsics": [[1, 2, 3, 4]]}, "trajectory_shape"),
             (bad_rotation, "trajectory_not_rigid"), (bad_focal, "trajectory_intrinsics"),
             ("poses.npy", "invalid_field")]

    async def scenario():
        live = await streaming_session(serve_app, 4, seed=11)
        codes = []
        for value, code in cases:
            msg = start_msg(extra_params={"camera_trajectory": value})
            codes.append((await expect_error(serve_app, [msg], code, close=1008))["code"])
        both = start_msg(extra_params={"camera_trajectory": orbit_trajectory(5),
                                       "camera_action_script": [["w", "w", "w"], ["", "", ""]]})
        codes.append((await expect_error(serve_app, [both], "conflicting_camera", close=1008))["code"])
        not_finite = json.dumps(start_msg(extra_params={"camera_trajectory": orbit_trajectory(5)}))
        not_finite = not_finite.replace("0.08", "1e400", 1)           # JSON's way to an infinite number
        codes.append((await expect_error(serve_app, [not_finite], "trajectory_not_finite", close=1008))["code"])
        # a trajectory session refuses camera and key events (its path is the camera) and keeps going
        async with RealtimeClient(serve_app) as client:
            await client.start("p", png_url(), W, H, 2, camera_trajectory=orbit_trajectory(21))

            async def steer(result, meta):
                if meta["generation_chunk_index"] == 0:
                    await client.interact("k1", keys=["w"])
                    await client.interact("p1", prompt="a desert road")
            scripted = await client.receive_session(steer)
        return codes, scripted, await live

    codes, scripted, live = run(scenario())
    assert codes == [code for _, code in cases] + ["conflicting_camera", "trajectory_not_finite"]
    errors = [m for m in scripted.messages if m["type"] == "error"]
    assert [(e["code"], e["event_id"]) for e in errors] == [("camera_scripted", "k1")]
    assert any(m["type"] == "session.interaction.queued" and m["event_id"] == "p1" for m in scripted.messages)
    assert scripted.done["chunks"] == 2
    assert live.error is None and live.done["chunks"] == 4


def test_python_client_sends_an_offline_path(serve_app, tmp_path, capsys):
    from deployments.client.cli import main
    traj = orbit_trajectory(21)
    np.save(tmp_path / "poses.npy", np.array(traj["poses"]))
    np.save(tmp_path / "intrinsics.npy", np.array(traj["intrinsics"]))
    Image.fromarray(np.random.RandomState(0).randint(0, 255, (80, 140, 3), dtype=np.uint8)).save(tmp_path / "f.png")
    args = [serve_app, "--image", str(tmp_path / "f.png"), "--prompt", "a forest path", "--chunks", "2",
            "--poses", str(tmp_path / "poses.npy"), "--intrinsics", str(tmp_path / "intrinsics.npy")]
    assert main(args + ["-o", str(tmp_path / "out.mp4")]) == 0
    assert read_frames(tmp_path / "out.mp4").shape == (21, H, W, 3)
    assert main(args + ["--keys", "w", "-o", str(tmp_path / "x.mp4")]) == 2
    assert "--keys and --poses both drive the camera" in capsys.readouterr().err


def test_prompt_change_mid_session_is_the_in_process_blend(serve_app):
    """A prompt event with transition_chunks 2.7 (truncated to 2, as the reference) blends into the new
    prompt from the chunk that started it, exactly as the in-process pipeline does; a second
    session.start on the same connection is refused and the session goes on."""
    async def change(client, result, meta):
        if meta["generation_chunk_index"] == 0:
            await client.interact("p1", prompt="a desert road", transition_chunks=2.7)
            await client.send(start_msg())

    async def scenario():
        async with RealtimeClient(serve_app) as client:
            await client.start("a forest path", png_url(), W, H, 5, seed=6)
            return await client.receive_session(lambda result, meta: change(client, result, meta))

    served = run(scenario())
    assert served.done["chunks"] == 5 and served.close_code == 1000
    refusals = [m for m in served.messages if m["type"] == "error"]
    assert [m["code"] for m in refusals] == ["already_started"]
    k = next(c["generation_chunk_index"] for c in served.chunks if "p1" in c["started_event_ids"])
    assert 1 <= k <= 3
    completed = next(c["generation_chunk_index"] for c in served.chunks if "p1" in c["completed_event_ids"])
    assert completed == k + 1                                   # two chunks of transition
    frames = read_frames(served.video).astype(float)
    blended = through_h264(in_process_frames(5, 6, "a forest path", prompt_change=(k, "a desert road", 2)))
    assert np.abs(frames - blended).mean() < 0.25
    plain = through_h264(in_process_frames(5, 6, "a forest path"))
    first = LINGBOT_GEOMETRY.video_frames(k)                    # frames before chunk k
    assert np.abs(frames[first:] - plain[first:]).mean() > 2.0
    snapped = through_h264(in_process_frames(5, 6, "a forest path", prompt_change=(k, "a desert road", 0)))
    assert np.abs(frames[first:] - snapped[first:]).mean() > 0.5   # the blend is not a switch
