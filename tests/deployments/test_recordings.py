"""Recordings on the package's app: a session started with extra_params.record is told its recording's id; once
it ended, GET /v1/recordings/{id} serves a faststart MP4 (ranges too) whose frames are the owner's stream's, and
its journal replays in process to the session's raw frames, bit for bit. Ids that lead nowhere are answered alike;
the second protocol's sessions are not recorded, and a start asking for it is told."""
import asyncio
import json
import secrets
import urllib.error
import urllib.request

import msgpack
import numpy as np

from lingbot.io.images import load_image
from lingbot.io.video import mp4_boxes, read_frames
from lingbot.runtime.journal import WorldJournal, replay
from tests.deployments.clients import H, W, frames_url, png, png_url, run
from tests.deployments.conftest import HTTP
from tests.deployments.expected_frames import in_process_frames, through_h264


def get(path: str, **headers) -> tuple[int, dict, bytes]:
    request = urllib.request.Request(HTTP + path, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=30) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


def test_a_recorded_session_is_served_as_an_mp4_and_its_journal_replays_bitwise(serve_app):
    """Four chunks with a prompt change (two chunks of transition) at a chunk the server picks: the owner gets
    session.recording before its first chunk; after session.done the MP4 is there: ftyp and moov before the media,
    the session's frame count, the owner's decoded frames exactly (packets copied, not re-encoded); a range comes
    back 206 with its Content-Range, one past the end 416. The journal (seed, image digest, prompt, each chunk's
    controls and rung) replays in process to the frames the same session makes there, bitwise, and those frames
    through the same H.264 settings are the recording's."""
    from deployments.client import RealtimeClient

    async def scenario():
        async with RealtimeClient(serve_app) as client:
            await client.start("a forest path", png_url(), W, H, 4, seed=6, record=True)

            async def change(result, meta):
                if meta["generation_chunk_index"] == 0:
                    await client.interact("p1", prompt="a desert road", transition_chunks=2)
            return await client.receive_session(change)

    owned = run(scenario())
    assert owned.error is None and owned.done["chunks"] == 4
    kinds = [m["type"] for m in owned.messages]
    told = owned.messages[kinds.index("session.recording")]
    assert kinds.index("session.recording") < kinds.index("video.chunk_metadata")
    rid = told["recording_id"]
    assert len(rid) == 32 and told["recording_url"] == f"/v1/recordings/{rid}"
    assert told["journal_url"] == f"/v1/recordings/{rid}/journal"

    status, headers, video = get(told["recording_url"])
    assert status == 200 and headers["content-type"] == "video/mp4" and headers["accept-ranges"] == "bytes"
    assert [box for box, _, _ in mp4_boxes(video)][:2] == [b"ftyp", b"moov"]
    frames = read_frames(video)
    owners = read_frames(owned.video)
    assert len(frames) == sum(c["num_frames"] for c in owned.chunks) == len(owners)
    assert np.array_equal(frames, owners)

    status, headers, part = get(told["recording_url"], Range="bytes=100-1099")
    assert status == 206 and part == video[100:1100]
    assert headers["content-range"] == f"bytes 100-1099/{len(video)}"
    status, _, tail = get(told["recording_url"], Range="bytes=-64")
    assert status == 206 and tail == video[-64:]
    status, headers, body = get(told["recording_url"], Range=f"bytes={len(video)}-")
    assert status == 416 and json.loads(body)["error"] == "range_not_satisfiable"
    assert headers["content-range"] == f"bytes */{len(video)}"

    status, _, text = get(told["journal_url"])
    assert status == 200
    journal = WorldJournal.from_json(text)
    k = next(c["generation_chunk_index"] for c in owned.chunks if "p1" in c["started_event_ids"])
    assert [c.prompt for c in journal.chunks] == [("a desert road" if i == k else None) for i in range(4)]
    assert [c.quality for c in journal.chunks] == [c["quality"] for c in owned.chunks]
    assert (journal.seed, journal.prompt, journal.decoder, journal.width, journal.height) == \
        (6, "a forest path", "tae", W, H)

    from lingbot.builder import build_pipeline
    image = load_image(png(), W, H)
    replayed = np.concatenate([c.frames.numpy() for c in replay(build_pipeline("tiny", decoder="tae"), journal,
                                                                        image)])
    expected = in_process_frames(4, 6, "a forest path", prompt_change=(k, "a desert road", 2))
    assert np.array_equal(replayed, expected)
    assert np.abs(through_h264(replayed) - frames.astype(float)).mean() < 0.25    # identical here, as served


def test_recording_ids_that_lead_nowhere_are_answered_alike_and_the_second_protocol_is_told(serve_app):
    """An id never made and malformed ones (not 32 lowercase hex digits) all answer 404 recording_not_found with the
    same body; a start of the second protocol asking to be recorded is refused (invalid_field) and may try again."""
    from deployments.client import FramesClient
    answers = [get(f"/v1/recordings/{rid}") for rid in (secrets.token_hex(16), "not-an-id", "A" * 32, "a" * 64)]
    assert {status for status, _, _ in answers} == {404}
    assert len({body for _, _, body in answers}) == 1
    assert json.loads(answers[0][2])["error"] == "recording_not_found"

    async def scenario():
        async with FramesClient(frames_url(serve_app)) as client:
            await client.init("a forest path", png(), 1, 0, record=True)
            return msgpack.unpackb(await asyncio.wait_for(client.ws.recv(), 30))

    error = run(scenario())
    assert error["code"] == "invalid_field" and "not recorded" in error["content"], error
