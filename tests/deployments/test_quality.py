"""The quality ladder on the served group: the census reports its mode and capacities, switched on it steps a
session that is behind down to the floor, and a session pinned to a decoder rung shows the tiny decoder's frames."""
import json

import numpy as np

from deployments.client import RealtimeClient
from lingbot.io.video import read_frames
from tests.deployments.clients import H, W, png_url, run, session
from tests.deployments.expected_frames import in_process_frames, through_h264


def test_the_group_reports_its_ladder_mode_and_capacities(serve_app):
    """The group census: the quality ladder's mode as Serve's user_config set it (WorldGroup.reconfigure; a
    `serve deploy` that changes it is a lightweight update of the running groups) and its capacities (the
    ladder off: the configured 2 at every rung)."""
    from perf.soak import census
    group = census("lingbot")["group"]
    assert group["settings"] == {"quality_ladder": "off"}
    assert group["capacity"] == {"configured": 2, "top": 2, "floor": 2}


def test_the_ladder_switched_on_takes_a_session_behind_down_to_the_floor_and_admission_counts_the_floor(serve_app):
    """The ladder switched on in the running group (WorldGroup.reconfigure, what Serve calls for a user_config
    change; tests/cluster/test_multinode.py does it by `serve deploy`). A session asking for 120 fps (10 chunks a
    second: always behind its deadline here) runs its sink at every step, then steps down a rung a chunk to the
    floor, the decoder rung tiny_steps2 (the tiny decoder instead of its own Wan decoder). Meanwhile a second
    paced session is either taken or refused with capacity_exhausted, as the floor's learned cost says (which one
    depends on this machine's speed: decided by the pure functions in tests/deployments/group/
    test_lease_admission.py and test_ladder.py), an unpaced one (no real-time demand) is taken, and the census
    reports the measured capacities within the configured cap. Switched off again, the group says so."""
    from ray import serve

    from perf.soak import census
    group = serve.get_deployment_handle("WorldGroup", "lingbot")

    async def scenario():
        async with RealtimeClient(serve_app) as fast:
            await fast.start("p", png_url(), W, H, None, seed=1, fps=120.0, decoder="wan")
            first = []
            while len(first) < 2:                            # two chunks run: the group measured its cost
                msg = await fast.ws.recv()
                if isinstance(msg, str) and json.loads(msg)["type"] == "video.chunk_metadata":
                    first.append(json.loads(msg))
            other = await session(serve_app, 2, seed=3)
            unpaced = await session(serve_app, 1, seed=4, realtime_output_pacing=False)
            measured = await group.census.remote()
            await fast.send({"type": "session.stop"})
            rest = await fast.receive_session()
            return other, unpaced, measured, rest, first + [c for c in rest.chunks if c is not None]

    group.reconfigure.remote({"quality_ladder": "auto"}).result(timeout_s=30)
    try:
        assert census("lingbot")["group"]["settings"] == {"quality_ladder": "auto"}
        other, unpaced, measured, fast, chunks = run(scenario())
    finally:
        group.reconfigure.remote({"quality_ladder": "off"}).result(timeout_s=30)
    assert fast.error is None and fast.done["stopped"] is True
    rungs = [(c["quality"], c["denoising_steps"]) for c in chunks]
    assert all(steps is None for _, steps in rungs[:3]) and ("tiny_steps2", 2) in rungs, rungs
    assert other.error is None or (other.error["code"] == "capacity_exhausted" and other.close_code == 1013)
    assert unpaced.error is None and unpaced.done["chunks"] == 1
    capacity = measured["capacity"]
    assert capacity["configured"] == 2 and 1 <= capacity["top"] <= capacity["floor"] <= 2, capacity
    assert census("lingbot")["group"]["settings"] == {"quality_ladder": "off"}


def test_a_wan_session_pinned_to_a_decoder_rung_shows_the_tiny_decoders_frames_of_its_latents(serve_app):
    """extra_params.quality tiny_steps2 on a session whose decoder is the Wan one (both loaded): its sink runs
    every step on the tiny decoder (`tiny`: a decoder rung applies there), then 2 steps (`tiny_steps2`); the frames
    are the in-process pipeline's for the same rungs (SP-2 with the tiny decoder on the root against SP-1, after
    the codec on both sides), not the Wan decoder's."""
    base = dict(seed=6, prompt="a quarry")
    served = run(session(serve_app, 5, decoder="wan", quality="tiny_steps2", **base))
    assert served.error is None, served.error
    assert [(c["quality"], c["denoising_steps"]) for c in served.chunks] == [("tiny", None)] * 3 + [
        ("tiny_steps2", 2)] * 2
    frames = read_frames(served.video).astype(float)
    rungs = [(None, "tae")] * 3 + [(2, "tae")] * 2
    expected = through_h264(in_process_frames(5, rungs=rungs, decoder="wan", **base))
    assert frames.shape == expected.shape == (57, H, W, 3) and np.abs(frames - expected).mean() < 0.25
    wan = through_h264(in_process_frames(5, rungs=[(None, None)] * 3 + [(2, None)] * 2, decoder="wan", **base))
    assert np.abs(frames - wan).mean() > 2.0
