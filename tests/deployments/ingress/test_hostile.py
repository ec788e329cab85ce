"""Both dialects' parsers under generated input (Hypothesis): arbitrary JSON values and MessagePack maps around
the real message shapes (the right keys with wrong values, wrong keys, deep nesting, huge numbers, odd unicode),
and raw bytes and text. Every input is either a valid message or refused with a code of the table
(ProtocolError, whose code is an ErrorCode by construction); nothing else may escape, since anything else
would reach the ingress's generic handler and be answered as an internal error.

Cost: MAX_EXAMPLES per test (8 tests), about 20 s in all on the 2-core CI machine."""
import base64
import io
import json
import math

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

from deployments.ingress import sglang
from deployments.ingress.parsing import MAX_DEPTH, MAX_INT_DIGITS
from deployments.ingress.vllm import parse_interaction, parse_json, parse_start
from deployments.session.codes import CLOSE_INVALID_DATA, ErrorCode, ProtocolError
from deployments.session.requests import Interaction, StartRequest
from lingbot.config import get_preset

PRESET = get_preset("tiny")
SIZE, GEOMETRY = (PRESET.width, PRESET.height), PRESET.geometry
LIMIT = 4 * 2 ** 20
MAX_EXAMPLES = 600
SETTINGS = settings(max_examples=MAX_EXAMPLES, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def _png(width: int, height: int) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.full((height, width, 3), 90, np.uint8)).save(buf, "PNG")
    return buf.getvalue()


PNG = _png(16, 16)
DATA_URL = "data:image/png;base64," + base64.b64encode(PNG).decode()



def values(integers, *more):
    """Nested values of one wire: JSON's integers are unbounded, MessagePack's 64-bit (and it has bytes)."""
    leaves = st.one_of(st.none(), st.booleans(), integers, st.floats(allow_nan=False), st.text(max_size=12), *more)
    return st.recursive(leaves, lambda inner: st.lists(inner, max_size=4)
                        | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=24)


INT64 = st.integers(min_value=-2 ** 63, max_value=2 ** 64 - 1)
json_values = values(st.integers(min_value=-2 ** 70, max_value=2 ** 70))
msgpack_values = values(st.integers(min_value=-2 ** 63, max_value=2 ** 64 - 1), st.binary(max_size=8))
keys = st.sampled_from(["w", "a", "s", "d", "i", "j", "k", "l", "wa", "", "x", "W", "wasd", "é", "1"])
key_frames = st.lists(keys | st.lists(keys, max_size=3), max_size=4)


def maybe(strategy, anything=json_values):
    """The right kind of value most of the time, anything at all the rest."""
    return st.one_of(strategy, strategy, anything)


def maybe_mp(strategy):
    return maybe(strategy, msgpack_values)


def pose():
    return st.lists(st.lists(st.floats(allow_nan=True, allow_infinity=True, width=32), min_size=4, max_size=4),
                    min_size=3, max_size=5)


starts = st.fixed_dictionaries({"type": st.just("session.start")}, optional={
    "prompt": maybe(st.text(max_size=30)),
    "image_reference": maybe(st.fixed_dictionaries({}, optional={"image_url": maybe(st.sampled_from(
        [DATA_URL, "data:image/png;base64,!!", "data:text/plain,hi", "http://x/", "data:image/png;base64,"]))})),
    "width": maybe(st.sampled_from([SIZE[0], 0, -16, 17, 2 ** 40])),
    "height": maybe(st.sampled_from([SIZE[1], 0, 48])),
    "num_frames": maybe(st.integers(min_value=-5, max_value=10 ** 6) | st.sampled_from([9, 21, 33])),
    "fps": maybe(st.floats() | st.integers(min_value=-10, max_value=200)),
    "seed": maybe(st.integers(min_value=-2 ** 70, max_value=2 ** 70)),
    "model": maybe(st.text(max_size=5)),
    "extra_params": maybe(st.fixed_dictionaries({}, optional={
        "endless": maybe(st.booleans()),
        "flow_shift": maybe(st.floats() | st.integers()),
        "profile_stages": maybe(st.booleans()),
        "camera_action_script": maybe(st.lists(key_frames, max_size=3)),
        "camera_trajectory": maybe(st.fixed_dictionaries({}, optional={
            "poses": maybe(st.lists(pose(), max_size=12)),
            "intrinsics": maybe(st.lists(st.lists(st.floats(width=32), min_size=4, max_size=4), max_size=12))})),
    })),
})
interactions = st.fixed_dictionaries({"type": st.just("session.interaction")}, optional={
    "interaction": maybe(st.fixed_dictionaries({}, optional={
        "event_id": maybe(st.text(max_size=6)),
        "transition_chunks": maybe(st.floats() | st.integers()),
        "event": maybe(st.fixed_dictionaries({}, optional={
            "prompt": maybe(st.text(max_size=10)),
            "keys": maybe(key_frames),
            "multi_modal_data": maybe(st.fixed_dictionaries({}, optional={"camera": maybe(st.fixed_dictionaries({
                "mode": maybe(st.sampled_from(["target", "velocity", "orbit"])),
                "data": maybe(st.fixed_dictionaries({}, optional={
                    "translation": maybe(st.lists(st.floats(), min_size=3, max_size=3)),
                    "rotation": maybe(st.lists(st.floats(), min_size=4, max_size=4))}))}))}))}))}))})
