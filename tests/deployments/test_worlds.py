"""Worlds that last, on the package's app (keyless: every world is nobody's, found by its id): a session's world
saved part way (the session then left), resumed by a later session whose frames are bitwise those of the session
that never stopped (raw frames of the second protocol), forked by two sessions at once, each bitwise the same run,
the saved world unchanged; a save of a resumed world names its parent; the worlds listed, a first frame served, one
deleted; a world that leads nowhere, a truncated one and a start that names what the world decides, refused with
their codes. (Another key's world: test_limits.py, on its keyed app.)"""
import asyncio
import json
import urllib.request
from pathlib import Path

import numpy as np

from deployments.client import FramesClient, RealtimeClient
from lingbot.io.video import read_frames
from tests.deployments.clients import expect_error, frames_session, frames_url, png, run
from tests.deployments.conftest import HTTP, TEST_SETTINGS

CHUNKS = 8
# a key set per latent frame (3 a chunk), for every chunk: what each chunk runs does not hang on timing
ACTIONS = [["w"], ["w"], ["j"], [], ["d"], ["d"], ["l"], ["i"], ["s"], ["a"], [], ["k"]] * 2
WORLDS = Path(TEST_SETTINGS["worlds_dir"])


def http(method: str, path: str) -> tuple[int, bytes]:
    request = urllib.request.Request(HTTP + path, method=method)
    try:
        with urllib.request.urlopen(request, timeout=30) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


async def saved_session(url: str, save_after: int, **init) -> tuple:
    """A raw session of CHUNKS chunks that saves its world once `save_after` chunks arrived, and disconnects at
    the next chunk once the world is saved: (its result, the saved answer)."""
    async with FramesClient(url) as client:
        await client.init("a forest path", png(), CHUNKS, 7, actions=ACTIONS, **init)

        async def on_chunk(result, chunk):
            if len(result.chunks) == save_after:
                await client.save()
            elif any(m["type"] == "saved" for m in result.messages):
                await client.ws.close()
        result = await client.receive_session(on_chunk, timeout=300)
    [saved] = [m for m in result.messages if m["type"] == "saved"]
    return result, saved


async def resumed_session(url: str, world_id: str, chunks: int, save_after=None):
    async with FramesClient(url) as client:
        await client.resume_world(world_id, chunks)

        async def on_chunk(result, chunk):
            if len(result.chunks) == save_after:
                await client.save()
        return await client.receive_session(on_chunk, timeout=300)


