"""Protocol parsing and validation without a server: every refusal's code and close."""
import base64
import io

import numpy as np
import pytest
from PIL import Image

from deployments.protocol import ProtocolError, authorized, parse_interaction, parse_json, parse_start
from lingbot.config import LINGBOT_GEOMETRY, get_preset

GEOMETRY = get_preset("tiny").geometry
frames_for_chunks = GEOMETRY.video_frames


def data_url(w=30, h=20):
    buf = io.BytesIO()
    Image.fromarray(np.full((h, w, 3), 128, np.uint8)).save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def start(**kw):
    msg = {"type": "session.start", "prompt": "p", "image_reference": {"image_url": data_url()}, "width": 112,
           "height": 64, "num_frames": 33, "seed": 1}
    msg.update(kw)
    return parse_start(msg, (112, 64), GEOMETRY, default_chunks=8, max_chunks=100, default_fps=16.0)


def test_num_frames_formula():
    assert GEOMETRY == LINGBOT_GEOMETRY                    # every preset shares the chunk geometry
    assert [GEOMETRY.pixel_frames(k) for k in (0, 1, 7)] == [9, 12, 12]
    assert [frames_for_chunks(n) for n in (1, 2, 3)] == [9, 21, 33]
    assert [GEOMETRY.chunks_for(f) for f in (9, 21, 33, 81, 85)] == [1, 2, 3, 7, None]
    assert GEOMETRY.chunks_for(20) is None and GEOMETRY.chunks_for(5) is None
    with pytest.raises(ProtocolError, match=r"num_frames 34 is not of the form \(3N - 1\) \* 4 \+ 1: 9, 21, 33"):
        start(num_frames=34)


def test_start_parsing():
    req = start(extra_params={"flow_shift": 5, "camera_action_script": [[["w"], "wa", ""], ["", "", "l"]]})
    assert (req.chunks, req.width, req.height, req.seed, req.flow_shift) == (3, 112, 64, 1, 5.0)
    assert req.action_script == [("w", "wa", ""), ("", "", "l")]
    assert req.image.shape == (3, 64, 112) and req.image.dtype == np.float32
    assert start(num_frames=None).chunks == 8
    assert start(extra_params={"endless": True}).chunks is None


@pytest.mark.parametrize("kw,code,close", [
    (dict(width=100), "invalid_size", 1008),
    (dict(width=128), "unsupported_size", 1008),
    (dict(num_frames=34), "invalid_num_frames", 1008),
    (dict(num_frames=frames_for_chunks(101)), "invalid_num_frames", 1008),
    (dict(prompt=None), "missing_field", None),
    (dict(seed="x"), "invalid_field", None),
    (dict(fps=0), "invalid_field", 1008),
    (dict(image_reference={"image_url": "data:image/png;base64,@@@"}), "invalid_image", None),
    (dict(extra_params={"camera_action_script": [["w", "w"]]}), "invalid_field", 1008),
    (dict(extra_params={"flow_shift": -1}), "invalid_field", 1008),
])
def test_start_refusals(kw, code, close):
    with pytest.raises(ProtocolError) as info:
        start(**kw)
    assert info.value.code == code and info.value.close == close


def test_json_limits():
    with pytest.raises(ProtocolError, match="exceeds the limit of 10 bytes") as info:
        parse_json('{"type": "session.ping"}', 10)
    assert info.value.close == 1009
    with pytest.raises(ProtocolError, match="not valid JSON"):
        parse_json("{", 100)
    with pytest.raises(ProtocolError, match="no string field 'type'"):
        parse_json("[1]" if False else '{"a": 1}', 100)


def test_interaction_parsing():
    cam = {"mode": "target", "data": {"translation": [0, 0, 1], "rotation": [0, 0, 0, 1]}}
    i = parse_interaction({"interaction": {"event_id": 7, "event": {"multi_modal_data": {"camera": cam},
                                                                     "keys": ["w", ["a", "d"]], "prompt": "night"},
                                           "transition_chunks": 2}})
    assert i.event_id == "7" and i.keys == ["w", "ad"] and i.prompt == "night"
    assert i.camera.mode == "target" and i.camera.transition_chunks == 2
    with pytest.raises(ProtocolError, match="event needs prompt") as info:
        parse_interaction({"interaction": {"event_id": "e", "event": {}}})
    assert info.value.extra == {"event_id": "e"}
    with pytest.raises(ProtocolError, match="camera mode 'spin'"):
        parse_interaction({"interaction": {"event_id": "e", "event": {"multi_modal_data": {"camera": {
            "mode": "spin", "data": {"translation": [0, 0, 0], "rotation": [0, 0, 0, 1]}}}}}})


def test_out_of_range_values_are_refused():
    with pytest.raises(ProtocolError, match="seed must fit in 64 bits"):
        start(seed=2 ** 64)
    with pytest.raises(ProtocolError, match=r"field 'fps' is out of range"):
        start(fps=10 ** 400)
    with pytest.raises(ProtocolError, match="flow_shift must be a number in"):
        start(extra_params={"flow_shift": 1e300 * 10})
    with pytest.raises(ProtocolError, match="Infinity is not a number JSON allows") as info:
        parse_json('{"type": "session.start", "fps": Infinity}', 1000)
    assert info.value.code == "invalid_json"
    with pytest.raises(ProtocolError, match="translation") as info:
        parse_interaction({"interaction": {"event_id": "e", "event": {"multi_modal_data": {"camera": {
            "mode": "target", "data": {"translation": [10 ** 400, 0, 0], "rotation": [0, 0, 0, 1]}}}}}})
    assert info.value.code == "invalid_field"


def test_decompression_bomb_is_refused_before_decoding():
    buf = io.BytesIO()
    Image.new("L", (10000, 5000)).save(buf, "PNG")          # 50 MP of one colour: a few kB of PNG
    assert len(buf.getvalue()) < 200_000
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    with pytest.raises(ProtocolError, match="has more than 40000000 pixels") as info:
        start(image_reference={"image_url": url})
    assert info.value.code == "invalid_image"


def test_api_keys():
    keys = frozenset({"k1", "k2"})
    assert authorized({}, {}, frozenset())                                  # no keys configured: open
    assert authorized({"authorization": "Bearer k2"}, {}, keys)
    assert authorized({"x-api-key": "k1"}, {}, keys)
    assert authorized({}, {"api_key": "k1"}, keys)
    assert not authorized({"authorization": "Bearer nope"}, {"api_key": ""}, keys)
    assert not authorized({}, {}, keys)