inits = st.fixed_dictionaries({"type": st.just("init")}, optional={
    "prompt": maybe_mp(st.text(max_size=20)),
    "first_frame": maybe_mp(st.sampled_from([PNG, DATA_URL, b"\x89PNG", b"", "http://x/"])),
    "size": maybe_mp(st.sampled_from([f"{SIZE[0]}x{SIZE[1]}", "\u00b2x480", "\u2460x\u2461", "0x0", "12x",
                                      "9" * 60 + "x1"])
                  | st.text(max_size=10)),
    "fps": maybe_mp(st.floats() | INT64),
    "seed": maybe_mp(st.integers(min_value=-2 ** 63, max_value=2 ** 64 - 1)),
    "max_chunks": maybe_mp(st.integers(min_value=-2 ** 63, max_value=2 ** 63 - 1)),
    "num_inference_steps": maybe_mp(st.integers(min_value=-10, max_value=10)),
    "num_frames": maybe_mp(st.floats() | INT64),
    "realtime_output_format": maybe_mp(st.sampled_from(["raw", "webp", "jpeg", "gif"])),
    "output_compression": maybe_mp(st.integers(min_value=-5, max_value=200)),
    "realtime_preview_max_width": maybe_mp(st.integers(min_value=-5, max_value=10 ** 6)),
    "delta_reference": maybe_mp(st.sampled_from(["previous-frame", "none"])),
    "condition_inputs": maybe_mp(st.fixed_dictionaries({}, optional={"camera_actions": maybe_mp(st.lists(key_frames,
                                                                                                   max_size=6))})),
})
events = st.fixed_dictionaries({"type": st.sampled_from(["event", "init", "other"])}, optional={
    "event_id": maybe_mp(st.integers(min_value=-2 ** 63, max_value=2 ** 64 - 1)),
    "kind": maybe_mp(st.sampled_from(["camera_actions", "prompt", "composite_input", "heartbeat", "dance"])),
    "payload": maybe_mp(st.text(max_size=8) | key_frames | st.fixed_dictionaries({}, optional={
        "mode": maybe_mp(st.just("state")), "input_types": maybe_mp(st.lists(st.text(max_size=6), max_size=3)),
        "prompt": maybe_mp(st.text(max_size=6)), "camera_actions": maybe_mp(st.lists(key_frames, max_size=3)),
        "transitions": maybe_mp(st.lists(st.fixed_dictionaries({}, optional={
            "actions": maybe_mp(st.lists(keys, max_size=3)), "client_ts_ms": maybe_mp(INT64)}), max_size=3))})),
})


def refused_or(fn, *args):
    """fn(*args), or its refusal; any other exception fails the test (it would reach the generic handler)."""
    try:
        return fn(*args)
    except ProtocolError as e:
        assert e.code in ErrorCode.__members__.values()
        return e


def vllm_start(text: str):
    msg = parse_json(text, LIMIT)
    return parse_start(msg, SIZE, GEOMETRY, 8, 1000, 16.0, None)


@SETTINGS
@given(starts)
def test_first_protocol_starts(msg):
    out = refused_or(vllm_start, json.dumps(msg))
    assert isinstance(out, (StartRequest, ProtocolError))
    if isinstance(out, StartRequest):
        assert out.image.shape == (3, SIZE[1], SIZE[0]) and (out.chunks is None or 1 <= out.chunks <= 1000)


