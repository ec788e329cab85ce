"""Faults end to end, on an app of their own beside the package's one (route prefix /faults, SP-1, one group,
API key KEY3): a rank killed mid-session (the sessions resume on the rebuilt group with identical
frames) and a rank killed with no session (the group is replaced at once). Each replaces the group."""
import asyncio

import pytest

from deployments.client import FramesClient, RealtimeClient
from tests.deployments.clients import H, W, png, png_url, run
from tests.deployments.conftest import PORT, TEST_SETTINGS
from tests.waits import wait_until

KEY3 = "test-key-3-0123456789"
FAULTS = dict(TEST_SETTINGS, sp=1, max_sessions_per_group=2, api_keys=KEY3, admission_wait_s=5, resume_wait_s=120,
              max_resumes=10, graceful_shutdown_timeout_s=90,    # a redeploy's old group waits for the new one
              max_world_snapshot_bytes=0)                        # its worlds keep no snapshot: a resume replays all
URL = f"ws://127.0.0.1:{PORT}/faults/v1/realtime/video"


@pytest.fixture(scope="module")
def faults_app(serve_app):
    from ray import serve

    from deployments.app import build_app
    serve.run(build_app(FAULTS), name="faults", route_prefix="/faults")
    yield URL
    serve.delete("faults")


def replica_pids(name="ServeReplica:faults:WorldGroup"):
    from ray._private import state
    return {a["Pid"] for a in state.actors().values() if a["ActorClassName"] == name and a["State"] == "ALIVE"}


def rank_pids():
    from ray._private import state
    return {a["Pid"] for a in state.actors().values() if a["ActorClassName"] == "RankWorker" and a["State"] == "ALIVE"}


def rank_pids_of_app():
    """The faults app's rank processes: the ranks its group replica owns."""
    from ray._private import state
    actors = [a for a in state.actors().values() if a["State"] == "ALIVE"]
    owners = {a["Address"]["Port"] for a in actors if a["ActorClassName"] == "ServeReplica:faults:WorldGroup"}
    return {a["Pid"] for a in actors if a["ActorClassName"] == "RankWorker" and a["OwnerAddress"]["Port"] in owners}