def test_a_saved_world_resumes_and_forks_bitwise_as_the_session_that_never_stopped(serve_app):
    url = frames_url(serve_app)

    async def scenario():
        whole = await frames_session(url, CHUNKS, seed=7, actions=ACTIONS)
        first, saved = await saved_session(url, 5)
        n = saved["chunk_index"] + 1
        world_file = (WORLDS / f"{saved['world_id']}.json").read_bytes()
        forks = await asyncio.gather(resumed_session(url, saved["world_id"], CHUNKS - n, save_after=1),
                                     resumed_session(url, saved["world_id"], CHUNKS - n))
        return whole, first, saved, forks, world_file

    whole, first, saved, forks, world_file = run(scenario())
    n = saved["chunk_index"] + 1
    assert 5 <= n < CHUNKS and len(saved["world_id"]) == 32
    meta = json.loads((WORLDS / f"{saved['world_id']}.meta.json").read_text())
    assert 0 <= meta["snapshot"]["index"] < n and (WORLDS / f"{saved['world_id']}.snap").stat().st_size > 0
    assert n <= len(first.chunks) < CHUNKS                               # it left mid-session, once saved
    assert np.array_equal(first.frames, whole.frames[:len(first.frames)])   # saving changed nothing it got
    expected = np.concatenate([c.frames for c in whole.chunks[n:]])
    for fork in forks:
        assert fork.errors == [] and fork.close_code == 1000, (fork.errors, fork.close_code)
        [resumed] = [m for m in fork.messages if m["type"] == "session_resumed"]
        # restored from the world's snapshot (its newest restore point), the chunks after it replayed
        assert resumed["reason"] == "saved" and resumed["restored_chunks"] >= 1
        assert resumed["restored_chunks"] + resumed["replayed_chunks"] == n
        assert [c.index for c in fork.chunks] == list(range(n, CHUNKS))
        assert np.array_equal(fork.frames, expected)                    # bitwise the session that never stopped
    [child] = [m for m in forks[0].messages if m["type"] == "saved"]
    assert child["world_id"] != saved["world_id"] and child["chunk_index"] >= n
    assert (WORLDS / f"{saved['world_id']}.json").read_bytes() == world_file          # the world never changes
    status, body = http("GET", "/v1/worlds")
    listed = {w["id"]: w for w in json.loads(body)["worlds"]}
    assert status == 200 and listed[child["world_id"]]["parent"] == saved["world_id"]
    assert listed[saved["world_id"]]["chunks"] == n and listed[saved["world_id"]]["parent"] is None
    status, thumbnail = http("GET", f"/v1/worlds/{saved['world_id']}/frame")
    assert status == 200 and thumbnail[:8] == b"\x89PNG\r\n\x1a\n"
    assert http("DELETE", f"/v1/worlds/{child['world_id']}")[0] == 204
    assert http("DELETE", f"/v1/worlds/{child['world_id']}")[0] == 404
    assert http("GET", f"/v1/worlds/{child['world_id']}/frame")[0] == 404


def test_a_world_resumes_on_the_first_protocol_as_a_stream_of_its_own(serve_app):
    """The H.264 transport: the resumed session's stream starts with its init segment and a keyframe (a new client
    holds nothing), decodes whole, and its chunks go on from the saved one."""
    async def scenario():
        _, saved = await saved_session(frames_url(serve_app), 2)
        async with RealtimeClient(serve_app) as client:
            await client.resume_world(saved["world_id"], 3)
            return saved, await client.receive_session(timeout=300)

    saved, result = run(scenario())
    n = saved["chunk_index"] + 1
    assert result.error is None and result.done == {"type": "session.done", "chunks": 3, "stopped": False}
    assert [m["generation_chunk_index"] for m in result.chunks] == [n, n + 1, n + 2]
    assert [m["type"] for m in result.messages if m["type"] == "session.resumed"] == ["session.resumed"]
    assert read_frames(result.video).shape[0] == 3 * 12


def test_worlds_that_lead_nowhere_truncated_worlds_and_starts_that_name_the_worlds_own_are_refused(serve_app):
    async def scenario():
        _, saved = await saved_session(frames_url(serve_app), 1)
        world_id = saved["world_id"]
        answers = [await expect_error(serve_app, [{"type": "session.start", "world_id": "0" * 32}],
                                      "world_not_found", close=1008),
                   await expect_error(serve_app, [{"type": "session.start", "world_id": world_id, "seed": 3,
                                                   "prompt": "elsewhere"}], "invalid_field", close=1008)]
        path = WORLDS / f"{world_id}.json"
        path.write_bytes(path.read_bytes()[:-40])                       # truncated on the disk
        answers.append(await expect_error(serve_app, [{"type": "session.start", "world_id": world_id}],
                                          "world_corrupt", close=1008))
        async with FramesClient(frames_url(serve_app)) as client:      # nothing to save before the first chunk
            await client.init("a forest path", png(), 1, 7)
            await client.save()
            early = await client.receive_session(timeout=120)
        return answers, early

    answers, early = run(scenario())
    assert "prompt, seed" in answers[1]["message"]
    assert "cannot be read back" in answers[2]["message"]
    assert [e["code"] for e in early.errors] == ["nothing_to_save"] and early.close_code == 1000
    assert len(early.chunks) == 1                                      # the refusal left the session on
