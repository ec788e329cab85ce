"""Protocol parsing and validation without a server: every refusal's code and close."""
import base64
import io

import numpy as np
import pytest
from PIL import Image

from deployments.ingress.access import authorized
from deployments.ingress.vllm import parse_interaction, parse_json, parse_start
from deployments.session.codes import ProtocolError
from lingbot.config import LINGBOT_GEOMETRY
from tests.deployments.ingress.inputs import GEOMETRY, data_url, frames_for_chunks, start


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
    assert start().paced and not start(extra_params={"realtime_output_pacing": False}).paced
    assert start().unknown_fields == ()
    assert start(guidance=2, extra_params={"endless": True, "sink": 6}).unknown_fields == ("guidance",
                                                                                         "extra_params.sink")


@pytest.mark.parametrize("kw,code,close", [
    (dict(width=100), "invalid_size", 1008),
    (dict(width=128), "unsupported_size", 1008),
    (dict(num_frames=34), "invalid_num_frames", 1008),
    (dict(num_frames=frames_for_chunks(101)), "invalid_num_frames", 1008),
    (dict(prompt=None), "missing_field", None),
    (dict(prompt="p" * 4097), "text_too_long", 1008),
    (dict(seed="x"), "invalid_field", None),
    (dict(fps=0), "invalid_field", 1008),
    (dict(fps=16.5), "invalid_field", 1008),              # above the deployment's fps (its max_fps by default)
    (dict(extra_params={"realtime_output_pacing": "no"}), "invalid_field", 1008),
    (dict(image_reference={"image_url": "data:image/png;base64,@@@"}), "invalid_image", None),
    (dict(extra_params={"camera_action_script": [["w", "w"]]}), "invalid_field", 1008),
    (dict(extra_params={"flow_shift": -1}), "invalid_field", 1008),
])
def test_start_refusals(kw, code, close):
    with pytest.raises(ProtocolError) as info:
        start(**kw)
    assert info.value.code == code and info.value.close == close


def test_the_decoder_is_picked_among_the_loaded_ones_before_the_request_is_built():
    loaded = ("wan", "tae")
    def pick(**kw):
        msg = {"type": "session.start", "prompt": "p", "image_reference": {"image_url": data_url()}, **kw}
        return parse_start(msg, (112, 64), GEOMETRY, 8, 100, 16.0, decoders=loaded)
    assert pick(extra_params={"decoder": "tae"}).decoder == "tae" and pick().decoder is None
    assert pick().seed == 0                                      # this protocol's default seed
    not_loaded = r"extra_params.decoder 'vae' is not loaded here; loaded: \['wan', 'tae'\]"
    with pytest.raises(ProtocolError, match=not_loaded) as info:
        pick(extra_params={"decoder": "vae"}, width=100)         # checked first, before the size
    assert (info.value.code, info.value.close) == ("decoder_not_loaded", 1008)
    with pytest.raises(ProtocolError, match=r"extra_params.decoder must be a string, one of \['wan', 'tae'\]"):
        pick(extra_params={"decoder": 7})


def test_a_session_pins_a_rung_among_the_deployments_or_leaves_it_to_the_ladder():
    """extra_params.quality: auto (absent or null), full, or a rung down to the deployment's quality_floor."""
    def pick(quality, rungs=("full", "steps3")):
        msg = {"type": "session.start", "prompt": "p", "image_reference": {"image_url": data_url()},
               "extra_params": {"quality": quality}}
        return parse_start(msg, (112, 64), GEOMETRY, 8, 100, 16.0, rungs=rungs).quality
    assert [pick(q) for q in (None, "auto", "full", "steps3")] == ["auto", "auto", "full", "steps3"]
    assert start().quality == "auto" and pick("full", rungs=("full",)) == "full"
    for bad, shown in (("steps2", "'steps2'"), ("tiny", "'tiny'"), (3, "int"), ("", "''")):
        with pytest.raises(ProtocolError) as info:
            pick(bad)
        assert (info.value.code, info.value.close, info.value.message) == (
            "invalid_field", 1008, f"extra_params.quality must be one of ['auto', 'full', 'steps3'], got {shown}")


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


def test_prompts_and_event_ids_are_bounded():
    """A prompt of at most 4096 characters (the text encoder reads 512 tokens), an event id a string or an
    integer of at most 128 characters (echoed in every chunk's metadata)."""
    assert start(prompt="p" * 4096).prompt == "p" * 4096
    ok = parse_interaction({"interaction": {"event_id": "e" * 128, "event": {"prompt": "q" * 4096}}})
    assert ok.event_id == "e" * 128 and ok.prompt == "q" * 4096
    cases = [({"event_id": "e" * 129, "event": {"prompt": "q"}}, "text_too_long",
              "interaction.event_id holds 129 characters; at most 128", None),
             ({"event_id": 10 ** 130, "event": {"prompt": "q"}}, "text_too_long", "at most 128", None),
             ({"event_id": {"a": 1}, "event": {"prompt": "q"}}, "invalid_field", "a string or an integer", None),
             ({"event_id": True, "event": {"prompt": "q"}}, "invalid_field", "a string or an integer", None),
             ({"event_id": "e1", "event": {"prompt": "q" * 4097}}, "text_too_long",
              "event.prompt holds 4097 characters; at most 4096", "e1")]
    for body, code, match, echoed in cases:
        with pytest.raises(ProtocolError, match=match) as info:
            parse_interaction({"interaction": body})
        assert info.value.code == code and info.value.close is None          # the session goes on
        assert info.value.extra.get("event_id") == echoed


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
    with pytest.raises(ProtocolError, match=r"image 10000x5000 has more than 2073600 pixels") as info:
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


