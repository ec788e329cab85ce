"""The second protocol end to end (SGLang's MessagePack realtime video, /v1/realtime_video/generate) on the same
Serve app, groups and sessions as the first: real WebSocket clients, frames restored on the client side."""
import asyncio
import random
from collections import Counter

import msgpack
import numpy as np
import websockets

from deployments.client import FramesClient
from lingbot.camera import Controls
from lingbot.io.video import FragmentedMp4Encoder, H264Settings, read_frames
from tests.deployments.clients import H, W, frames_session, frames_url, png, run, session
from tests.deployments.expected_frames import in_process_frames
from tests.deployments.ingress.inputs import mutations

FRAME_BYTES = W * H * 3


def test_a_session_of_n_chunks_delivers_12n_minus_3_raw_frames(serve_app):
    result = run(frames_session(frames_url(serve_app), 3, seed=2))
    assert result.errors == [] and (result.close_code, result.close_reason) == (1000, "generation complete")
    assert [c.index for c in result.chunks] == [0, 1, 2]
    assert [c.frames.shape for c in result.chunks] == [(9, H, W, 3), (12, H, W, 3), (12, H, W, 3)]
    assert result.frames.shape[0] == 12 * 3 - 3 and result.frames.dtype == np.uint8
    for chunk in result.chunks:
        [header] = chunk.headers                             # <= 16 frames: one batch, over 64 KiB: split
        assert header["type"] == "frame_batch_header" and header["content_type"] == "application/x-raw-rgb"
        assert header["total_size"] == header["raw_size"] == len(chunk.frames) * FRAME_BYTES
        assert (header["width"], header["height"], header["bytes_per_frame"]) == (W, H, FRAME_BYTES)
        assert "event_id" not in header
        stats = chunk.stats
        assert stats["chunk_index"] == chunk.index and stats["num_frames"] == len(chunk.frames)
        assert stats["raw_bytes"] == len(chunk.frames) * FRAME_BYTES and stats["num_batches"] == 2
        assert stats["ws_payload_bytes"] > stats["raw_bytes"] and stats["scheduler_forward_ms"] > 0
        assert stats["actions"] is None
        assert (stats["quality"], stats["denoising_steps"]) == ("full", None)      # 3 chunks: all in the sink
        integers = ("chunk_index", "request_prepare_ms", "scheduler_forward_ms", "raw_payload_build_ms", "ws_write_ms",
                    "chunk_total_ms", "num_batches", "num_frames", "raw_bytes", "ws_payload_bytes")
        assert all(type(stats[k]) is int for k in integers), {k: type(stats[k]) for k in integers}   # as SGLang
    assert [m["type"] for m in result.messages] == ["frame_batch_header", "chunk_stats"] * 3


def test_unpaced_delivery_on_request(serve_app):
    """realtime_output_pacing false delivers each chunk as soon as it is made. At 1 fps a paced chunk 3 is due
    33 s of video after chunk 0 arrived and may run at most the pacing lead (8 s here) early: it could not
    arrive within 25 s of chunk 0. Unpaced, it comes after three chunks' generation; the frames are the paced
    session's (pacing decides when, not what)."""
    unpaced = run(frames_session(frames_url(serve_app), 4, seed=11, fps=1.0, realtime_output_pacing=False))
    assert unpaced.errors == [] and [c.index for c in unpaced.chunks] == [0, 1, 2, 3]
    assert unpaced.arrivals[3] - unpaced.arrivals[0] < 33 - 8
    paced = run(frames_session(frames_url(serve_app), 2, seed=11))          # 16 fps: the same frames
    assert np.array_equal(paced.frames, unpaced.frames[:len(paced.frames)])


