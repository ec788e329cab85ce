"""The quality ladder on the served group: the census reports its mode and capacities, switched on it steps a
session that is behind down to the floor, and a session pinned to a decoder rung shows the tiny decoder's frames."""
import asyncio
import json

import numpy as np
import pytest

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
    second: always behind its deadline here) runs its sink at every step, then steps down to the floor, the
    decoder rung tiny_steps2 (the tiny decoder instead of its own Wan decoder). Meanwhile a second paced session
    is either taken or waits for the seat the ladder holds back (told its place) until the fast one stops, as the
    floor's learned cost says (which one depends on this machine's speed: decided by the pure functions in
    tests/deployments/group/test_lease_admission.py and test_ladder.py), an unpaced one (no real-time demand) is
    taken, and the census reports the measured capacities within the configured cap. Switched off again, the
    group says so."""
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
            other = asyncio.create_task(session(serve_app, 2, seed=3))       # taken, or waits for the fast one
            unpaced = await session(serve_app, 1, seed=4, realtime_output_pacing=False)
            measured = await group.census.remote()
            await asyncio.wait({other}, timeout=5.0)
            await fast.send({"type": "session.stop"})
            rest = await fast.receive_session()
            return await other, unpaced, measured, rest, first + [c for c in rest.chunks if c is not None]

    group.reconfigure.remote({"quality_ladder": "auto"}).result(timeout_s=30)
    try:
        assert census("lingbot")["group"]["settings"] == {"quality_ladder": "auto"}
        other, unpaced, measured, fast, chunks = run(scenario())
    finally:
        group.reconfigure.remote({"quality_ladder": "off"}).result(timeout_s=30)
    assert fast.error is None and fast.done["stopped"] is True
    rungs = [(c["quality"], c["denoising_steps"]) for c in chunks]
    assert all(steps is None for _, steps in rungs[:3]) and ("tiny_steps2", 2) in rungs, rungs
    assert other.error is None and other.done["chunks"] == 2
    queued = [m for m in other.messages if m["type"] == "session.queued"]     # (the seat held back: told its place)
    assert not queued or queued[0]["position"] == 1, queued
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


FPS = 24.0                   # a chunk every 0.5 s: two sessions at full are past real time on this machine


def stall_ratio(result, fps: float = FPS) -> float:
    """This test's own player: it starts when the first chunk arrives and plays each chunk's frames at `fps`; a
    chunk that arrives after the play cursor stalls it by the difference. Stalled seconds over played ones."""
    cursor, stalled = result.arrivals[0], 0.0
    for arrival, meta in zip(result.arrivals, result.chunks):
        stalled += max(0.0, arrival - cursor)
        cursor = max(cursor, arrival) + meta["num_frames"] / fps
    return stalled / (cursor - result.arrivals[0])


@pytest.mark.quiet
def test_with_the_ladder_on_every_admitted_session_plays_without_stalling_or_waits_with_its_place(serve_app,
                                                                                                  quiet_machine):
    """The ladder's promise on a load that overloads this machine: three sessions at once asking for the Wan
    decoder at 24 fps on the group's two seats. With the ladder off (8 chunks each) the two admitted stall (their
    chunks at full cost more than real time here). Switched on (16 chunks each), a session is taken only where
    the floor holds it beside the others, its sink counted at its own cost and never beside another sink (else it
    waits, told its place): every admitted session plays with a stall ratio of at most 5% by this test's player
    (which starts after the first chunk). A session that finds both seats taken for admission_wait_s is refused
    capacity_exhausted, the ladder on or off."""
    from ray import serve
    group = serve.get_deployment_handle("WorldGroup", "lingbot")

    async def load(chunks: int):
        return await asyncio.gather(*(session(serve_app, chunks, seed=20 + i, fps=FPS, decoder="wan")
                                      for i in range(3)))

    off = run(load(8))
    group.reconfigure.remote({"quality_ladder": "auto"}).result(timeout_s=30)
    try:
        on = run(load(16))               # (8 s of video each: a core taken away for a moment is not the ladder's)
    finally:
        group.reconfigure.remote({"quality_ladder": "off"}).result(timeout_s=30)
    def admitted(results):                   # the others found both seats taken past admission_wait_s (3 s here)
        assert all(r.error["code"] == "capacity_exhausted" for r in results if r.error is not None), results
        return [r for r in results if r.error is None and r.done["chunks"] == len(r.chunks)]
    off, on = admitted(off), admitted(on)
    assert max(stall_ratio(r) for r in off) > 0.05, [round(stall_ratio(r), 3) for r in off]     # an overload here
    stalls = [round(stall_ratio(r), 3) for r in on]
    assert len(on) >= 2 and max(stalls) <= 0.05, (stalls, [[c["quality"] for c in r.chunks] for r in on])
    told = [m for r in on for m in r.messages if m["type"] == "session.queued"]
    assert told and all(m["position"] >= 1 for m in told)      # one waited while another's sink ran: told its place