def trajectory_json(frames=5):
    """Per video frame poses yawing 10 deg and stepping 0.1 along z, intrinsics at 832x480, as JSON lists."""
    from lingbot.camera import make_pose, rot_y
    poses = [make_pose(rot_y(10 * i), (0.0, 0.0, 0.1 * i)).tolist() for i in range(frames)]
    return {"poses": poses, "intrinsics": [[500.0, 400.0, 416.0, 240.0]] * frames}


def test_start_with_a_camera_trajectory():
    req = start(num_frames=21, extra_params={"camera_trajectory": trajectory_json(21)})
    assert len(req.trajectory) == 6                           # 21 video frames -> 6 latent frames
    np.testing.assert_allclose(req.trajectory.intrinsics[0], [500 * 112 / 832, 400 * 64 / 480, 56, 32], atol=1e-12)
    assert req.trajectory.unit == pytest.approx(0.4, abs=1e-12)
    # a longer clip is cut to the session's frames; an endless session takes up to max_chunks' worth
    assert len(start(num_frames=9, extra_params={"camera_trajectory": trajectory_json(21)}).trajectory) == 3
    assert len(start(num_frames=None, extra_params={"endless": True,
                                                    "camera_trajectory": trajectory_json(21)}).trajectory) == 6


def _bad(mutate):
    value = trajectory_json(5)
    mutate(value)
    return value


@pytest.mark.parametrize("value,code", [
    ("poses.npy", "invalid_field"),
    ({"poses": trajectory_json()["poses"]}, "invalid_field"),
    (trajectory_json(frames_for_chunks(100) + 1), "trajectory_too_long"),     # max_chunks is 100
    (_bad(lambda v: v["poses"][1].pop()), "trajectory_shape"),          # a 3x4 pose
    (_bad(lambda v: v["intrinsics"].pop()), "trajectory_shape"),        # 4 intrinsics for 5 poses
    (_bad(lambda v: v["poses"][2][0].__setitem__(3, "1")), "trajectory_shape"),     # a string
    (_bad(lambda v: v["poses"][2][0].__setitem__(3, True)), "trajectory_shape"),    # a bool
    (_bad(lambda v: v["poses"][2][0].__setitem__(3, 1e400)), "trajectory_not_finite"),   # JSON 1e400 is inf
    (_bad(lambda v: v["poses"][3][0].__setitem__(0, 2.0)), "trajectory_not_rigid"),
    (_bad(lambda v: v["poses"][3][3].__setitem__(3, 2.0)), "trajectory_not_rigid"),
    (_bad(lambda v: v["intrinsics"].__setitem__(4, [500.0, -400.0, 416.0, 240.0])), "trajectory_intrinsics"),
])
def test_bad_camera_trajectories_have_their_codes(value, code):
    with pytest.raises(ProtocolError) as e:
        start(extra_params={"camera_trajectory": value})
    assert (e.value.code, e.value.close) == (code, 1008)
    assert e.value.message.startswith("extra_params.camera_trajectory")


def test_camera_trajectory_and_action_script_conflict():
    with pytest.raises(ProtocolError) as e:
        start(extra_params={"camera_trajectory": trajectory_json(5),
                            "camera_action_script": [["w", "w", "w"]]})
    assert e.value.code == "conflicting_camera"


def test_fps_is_at_most_the_deployments_max_fps():
    """A session may ask for any fps up to max_fps (by default the deployment's fps, what capacity counts)."""
    msg = {"type": "session.start", "prompt": "p", "image_reference": {"image_url": data_url()}, "width": 112,
           "height": 64, "num_frames": 33, "seed": 1}
    faster = parse_start(dict(msg, fps=60), (112, 64), GEOMETRY, 8, 100, 16.0, max_fps=60.0)
    assert faster.fps == 60.0 and start().fps == 16.0 and start(fps=8).fps == 8.0
    for fps, kwargs in ((61, dict(max_fps=60.0)), (17, {})):
        with pytest.raises(ProtocolError) as info:
            parse_start(dict(msg, fps=fps), (112, 64), GEOMETRY, 8, 100, 16.0, **kwargs)
        highest = kwargs.get("max_fps", 16.0)
        assert (info.value.code, str(info.value)) == ("invalid_field", f"fps must be between 1 and {highest:g}, "
                                                                       f"got {fps}")


def test_extra_params_ask_for_a_sessions_own_window_as_the_second_protocol_does():
    msg = {"type": "session.start", "prompt": "p", "image_reference": {"image_url": data_url()}, "width": 112,
           "height": 64, "num_frames": 33, "seed": 1}

    def windowed(**extra):
        return parse_start(dict(msg, extra_params=extra), (112, 64), GEOMETRY, 8, 100, 16.0, model_window=(3, 6))
    assert windowed(realtime_causal_sink_size=6).window == (2, 6) and windowed().window is None
    assert windowed(realtime_causal_sink_size=3, realtime_causal_kv_cache_num_frames=9).window == (1, 3)
    assert windowed(realtime_causal_sink_size=6).unknown_fields == ()
    with pytest.raises(ProtocolError) as e:
        windowed(realtime_causal_kv_cache_num_frames=24)
    assert e.value.code == "invalid_field" and e.value.close == 1008 and e.value.message.startswith(
        "extra_params: the window may be at most 6 chunks (the model's), got 8; served: realtime_causal_sink_size "
        "up to 12")