def test_a_session_of_its_own_window_is_the_default_until_its_sink_differs(serve_app):
    """realtime_causal_sink_size 6 (2 chunks; the model's 9): side by side with a session of the model's
    window (same image, prompt and seed, unpaced), its raw frames are the same for chunks 0-5, while both
    windows hold every chunk, and differ from chunk 6, the first where they keep different ones. A window
    larger than the model's is refused, naming the served maximum, and the connection stays open."""
    url = frames_url(serve_app)

    async def side_by_side():
        return await asyncio.gather(
            frames_session(url, 7, seed=21, fps=120.0, realtime_output_pacing=False),
            frames_session(url, 7, seed=21, fps=120.0, realtime_output_pacing=False, realtime_causal_sink_size=6))
    model, own = run(side_by_side())
    assert model.errors == own.errors == [] and [c.index for c in own.chunks] == list(range(7))
    assert all(np.array_equal(a.frames, b.frames) for a, b in zip(model.chunks[:6], own.chunks[:6]))
    assert not np.array_equal(model.chunks[6].frames, own.chunks[6].frames)

    async def too_large():
        async with FramesClient(url) as client:
            await client.init("p", png(), 1, 0, realtime_causal_kv_cache_num_frames=21)
            error = msgpack.unpackb(await asyncio.wait_for(client.ws.recv(), 20))
            await client.init("p", png(), 1, 0)                          # the same connection, a valid init
            return error, await client.receive_session()
    error, after = run(too_large())
    assert error["code"] == "invalid_field" and error["content"] == (
        "init: the window may be at most 6 chunks (the model's), got 7; served: realtime_causal_sink_size up to 12, "
        "realtime_causal_kv_cache_num_frames up to 18 latent frames")
    assert after.errors == [] and len(after.chunks) == 1


def test_raw_frames_are_the_fmp4_streams_source_frames(serve_app):
    """Same image, prompt, seed and key script on both protocols: the raw frames, put through the muxer's
    encoder here, give the first protocol's fMP4 stream byte for byte (so its source frames were these)."""
    script = [("w", "w", "wj"), ("", "l", "l"), ("d", "d", "")]
    fmp4 = run(session(serve_app, 3, seed=6, script=[list(c) for c in script]))
    raw = run(frames_session(frames_url(serve_app), 3, seed=6, actions=[[k] if k else [] for c in script for k in c]))
    assert fmp4.error is None and raw.errors == []
    assert [c.stats["actions"] for c in raw.chunks] == [[list(k) for k in c] for c in script]
    encoder = FragmentedMp4Encoder(W, H, 16.0, H264Settings(encoder="libx264"))
    encoded = [encoder.encode_chunk(c.frames) for c in raw.chunks]
    assert encoded == fmp4.data
    assert np.array_equal(read_frames(b"".join(encoded)), read_frames(fmp4.video))
    other = run(frames_session(frames_url(serve_app), 1, seed=7))
    assert np.abs(other.frames.astype(int) - raw.chunks[0].frames).mean() > 5    # the seed matters


def test_delta_gzip_webp_and_jpeg_carry_the_same_frames(serve_app):
    url = frames_url(serve_app)
    raw = run(frames_session(url, 2, seed=3))
    delta = run(frames_session(url, 2, seed=3, delta=True))
    assert np.array_equal(delta.frames, raw.frames)                       # restored exactly
    headers = [h for c in delta.chunks for h in c.headers]
    assert [h.get("delta_reference") for h in headers] == [None, "previous-frame"]
    assert {h["content_type"] for h in headers} == {"application/x-raw-rgb-delta-gzip"}
    webp = run(frames_session(url, 2, seed=3, output_format="webp", max_width=56))
    jpeg = run(frames_session(url, 2, seed=3, output_format="jpeg"))
    for result, shape in ((webp, (32, 56)), (jpeg, (H, W))):
        assert result.errors == [] and result.close_code == 1000
        assert [[h["num_frames"] for h in c.headers] for c in result.chunks] == [[6, 3], [6, 6]]
        assert all(h["type"] == "frame_batch" for c in result.chunks for h in c.headers)   # small: inline
        assert result.frames.shape == (21, *shape, 3)
    # JPEG at quality 95 (4:4:4) stays close to the raw frames; another seed's frames are far from them
    other = run(frames_session(url, 1, seed=8))
    near = np.abs(jpeg.frames[:9].astype(int) - raw.frames[:9]).mean()
    assert near < 6 and np.abs(other.frames.astype(int) - raw.frames[:9]).mean() > 3 * near, near