def test_a_rank_killed_mid_session_the_sessions_resume_with_identical_frames(faults_app):
    """SIGKILL of the group's rank (SP-1) while two sessions stream, one per protocol (the raw one on the tiny
    decoder, the fMP4 one on the Wan decoder). The group fails, exits,
    and Serve rebuilds it; both sessions resume on the new group without an error or a close: indices
    contiguous, nothing twice, a resumed event with the gap, and the raw frames of every chunk bitwise those
    of the same session run without a fault. It replaces the group."""
    import os
    import signal

    import numpy as np

    from lingbot.io.video import read_frames
    [pid] = rank_pids_of_app()
    frames_url = URL.replace("/v1/realtime/video", "/v1/realtime_video/generate")
    assert wait_for_group() < 120
    actions = [["w"], ["w"], ["j"], [], ["d"], ["d"], ["l"], ["i"], ["s"], ["a"], [], ["k"]] * 2
    script = [["w", "w", "j"], ["", "d", "d"], ["l", "i", "s"], ["a", "", "k"]] * 2

    async def pair(kill_after=None):
        async with FramesClient(frames_url, api_key=KEY3) as raw, RealtimeClient(URL, api_key=KEY3) as fmp4:
            await raw.init("a quiet street", png(), 8, 3, actions=actions, decoder="tae")   # the tiny decoder's cache
            await fmp4.start("a quiet street", png_url(), W, H, 8, seed=3, script=script, decoder="wan")

            async def kill(result, chunk):
                if kill_after is not None and len(result.chunks) == kill_after:
                    os.kill(pid, signal.SIGKILL)
            return await asyncio.gather(raw.receive_session(kill, timeout=300), fmp4.receive_session(timeout=300))

    clean_raw, clean_fmp4 = run(pair())
    raw, fmp4 = run(pair(kill_after=3))
    assert clean_raw.errors == [] and raw.errors == [], raw.errors
    assert (raw.close_code, raw.close_reason) == (1000, "generation complete")
    assert [c.index for c in raw.chunks] == list(range(8))
    [resumed] = [m for m in raw.messages if m["type"] == "session_resumed"]
    assert 3 <= resumed["chunk_index"] < 8 and resumed["gap_ms"] > 0
    # restored from the snapshot of a chunk already delivered, then at most the chunks after it replayed
    assert resumed["restored_chunks"] + resumed["replayed_chunks"] == resumed["chunk_index"]
    assert resumed["restored_chunks"] >= 2 and resumed["replayed_chunks"] <= 2, resumed
    for clean, got in zip(clean_raw.chunks, raw.chunks):
        assert np.array_equal(clean.frames, got.frames), got.index            # bitwise, after the fault too
    assert fmp4.error is None and fmp4.done == {"type": "session.done", "chunks": 8, "stopped": False}
    assert [c["generation_chunk_index"] for c in fmp4.chunks] == list(range(8))
    assert [c["transport_chunk_index"] for c in fmp4.chunks] == list(range(8))
    [note] = [m for m in fmp4.messages if m["type"] == "session.resumed"]
    assert note["generation_chunk_index"] == note["transport_chunk_index"]
    assert note["restored_chunks"] + note["replayed_chunks"] == note["generation_chunk_index"]
    decoded, clean_decoded = read_frames(fmp4.video), read_frames(clean_fmp4.video)   # one stream, 93 frames
    assert decoded.shape == clean_decoded.shape == (93, H, W, 3)
    cut = 9 + 12 * (note["generation_chunk_index"] - 1)
    assert np.array_equal(decoded[:cut], clean_decoded[:cut])                  # the same bytes up to the fault
    assert np.abs(decoded[cut:].astype(int) - clean_decoded[cut:]).mean() < 3  # re-encoded from the same frames
    assert pid not in rank_pids() and len(rank_pids_of_app()) == 1


def test_soak_with_chaos_short(faults_app):
    """A short soak with chaos (the long ones: python -m perf.soak): sessions two at a time for 15 s (and on
    until three have started, however slow the machine) while a random rank or the muxer is killed once, 6 s
    in (each kill costs a group's rebuild: a minute of this machine). Every session completes with every chunk
    and the raw frames of its inputs without a fault; afterwards no session is left live."""
    import random
    import threading

    from perf.soak import INPUTS, Sampler, chaos, live_sessions, run_session, soak
    assert wait_for_group() < 120
    frames_url = URL.replace("/v1/realtime/video", "/v1/realtime_video/generate")
    image = png()
    async def clean():                            # side by side: the group holds two sessions
        return await asyncio.gather(*[run_session(frames_url, image, i, 6, KEY3) for i in INPUTS])
    references = {i["seed"]: r.frames for i, r in zip(INPUTS, run(clean()))}
    sampler = Sampler(app="faults", period=1.0)
    sampler.start()
    stop, kills = threading.Event(), []
    threading.Thread(target=chaos, args=(stop, 6.0, kills, random.Random(1), "faults", 1), daemon=True).start()
    try:
        report = run(soak(frames_url, image, 15 / 60, 2, 6, references, KEY3, min_sessions=3))
    finally:
        stop.set()
        sampler.halt.set()
    assert report["incomplete"] == 0 and report["mismatched"] == 0, (report["errors"], report)
    assert report["sessions"] >= 3 and report["chunks"] == 6 * report["sessions"]
    assert len(kills) >= 1 and report["resumed"] >= 1, (kills, report)
    wait_until(lambda: live_sessions(f"http://127.0.0.1:{PORT}/faults") == 0, 30,
               "every session of the soak to have left the faults app's ingress")
    roles = {r for _, rss in sampler.samples for r in rss}
    assert {"ingress", "group", "rank", "muxer", "mailbox", "keeper"} <= roles, roles