@SETTINGS
@given(interactions)
def test_first_protocol_interactions(msg):
    out = refused_or(lambda text: parse_interaction(parse_json(text, LIMIT)), json.dumps(msg))
    assert isinstance(out, (Interaction, ProtocolError))


@SETTINGS
@given(st.text(max_size=200) | st.text(alphabet="[]{}\",:0123456789-.e ", max_size=400) | json_values.map(json.dumps))
def test_first_protocol_any_text(text):
    refused_or(vllm_start, text)


@SETTINGS
@given(inits)
def test_second_protocol_inits(msg):
    out = refused_or(lambda data: sglang.parse_init(sglang.unpack(data, LIMIT), SIZE, GEOMETRY, 1000, 16.0, 4,
                                                    None), msgpack.packb(msg, use_bin_type=True))
    assert isinstance(out, (StartRequest, ProtocolError))


@SETTINGS
@given(events)
def test_second_protocol_events(msg):
    out = refused_or(lambda data: sglang.parse_event(sglang.unpack(data, LIMIT), 7),
                     msgpack.packb(msg, use_bin_type=True))
    assert out is None or isinstance(out, (Interaction, ProtocolError))


@SETTINGS
@given(st.binary(max_size=300) | msgpack_values.map(lambda v: msgpack.packb(v, use_bin_type=True)))
def test_second_protocol_any_bytes(data):
    refused_or(lambda d: sglang.parse_event(sglang.unpack(d, LIMIT), 1), data)


@settings(max_examples=60, deadline=None, derandomize=True)
@given(st.integers(min_value=MAX_DEPTH + 1, max_value=5000), st.sampled_from(["[", "{\"a\":"]))
def test_deep_nesting_is_too_deep_on_both(depth, opener):
    closer = "]" if opener == "[" else "}"
    text = '{"type": "session.start", "prompt": ' + opener * depth + "1" + closer * depth + "}"
    error = refused_or(vllm_start, text)
    assert (error.code, error.close) == (ErrorCode.TOO_DEEP, CLOSE_INVALID_DATA)
    packed = (b"\x82" + msgpack.packb("type") + msgpack.packb("init") + msgpack.packb("prompt")
              + b"\x91" * depth + b"\x01")          # {"type": "init", "prompt": [[[...1...]]]}, depth arrays deep
    error = refused_or(sglang.unpack, packed, LIMIT)
    assert (error.code, error.close) == (ErrorCode.TOO_DEEP, CLOSE_INVALID_DATA)


def test_a_million_brackets_and_the_bounds_in_the_docs():
    assert refused_or(vllm_start, "[" * 1_000_000).code == ErrorCode.TOO_DEEP         # read before decoding
    assert refused_or(vllm_start, "[" * 60_000).code == ErrorCode.TOO_DEEP
    assert refused_or(sglang.unpack, b"\x91" * 100_000 + b"\x00", LIMIT).code == ErrorCode.TOO_DEEP
    nested = 1
    for _ in range(MAX_DEPTH - 1):            # at the bound: fine (and then refused for what it is)
        nested = [nested]
    assert refused_or(vllm_start, json.dumps({"type": "session.start", "prompt": nested})).code == \
        ErrorCode.INVALID_FIELD


@pytest.mark.parametrize("text", ['{"type": "session.start", "seed": 1' + "0" * 5000 + "}", "9" * 5000,
                                  '{"type": "session.start", "extra_params": {"endless": -' + "7" * 41 + "}}"])
def test_huge_integers_are_number_too_large(text):
    error = refused_or(vllm_start, text)
    assert (error.code, error.close) == (ErrorCode.NUMBER_TOO_LARGE, CLOSE_INVALID_DATA)
    assert refused_or(vllm_start, '{"type": "x", "n": ' + "9" * MAX_INT_DIGITS + "}").code == \
        ErrorCode.MISSING_FIELD                # the widest integer accepted parses (then the start is refused)


@pytest.mark.parametrize("size", ["\u00b2x480", "\u2460x\u2461", "\uff11\uff11\uff12x\uff16\uff14", "112x\uff164"])
def test_sizes_take_ascii_digits_only(size):
    error = refused_or(sglang.parse_size, size)
    assert error.code == ErrorCode.INVALID_SIZE and math.isfinite(len(error.message))