def test_held_w_moves_the_camera_over_the_chunks_it_spans(serve_app):
    """w held for 2 s (key state events, as a keyboard sends them) drives the chunks planned meanwhile: they
    carry w on every latent frame, the frames are the in-process pipeline's with those keys, and the
    event ids of the press and the release are echoed from the chunks they started."""
    async def on_chunk(client, result, chunk):
        if chunk.index == 1:
            await client.hold(["w"], event_id=10)
            await asyncio.sleep(2.0)
            await client.hold([], event_id=11)

    result = run(frames_session(frames_url(serve_app), 9, seed=5, on_chunk=on_chunk))
    assert result.errors == [] and result.close_code == 1000
    actions = [c.stats["actions"] for c in result.chunks]
    held = [i for i, a in enumerate(actions) if a == [["w"]] * 3]
    assert held and held == list(range(held[0], held[-1] + 1)) and held[0] >= 2, actions
    assert all(a is None for a in actions[:held[0]]), actions
    assert all(a == [[], [], []] for a in actions[held[-1] + 1:]), actions
    assert held[-1] < 8, actions                                          # the release came in time
    ids = [c.stats["event_id"] for c in result.chunks]
    assert ids == [None] * held[0] + [10] * len(held) + [11] * (9 - held[-1] - 1)
    assert all(h.get("event_id") == i for c, i in zip(result.chunks, ids) for h in c.headers if i is not None)
    keys = [None if a is None else Controls(keys=tuple("".join(k) for k in a)) for a in actions]
    expected = in_process_frames(9, seed=5, prompt="a forest path", controls=keys)
    still = in_process_frames(9, seed=5, prompt="a forest path")
    moved = slice(9 + 12 * (held[0] - 1), None)                           # from the first chunk with w on
    assert np.abs(result.frames.astype(int) - expected).mean() < 0.5      # SP-2 vs SP-1 decode: +-1 rounding
    assert np.abs(result.frames[moved].astype(int) - still[moved]).mean() > 2.0


def test_bad_input_gets_its_error_and_nobody_else_notices(serve_app):
    """Bad inits are refused and the connection waits for a good one; a live session (of the other protocol)
    streams on while a second session takes a few hundred malformed messages and still completes."""
    url = frames_url(serve_app)
    rng = random.Random(3)
    junk = [m for m in mutations(rng)][::4]

    async def scenario():
        live = asyncio.create_task(session(serve_app, 6, seed=12))
        async with FramesClient(url) as client:
            await client.ws.send("a text message")
            await client.send({"type": "init", "prompt": "p", "first_frame": b"not an image"})
            await client.send({"type": "init", "prompt": "p", "first_frame": "https://example.com/a.png"})
            await client.send({"type": "event", "kind": "prompt", "payload": "x"})
            await client.init("p", png(), 4, 1)

            async def fuzz(c, result, chunk):
                if chunk.index == 0:                  # 91 messages in all, within the rate's burst of 100 however
                    for data in junk:                    # the proxy bunches them: each one decoded and answered,
                        await c.ws.send(data)            # none dropped undecoded; sent at once, so that a busy
                    await c.event("prompt", "", event_id=5)    # machine's session cannot end before they are read
                    await c.event("camera_actions", [["w"], ["q"]], event_id=6)
            fuzzed = await client.receive_session(lambda r, c: fuzz(client, r, c))
        return fuzzed, await live

    fuzzed, live = run(scenario())
    codes = [e["code"] for e in fuzzed.errors]
    assert codes[:4] == ["unsupported_message", "invalid_image", "invalid_image", "not_started"]
    assert len(codes) >= 4 + len(junk) * 0.8 and "internal_error" not in codes, \
        (Counter(codes), fuzzed.close_code, fuzzed.close_reason, [len(c.frames) for c in fuzzed.chunks])
    assert all(e["content"] and "Traceback" not in e["content"] for e in fuzzed.errors)
    assert [e.get("event_id") for e in fuzzed.errors[-2:]] == [5, 6]
    assert (fuzzed.close_code, fuzzed.close_reason) == (1000, "generation complete")
    assert [len(c.frames) for c in fuzzed.chunks] == [9, 12, 12, 12]
    assert live.error is None and live.done["chunks"] == 6


