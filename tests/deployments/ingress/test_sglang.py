"""The second protocol (SGLang's MessagePack realtime video) without a server: init and event parsing, every
refusal's code, the server's frame messages, and a fuzz of malformed input that must only ever be refused."""
import random

import msgpack
import numpy as np
import pytest

from deployments.ingress import sglang
from deployments.session.codes import CLOSE_TOO_BIG, ProtocolError
from lingbot.io.frames import FrameBatcher, FrameFormat
from tests.deployments.ingress.inputs import GEOMETRY, data_url, mutations, png_bytes

SIZE = (112, 64)


def init(**kw):
    msg = {"type": "init", "prompt": "p", "first_frame": png_bytes(), "size": "112x64"}
    msg.update(kw)
    return sglang.parse_init(msg, SIZE, GEOMETRY, max_chunks=100, default_fps=16.0, steps=4)


def refused(fn, code, match=None):
    with pytest.raises(ProtocolError, match=match) as e:
        fn()
    assert e.value.code == code, (e.value.code, e.value.message)
    return e.value


def test_init_defaults_and_fields():
    req = init()
    assert (req.width, req.height, req.fps, req.seed, req.chunks, req.num_frames) == (112, 64, 16.0, 42, None, None)
    assert req.output == FrameFormat("raw") and req.action_script == []
    assert req.image.shape == (3, 64, 112) and abs(float(req.image.mean()) - (99 / 127.5 - 1)) < 1e-6
    req = init(max_chunks=3, seed=-5, fps=12, size=" 112 X 64", num_inference_steps=4, model="lingbot-world",
               first_frame=data_url(), num_frames=81, seconds=5,
               condition_inputs={"camera_actions": [["w"], ["w", "j"], [], ["l"]]},
               realtime_output_format="webp", output_compression=70, realtime_preview_max_width=56)
    assert (req.chunks, req.num_frames, req.seed, req.fps) == (3, 33, -5, 12.0)
    assert req.action_script == [("w", "wj", ""), ("l", "", "")]
    assert req.output == FrameFormat("webp", 70, 56)
    assert init(realtime_output_format="jpeg").output == FrameFormat("jpeg", 95)
    assert init(realtime_output_format="webp", output_compression=0).output.compression == 90
    assert init(delta_reference="previous-frame").output == FrameFormat("raw", delta=True)
    # no classifier-free guidance: the values that mean none are accepted (clients send 1.0 or 0.0)
    assert all(init(guidance_scale=g).prompt == "p" for g in (1.0, 1, 0.0, 0, 0.5))
    assert init().paced and not init(realtime_output_pacing=False).paced and init(realtime_output_pacing=True).paced
    assert init(realtime_output_pacing=None).paced
    # quality: auto unless the session pins one of the deployment's rungs (the same check as the first protocol's)
    assert init().quality == "auto"
    assert sglang.parse_init({"type": "init", "prompt": "p", "first_frame": png_bytes(), "quality": "steps2"}, SIZE,
                             GEOMETRY, 100, 16.0, 4, rungs=("full", "steps3", "steps2")).quality == "steps2"
    # the K/V window fields are read (without the model's window given, as here, none is asked for); any other
    # field is ignored and named (escaped) for the log
    assert init(realtime_causal_sink_size=6, realtime_causal_kv_cache_num_frames=18).unknown_fields == ()
    assert init(zeta=1, alpha="x", **{"new\nline": 0, "k" * 80: 1}).unknown_fields == (
        "alpha", "k" * 64, "new\\nline", "zeta")