def test_without_its_snapshots_a_session_is_replayed_from_its_journal(faults_app):
    """The snapshots' owner is killed (as if their node were lost): the next fault resumes the session by
    replaying every delivered chunk instead, and its frames are still bitwise those without a fault."""
    import os
    import signal

    import numpy as np
    from ray._private import state

    assert wait_for_group() < 120
    actors = [a for a in state.actors().values() if a["State"] == "ALIVE"]
    ingress = {a["Address"]["Port"] for a in actors if a["ActorClassName"] == "ServeReplica:faults:Ingress"}
    [keeper] = [a["Pid"] for a in actors if a["ActorClassName"] == "SnapshotKeeper"
                and a["OwnerAddress"]["Port"] in ingress]
    frames_url = URL.replace("/v1/realtime/video", "/v1/realtime_video/generate")
    actions = [["w"], ["j"], ["d"]] * 6

    async def one(kill_after=None):
        [pid] = rank_pids_of_app()
        async with FramesClient(frames_url, api_key=KEY3) as client:
            await client.init("a quiet street", png(), 6, 9, actions=actions)

            async def kill(result, chunk):
                if kill_after is not None and len(result.chunks) == kill_after:
                    os.kill(keeper, signal.SIGKILL)
                    os.kill(pid, signal.SIGKILL)
            return await client.receive_session(kill, timeout=300)

    clean = run(one())
    faulted = run(one(kill_after=4))
    assert faulted.errors == [] and (faulted.close_code, faulted.close_reason) == (1000, "generation complete")
    [resumed] = [m for m in faulted.messages if m["type"] == "session_resumed"]
    assert resumed["restored_chunks"] == 0 and resumed["replayed_chunks"] == resumed["chunk_index"] >= 4
    assert [c.index for c in faulted.chunks] == list(range(6))
    assert all(np.array_equal(a.frames, b.frames) for a, b in zip(clean.chunks, faulted.chunks))


def test_a_saved_world_whose_rank_dies_mid_replay_resumes_with_identical_frames(faults_app):
    """A world saved 5 chunks into a session (under the app's key) is resumed, and the group's rank is killed a
    moment after the start, while the new group replays the world's chunks: the session resumes again on the
    rebuilt group, replaying them there, and its frames are bitwise those of the session that never stopped."""
    import os
    import signal

    import numpy as np

    assert wait_for_group() < 120
    frames_url = URL.replace("/v1/realtime/video", "/v1/realtime_video/generate")
    actions = [["w"], ["j"], ["d"]] * 8

    async def scenario():
        async with FramesClient(frames_url, api_key=KEY3) as client:
            await client.init("a quiet street", png(), 8, 9, actions=actions)

            async def save(result, chunk):
                if len(result.chunks) == 5:
                    await client.save()
            whole = await client.receive_session(save, timeout=300)
        [saved] = [m for m in whole.messages if m["type"] == "saved"]
        [pid] = rank_pids_of_app()
        async with FramesClient(frames_url, api_key=KEY3) as client:
            await client.resume_world(saved["world_id"], 8 - saved["chunk_index"] - 1)
            await asyncio.sleep(0.5)                      # admitted, replaying (about a chunk's compute each)
            os.kill(pid, signal.SIGKILL)
            return whole, saved, await client.receive_session(timeout=300)

    whole, saved, resumed = run(scenario())
    n = saved["chunk_index"] + 1
    assert resumed.errors == [] and (resumed.close_code, resumed.close_reason) == (1000, "generation complete")
    notes = [m for m in resumed.messages if m["type"] == "session_resumed"]
    # one resume, after the fault (none came for the saved world: the replay was cut), replaying all of it again
    assert [(m["reason"], m["replayed_chunks"]) for m in notes] == [("fault", n)], notes
    assert [c.index for c in resumed.chunks] == list(range(n, 8))
    assert np.array_equal(resumed.frames, np.concatenate([c.frames for c in whole.chunks[n:]]))