def test_refusals_close_with_their_codes(serve_app):
    url = frames_url(serve_app)

    async def closed_with(messages):
        async with websockets.connect(url, compression=None, max_size=2 ** 26) as ws:
            for m in messages:
                await ws.send(m)
            errors = []
            try:
                while True:
                    errors.append(msgpack.unpackb(await asyncio.wait_for(ws.recv(), 20)))
            except websockets.ConnectionClosed as e:
                return errors, e.rcvd.code

    big = msgpack.packb({"type": "init", "prompt": "x" * (5 * 2 ** 20)})
    errors, code = run(closed_with([big]))
    assert [e["code"] for e in errors] == ["message_too_large"] and code == 1009
    deep = (b"\x82" + msgpack.packb("type") + msgpack.packb("init") + msgpack.packb("prompt")
            + b"\x91" * 5000 + b"\x01")              # {"type": "init", "prompt": [[[...]]]}, 5000 deep
    errors, code = run(closed_with([deep]))
    assert [e["code"] for e in errors] == ["too_deep"] and code == 1007

    async def odd_sizes():
        async with websockets.connect(url, compression=None, max_size=2 ** 26) as ws:
            codes = []
            for size in ("\u00b2x480", "\u2460x\u2461", "1" * 5000 + "x64"):
                await ws.send(msgpack.packb({"type": "init", "prompt": "p", "size": size}))
                codes.append(msgpack.unpackb(await asyncio.wait_for(ws.recv(), 20))["code"])
            return codes
    assert run(odd_sizes()) == ["invalid_size"] * 3          # a bad init leaves the connection open

    async def capacity():
        async with FramesClient(url) as a, FramesClient(url) as b:
            for seed, client in enumerate((a, b)):
                await client.init("p", png(), None, seed)              # endless: both slots held
            for client in (a, b):
                await client.ws.recv()
            third = await frames_session(url, 2, seed=3)
        return third, [c.ws.close_code for c in (a, b)]
    third, holders_closed = run(capacity())
    assert [e["code"] for e in third.errors] == ["capacity_exhausted"] and third.errors[0]["retry_after_s"] == 7
    assert third.close_code == 1013 and third.chunks == []
    # the holders stopped reading their streams meanwhile: leaving, the client reads on until the server's close
    # frame, so the closing handshake completes (1000), not the close timeout's abnormal end (1006)
    assert holders_closed == [1000, 1000]


def test_python_client_speaks_the_second_protocol(serve_app, tmp_path, capsys):
    """`python -m deployments.client` picks the protocol from the URL: the .npy it writes holds the server's exact
    frames (those of a FramesClient session with the same inputs); an .mp4 holds them encoded."""
    from deployments.client.cli import main
    (tmp_path / "f.png").write_bytes(png())
    url = frames_url(serve_app)
    args = [url, "--image", str(tmp_path / "f.png"), "--prompt", "a forest path", "--chunks", "2", "--seed", "4",
            "--keys", "w,w,w,d"]
    assert main(args + ["-o", str(tmp_path / "out.npy")]) == 0
    assert "wrote 2 chunks, 21 frames (raw)" in capsys.readouterr().out
    direct = run(frames_session(url, 2, seed=4, actions=[["w"], ["w"], ["w"], ["d"]]))
    assert np.array_equal(np.load(tmp_path / "out.npy"), direct.frames)
    assert main(args + ["--format", "jpeg", "-o", str(tmp_path / "out.mp4")]) == 0
    assert read_frames(tmp_path / "out.mp4").shape == (21, H, W, 3)
    assert main(args + ["--poses", "p.npy", "--intrinsics", "k.npy", "-o", str(tmp_path / "x.mp4")]) == 2
    assert "travel over the vllm protocol only" in capsys.readouterr().err