@pytest.mark.parametrize("fields, code, match", [
    (dict(type="event"), "not_started", "first message must be an init"),
    (dict(prompt=""), "missing_field", "non-empty string 'prompt'"),
    (dict(prompt=3), "missing_field", "prompt"),
    (dict(prompt="a" * 4097), "text_too_long", "init.prompt holds 4097 characters; at most 4096"),
    (dict(first_frame=None), "missing_field", "first_frame"),
    (dict(first_frame=b"not an image"), "invalid_image", "first_frame"),
    (dict(first_frame="https://example.com/a.png"), "invalid_image", "not fetched"),
    (dict(first_frame="aGVsbG8="), "invalid_image", "data: URL"),
    (dict(first_frame=5), "invalid_field", "bytes or a string"),
    (dict(size="832x480"), "unsupported_size", "serves 112x64"),
    (dict(size="112by64"), "invalid_size", "WIDTHxHEIGHT"),
    (dict(size="0x64"), "invalid_size", "positive"),
    (dict(size=112), "invalid_size", "WIDTHxHEIGHT"),
    (dict(fps=0), "invalid_field", "fps"),
    (dict(fps=17), "invalid_field", "fps must be between 1 and 16, got 17"),
    (dict(fps="16"), "invalid_field", "fps"),
    (dict(fps=True), "invalid_field", "fps"),
    (dict(seed=2 ** 64), "invalid_field", "64 bits"),
    (dict(seed=1.5), "invalid_field", "seed"),
    (dict(num_inference_steps=8), "invalid_field", "4 steps per chunk, not 8"),
    (dict(guidance_scale=5.0), "invalid_field", "guidance_scale must be at most 1.0 \\(none\\), got 5"),
    (dict(guidance_scale=float("nan")), "invalid_field", "guidance_scale must be at most 1.0"),
    (dict(guidance_scale="1.0"), "invalid_field", "'guidance_scale' must be a number"),
    (dict(realtime_output_pacing=0), "invalid_field", "'realtime_output_pacing' must be true or false, got int"),
    (dict(quality="steps3"), "invalid_field", r"init field 'quality' must be one of \['auto', 'full'\], got 'steps3'"),
    (dict(max_chunks=0), "invalid_field", "max_chunks"),
    (dict(max_chunks=101), "invalid_field", "between 1 and 100"),
    (dict(num_frames=-1), "invalid_field", "num_frames"),
    (dict(seconds=0), "invalid_field", "seconds"),
    (dict(condition_inputs=[]), "invalid_field", "condition_inputs"),
    (dict(condition_inputs={"camera_actions": ["w"]}), "invalid_field", "list of action lists"),
    (dict(condition_inputs={"camera_actions": [["x"]]}), "invalid_field", "unknown key"),
    (dict(condition_inputs={"camera_actions": [[]] * 513}), "invalid_field", "at most 512"),
    (dict(realtime_output_format="png"), "invalid_field", "raw, webp, jpeg"),
    (dict(output_compression=101), "invalid_field", "output_compression"),
    (dict(realtime_preview_max_width=-2), "invalid_field", "positive"),
    (dict(delta_reference="first-frame"), "invalid_field", "previous-frame"),
    (dict(delta_reference="previous-frame", realtime_output_format="jpeg"), "invalid_field", "raw frames only"),
    (dict(model=1), "invalid_field", "model"),
])
def test_bad_init_is_refused_with_its_code(fields, code, match):
    error = refused(lambda: init(**fields), code, match)
    assert error.close is None                             # a bad init keeps the connection for another init


def test_the_decoder_is_picked_among_the_loaded_ones_before_the_request_is_built():
    def pick(**kw):
        msg = {"type": "init", "prompt": "p", "first_frame": png_bytes(), **kw}
        return sglang.parse_init(msg, SIZE, GEOMETRY, 100, 16.0, 4, decoders=("wan", "tae"))
    assert pick(decoder="tae").decoder == "tae" and pick().decoder is None and pick().seed == 42
    error = refused(lambda: pick(decoder="vae", prompt=""), "decoder_not_loaded",
                    r"init.decoder 'vae' is not loaded here; loaded: \['wan', 'tae'\]")     # checked before the prompt
    assert error.close is None
    refused(lambda: pick(decoder=["tae"]), "invalid_field", r"init.decoder must be a string")
    refused(lambda: pick(type="event", decoder="vae"), "not_started", "first message must be an init")


def event(kind, payload=None, event_id=None, seq=1):
    msg = {"type": "event", "kind": kind, "payload": payload}
    if event_id is not None:
        msg["event_id"] = event_id
    return sglang.parse_event(msg, seq)


def test_a_prompt_of_the_longest_length_is_taken():
    assert init(prompt="p" * 4096).prompt == "p" * 4096
    assert sglang.parse_event({"type": "event", "kind": "prompt", "payload": "q" * 4096}, 1).prompt == "q" * 4096


def test_event_kinds():
    assert event("heartbeat") is None
    e = event("camera_actions", [["w"], [], ["a", "j"]], event_id=7)
    assert (e.event_id, e.keys, e.hold, e.prompt) == ("7", ["w", "", "aj"], None, None)
    e = event("camera_actions", {"mode": "state", "transitions": [{"actions": ["w", "j"], "client_ts_ms": 5},
                                                                  {"actions": []}]}, seq=9)
    assert (e.event_id, e.hold, e.keys) == ("~9", ["wj", ""], None)
    assert event("prompt", "a night sky", event_id=2).prompt == "a night sky"
    e = event("composite_input", {"input_types": ["prompt", "camera_actions"], "prompt": "snow",
                                  "camera_actions": {"mode": "state", "transitions": [{"actions": ["d"]}]}})
    assert (e.prompt, e.hold) == ("snow", ["d"])