def test_a_rank_that_dies_without_sessions_is_replaced_at_once(faults_app):
    """An idle group notices a dead rank within seconds (not at Serve's next health check) and exits; Serve
    builds a new one, which then serves."""
    import os
    import signal
    import time
    assert wait_for_group() < 120                 # the soak before may have left a group being replaced
    replicas = replica_pids()
    ranks = rank_pids_of_app()
    assert len(replicas) == 1 and len(ranks) == 1
    t0 = time.monotonic()
    os.kill(next(iter(ranks)), signal.SIGKILL)
    while replica_pids() & replicas and time.monotonic() - t0 < 30:
        time.sleep(0.2)
    gone = time.monotonic() - t0
    assert not replica_pids() & replicas and gone < 10, gone
    assert wait_for_group() < 120                                       # Serve built a new group
    result = run(one_chunk())
    assert result.error is None and result.done["chunks"] == 1


def wait_for_group(timeout=120.0) -> float:
    """Seconds until the strict app's group runs again (a new replica, RUNNING, its ranks alive: a group whose
    rank a chaos kill just took is still RUNNING until its watcher sees it, seconds later)."""
    import time

    from ray import serve
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        status = serve.status().applications["faults"].deployments["WorldGroup"]
        if status.replica_states.get("RUNNING", 0) >= 1 and replica_pids() and rank_pids_of_app():
            break
        time.sleep(0.5)
    return time.monotonic() - t0


async def one_chunk():
    async with RealtimeClient(URL, api_key=KEY3) as client:
        await client.start("p", png_url(), W, H, 1)
        return await client.receive_session(timeout=60)


def test_a_redeploy_moves_a_session_to_the_new_group_with_identical_frames(faults_app):
    """`serve.run` of a changed config replaces the group and the ingress while a session streams (4 fps, so
    it outlasts the new group's start). The old group keeps it until the new group runs, finishes its chunks
    in flight and hands it on with its last snapshots; through the old ingress the session goes on there
    without an error or a close, restored at its last delivered chunk with nothing replayed, every chunk
    once, and bitwise the frames of the same session without a redeploy. Last in this module: it redeploys
    the app."""
    import threading
    import time

    import numpy as np
    from ray import serve

    from deployments.app import build_app
    assert wait_for_group() < 120
    frames_url = URL.replace("/v1/realtime/video", "/v1/realtime_video/generate")
    actions = [["w"], ["j"], ["d"], [], ["l"]] * 24
    old_groups = replica_pids()
    redeploying = threading.Thread(target=lambda: serve.run(build_app(dict(FAULTS, metrics_interval_s=6.0)),
                                                            name="faults", route_prefix="/faults"), daemon=True)

    async def one(fps, chunks, move=False):
        async with FramesClient(frames_url, api_key=KEY3) as client:
            await client.init("a quiet street", png(), chunks, 5, fps=fps, actions=actions)
            after = []

            async def on_chunk(result, chunk):
                if move and len(result.chunks) == 1:
                    redeploying.start()
                if any(m["type"] == "session_resumed" for m in result.messages):
                    after.append(chunk.index)
                    if len(after) == 2:                  # two chunks from the new group: enough
                        await client.ws.close()
            return await client.receive_session(on_chunk, timeout=240)

    moved = run(one(4, 40, move=True))
    assert moved.errors == [] and moved.close_code == 1000, (moved.errors, moved.close_code)
    [resumed] = [m for m in moved.messages if m["type"] == "session_resumed"]
    n = resumed["chunk_index"] + 2
    assert [c.index for c in moved.chunks] == list(range(n))
    assert resumed["reason"] == "drain" and resumed["replayed_chunks"] == 0, resumed
    assert resumed["restored_chunks"] == resumed["chunk_index"] >= 2          # the last delivered chunk
    clean = run(one(120, n))
    assert [c.index for c in clean.chunks] == list(range(n))
    for a, b in zip(clean.chunks, moved.chunks):
        assert np.array_equal(a.frames, b.frames), b.index
    redeploying.join(120)                  # serve.run returns once the old replicas are gone (the ingress's too)
    t0 = time.monotonic()
    while replica_pids() & old_groups and time.monotonic() - t0 < 30:
        time.sleep(0.5)
    assert not redeploying.is_alive() and not replica_pids() & old_groups     # the old group is gone