@pytest.mark.parametrize("msg, code, match", [
    ({"type": "init"}, "already_started", "already has a session"),
    ({"type": "stop"}, "unknown_type", "'stop'"),
    ({"type": "event", "kind": "dance"}, "unsupported_event", "unknown event kind 'dance'"),
    ({"type": "event", "kind": "prompt", "payload": ""}, "invalid_field", "non-empty string"),
    ({"type": "event", "kind": "prompt", "payload": None}, "invalid_field", "non-empty string"),
    ({"type": "event", "kind": "prompt", "payload": "é" * 4097, "event_id": 3}, "text_too_long",
     "prompt event payload holds 4097 characters; at most 4096"),
    ({"type": "event", "kind": "composite_input", "payload": {"input_types": ["prompt"], "prompt": "x" * 5000}},
     "text_too_long", "at most 4096"),
    ({"type": "event", "kind": "prompt", "payload": "x", "event_id": "7"}, "invalid_field", "event_id"),
    ({"type": "event", "kind": "prompt", "payload": "x", "event_id": True}, "invalid_field", "event_id"),
    ({"type": "event", "kind": "camera_actions", "payload": "w"}, "invalid_field", "list of action lists"),
    ({"type": "event", "kind": "camera_actions", "payload": [["q"]]}, "invalid_field", "unknown key"),
    ({"type": "event", "kind": "camera_actions", "payload": {"mode": "state"}}, "invalid_field", "transitions"),
    ({"type": "event", "kind": "camera_actions", "payload": {"mode": "state", "transitions": [[]]}},
     "invalid_field", r"transitions\[0\] must be a map"),
    ({"type": "event", "kind": "camera_actions",
      "payload": {"mode": "state", "transitions": [{"actions": ["w"], "client_ts_ms": "now"}]}},
     "invalid_field", "client_ts_ms"),
    ({"type": "event", "kind": "camera_actions",
      "payload": {"mode": "state", "transitions": [{"actions": ["w"]}] * 513}}, "invalid_field", "at most 512"),
    ({"type": "event", "kind": "composite_input", "payload": []}, "invalid_field", "must be a map"),
    ({"type": "event", "kind": "composite_input", "payload": {"input_types": []}}, "invalid_field", "input_types"),
    ({"type": "event", "kind": "composite_input", "payload": {"input_types": ["prompt"]}}, "missing_field",
     "no field 'prompt'"),
    ({"type": "event", "kind": "composite_input", "payload": {"input_types": ["image"], "image": 1}},
     "unsupported_event", "'image'"),
])
def test_bad_events_are_refused_with_their_code(msg, code, match):
    error = refused(lambda: sglang.parse_event(msg, 1), code, match)
    assert error.close is None
    if "event_id" in msg and code != "invalid_field":
        assert error.extra["event_id"] == msg["event_id"]


def test_unpack_refuses_what_is_not_one_map():
    assert sglang.unpack(msgpack.packb({"type": "init"}), 100) == {"type": "init"}
    big = refused(lambda: sglang.unpack(b"\x80" * 101, 100), "message_too_large", "101 bytes")
    assert big.close == CLOSE_TOO_BIG
    refused(lambda: sglang.unpack(b"\xc1", 100), "invalid_msgpack")                   # a reserved byte
    refused(lambda: sglang.unpack(msgpack.packb({"type": "x"})[:-1], 100), "invalid_msgpack")   # truncated
    refused(lambda: sglang.unpack(msgpack.packb({"type": "x"}) + b"\x00", 100), "invalid_msgpack")  # extra
    refused(lambda: sglang.unpack(msgpack.packb([1, 2]), 100), "invalid_msgpack", "a MessagePack map")
    refused(lambda: sglang.unpack(msgpack.packb({"kind": "x"}), 100), "missing_field")
    refused(lambda: sglang.unpack(b"\xa2\xff\xfe", 100), "invalid_msgpack")          # not UTF-8
    assert msgpack.unpackb(sglang.error_message(ProtocolError("invalid_field", "m", event_id=3))) == \
        {"type": "error", "content": "m", "code": "invalid_field", "event_id": 3}


def test_frame_messages_split_at_64_kib_and_carry_the_header_fields():
    w, h = 112, 64
    frames = np.random.RandomState(0).randint(0, 256, (12, h, w, 3), dtype=np.uint8)
    raw = FrameFormat("raw")
    [batch] = FrameBatcher(raw, w, h).batches(frames)          # 258 KiB: the header, then the payload alone
    header, payload = sglang.batch_messages("r", 3, 9, raw, w, h, (batch,))
    assert payload == frames.tobytes()
    assert msgpack.unpackb(header) == {
        "type": "frame_batch_header", "request_id": "r", "chunk_index": 3, "content_type": "application/x-raw-rgb",
        "num_frames": 12, "total_size": len(payload), "frame_batch_index": 0, "num_frame_batches": 1,
        "is_final_frame_batch": True, "event_id": 9, "channels": 3, "bytes_per_frame": w * h * 3,
        "format": "rgb24", "width": w, "height": h, "raw_size": len(payload), "encoding": "raw"}
    small = FrameBatcher(raw, w, h).batches(frames[:2])        # 43 KiB: one frame_batch with the payload inside
    [inline] = sglang.batch_messages("r", 0, None, raw, w, h, tuple(small))
    msg = msgpack.unpackb(inline)
    assert msg["type"] == "frame_batch" and msg["payload"] == frames[:2].tobytes() and "event_id" not in msg
    webp = FrameFormat("webp", 80, max_width=56)
    batches = FrameBatcher(webp, w, h).batches(frames)
    messages = [msgpack.unpackb(m) for m in sglang.batch_messages("r", 1, None, webp, w, h, tuple(batches))]
    assert [(m["type"], m["num_frames"], m["frame_batch_index"], m["is_final_frame_batch"]) for m in messages] == \
        [("frame_batch", 6, 0, False), ("frame_batch", 6, 1, True)]
    m = messages[0]
    assert (m["content_type"], m["width"], m["height"], m["source_width"], m["preview_height"]) == \
        ("image/webp", 56, 32, 112, 32)
    assert sum(m["payload_lengths"]) == len(m["payload"]) == m["total_size"]
    delta = FrameFormat("raw", delta=True)
    batcher = FrameBatcher(delta, w, h)
    first = msgpack.unpackb(sglang.batch_messages("r", 0, None, delta, w, h, tuple(batcher.batches(frames)))[0])
    second = msgpack.unpackb(sglang.batch_messages("r", 1, None, delta, w, h, tuple(batcher.batches(frames)))[0])
    assert first["encoding"] == "delta-gzip" and "delta_reference" not in first
    assert second["delta_reference"] == "previous-frame" and second["raw_size"] == frames.nbytes


def test_fuzz_malformed_messages_are_only_ever_refused():
    """A few hundred generated messages: each is parsed or refused with a ProtocolError, nothing else escapes."""
    rng = random.Random(12)
    cases = list(mutations(rng))
    assert len(cases) >= 300
    outcomes = {"parsed": 0, "refused": 0}
    for data in cases:
        try:
            msg = sglang.unpack(data, 2 ** 20)
            if msg["type"] == "init":
                req = sglang.parse_init(msg, SIZE, GEOMETRY, max_chunks=100, default_fps=16.0, steps=4)
                assert req.image.shape == (3, 64, 112)
            else:
                sglang.parse_event(msg, 1)
            outcomes["parsed"] += 1
        except ProtocolError as e:
            assert e.code and e.message and e.close in (None, CLOSE_TOO_BIG)
            outcomes["refused"] += 1
    assert outcomes["refused"] > 250 and outcomes["parsed"] > 5, outcomes


def windowed(**kw):
    msg = {"type": "init", "prompt": "p", "first_frame": png_bytes(), "size": "112x64", **kw}
    return sglang.parse_init(msg, SIZE, GEOMETRY, max_chunks=100, default_fps=16.0, steps=4, model_window=(3, 6))


def test_a_session_asks_for_its_own_window_in_latent_frames_and_a_larger_one_is_refused():
    """realtime_causal_sink_size and realtime_causal_kv_cache_num_frames (latent frames, 3 per chunk here): any
    window the model's (sink 9, window 18) holds; the model's own, or neither field, is the default (None)."""
    assert windowed(realtime_causal_sink_size=6).window == (2, 6)
    assert windowed(realtime_causal_sink_size=6, realtime_causal_kv_cache_num_frames=12).window == (2, 4)
    assert windowed(realtime_causal_kv_cache_num_frames=15).window == (3, 5)
    assert windowed(realtime_causal_sink_size=0, realtime_causal_kv_cache_num_frames=6).window == (0, 2)
    assert windowed().window is None and windowed(realtime_causal_sink_size=9).window is None
    served = "served: realtime_causal_sink_size up to 12, realtime_causal_kv_cache_num_frames up to 18 latent frames"
    e = refused(lambda: windowed(realtime_causal_kv_cache_num_frames=21), "invalid_field")
    assert e.message == f"init: the window may be at most 6 chunks (the model's), got 7; {served}"
    e = refused(lambda: windowed(realtime_causal_sink_size=15), "invalid_field")
    assert e.message == (f"init: the window (6 chunks) must hold the sink (5), at least one chunk of history and "
                         f"the current chunk; {served}")
    for bad in (7, -3, 6.0, "6", True):
        e = refused(lambda bad=bad: windowed(realtime_causal_sink_size=bad), "invalid_field")
        assert e.message == (f"init field 'realtime_causal_sink_size' must be a multiple of 3 latent frames (a "
                             f"chunk's), got {bad!r}")
