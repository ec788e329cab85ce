"""Protocol parsing, settings and the session scheduler without a server."""
import base64
import io

import numpy as np
import pytest
from PIL import Image

from deployments.protocol import (ProtocolError, chunks_for_frames, frames_for_chunks, parse_interaction, parse_json,
                                  parse_start)
from deployments.sessions import Scheduler, SessionState
from deployments.settings import ServeSettings
from lingbot.config import ConfigError


def data_url(w=30, h=20):
    buf = io.BytesIO()
    Image.fromarray(np.full((h, w, 3), 128, np.uint8)).save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def start(**kw):
    msg = {"type": "session.start", "prompt": "p", "image_reference": {"image_url": data_url()}, "width": 112,
           "height": 64, "num_frames": 33, "seed": 1}
    msg.update(kw)
    return parse_start(msg, (112, 64), default_chunks=8, max_chunks=100, default_fps=16.0)


def test_num_frames_formula():
    assert [frames_for_chunks(n) for n in (1, 2, 3)] == [9, 21, 33]
    assert [chunks_for_frames(f) for f in (9, 21, 33, 81, 85)] == [1, 2, 3, 7, None]
    assert chunks_for_frames(20) is None and chunks_for_frames(5) is None


def test_start_parsing():
    req = start(extra_params={"flow_shift": 5, "camera_action_script": [[["w"], "wa", ""], ["", "", "l"]]})
    assert (req.chunks, req.width, req.height, req.seed, req.flow_shift) == (3, 112, 64, 1, 5.0)
    assert req.action_script == [("w", "wa", ""), ("", "", "l")]
    assert req.image.shape == (64, 112, 3) and req.image.dtype == np.uint8
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


def test_settings_validation(monkeypatch):
    s = ServeSettings.from_args({"sp": 2, "rank_cpus": "0.25"})
    assert s.placement_bundles == [{"CPU": 0.05}, {"CPU": 0.25}, {"CPU": 0.25}, {"CPU": 0.1}]
    assert (s.rank_bundle(0), s.rank_bundle(1), s.muxer_bundle) == (1, 2, 3)
    with pytest.raises(ConfigError, match="sp 3 does not divide the 4 attention heads"):
        ServeSettings.from_args({"sp": 3})
    with pytest.raises(ConfigError, match="unknown serve settings \\['spp'\\]"):
        ServeSettings.from_args({"spp": 2})
    with pytest.raises(ConfigError, match="needs model_path"):
        ServeSettings.from_args({"preset": "lingbot-world-v2-14b", "device": "cuda", "rank_gpus": 1})
    with pytest.raises(ConfigError, match="is not a valid int"):
        ServeSettings.from_args({"sp": "two"})
    monkeypatch.setenv("LINGBOT_SP", "4")                 # the environment overrides the config file
    assert ServeSettings.from_args({"sp": 2}).sp == 4


def _state(sid, chunks=None, fps=16.0, now=0.0, script=()):
    req = start(num_frames=frames_for_chunks(chunks) if chunks else None, fps=fps)
    req.action_script = list(script)
    if chunks is None:
        req.chunks = None
    return SessionState(sid, req, now=now)


def test_edf_and_pacing():
    sched = Scheduler(pacing_lead_s=0.5)
    a, b = _state("a", now=0.0), _state("b", now=0.5)
    sched.add(a), sched.add(b)
    assert sched.pick(now=1.0)[0] is a                    # both due at once: the earlier created first
    a.next_chunk += 1
    a.delivered(9, now=1.0)                               # a's player: 9 frames = 0.5625 s from t=1.0
    assert sched.pick(now=1.1)[0] is b                    # b is due (since 0.5), a not until 1.5625
    b.next_chunk += 1
    b.delivered(9, now=1.2)
    # both ahead; a is due at 1.5625, b at 1.7625: a is next, and may run up to 0.5 s (the lead) early
    assert sched.pick(now=1.2)[0] is a
    a.next_chunk += 1
    a.delivered(12, now=1.3)                              # a now buffered until 2.3125
    who, wait = sched.pick(now=1.3)
    assert who is b                                       # b (1.7625) is earlier: never a while b is behind it
    b.next_chunk += 1
    b.delivered(12, now=1.4)                              # b until 2.5125
    who, wait = sched.pick(now=1.4)
    assert who is None and wait == pytest.approx(2.3125 - 1.4 - 0.5)   # both over 0.5 s ahead: idle


def test_stall_accounting():
    s = _state("a", now=0.0)
    s.delivered(9, now=1.0)              # plays until 1.5625
    s.delivered(12, now=2.0)             # 0.4375 s late
    assert s.stalls == 1 and s.stall_seconds == pytest.approx(0.4375)
    assert s.deadline() == pytest.approx(2.0 + 12 / 16)


def test_event_lifecycle():
    from deployments.protocol import Interaction
    from lingbot.camera import CameraEvent
    s = _state("a", chunks=6, script=[("w", "w", "w")] * 6)
    s.queue(Interaction("k1", keys=["l"] * 5))
    s.queue(Interaction("c1", camera=CameraEvent("target", (0, 0, 1), (0, 0, 0, 1), 2)))
    plan = s.plan_next_chunk()
    assert plan.controls.keys == ("l", "l", "l") and plan.controls.camera.mode == "target"
    assert plan.started == ["k1", "c1"] and plan.active == ["k1", "c1"] and plan.completed == []
    s.commit_plan(plan)
    s.queue(Interaction("p1", prompt="night", transition_chunks=0))
    plan = s.plan_next_chunk()
    assert plan.controls.keys == ("l", "l", "") and plan.controls.prompt == "night"
    assert plan.controls.camera is None                  # the target transition continues in the rig
    assert plan.started == ["p1"] and sorted(plan.completed) == ["c1", "k1", "p1"]
    s.commit_plan(plan)
    s.queue(Interaction("v1", camera=CameraEvent("velocity", (0, 0, 0.05), (0, 0, 0, 1))))
    plan = s.plan_next_chunk()
    assert plan.controls.keys == ("w", "w", "w")         # the start script again
    s.commit_plan(plan)
    plan = s.plan_next_chunk()
    assert plan.active == ["v1"] and plan.completed == []  # velocity holds until replaced
    s.commit_plan(plan)
    s.queue(Interaction("v2", camera=CameraEvent("velocity", (0, 0, 0), (0, 0, 0, 1))))
    plan = s.plan_next_chunk()
    assert plan.completed == ["v1"] and plan.active == ["v2"]
    # a plan that is not committed (the chunk failed) leaves everything as it was
    assert s.next_chunk == 4 and len(s.pending) == 1


def test_control_queue_is_bounded():
    from deployments.protocol import Interaction
    s = _state("a")
    s.max_queued = 2
    assert s.queue(Interaction("1", keys=["w"])) and s.queue(Interaction("2", keys=["w"]))
    assert not s.queue(Interaction("3", keys=["w"]))


def test_out_of_range_values_are_refused():
    with pytest.raises(ProtocolError, match="seed must fit in 64 bits"):
        start(seed=2 ** 64)
    with pytest.raises(ProtocolError, match="field .fps. is out of range"):
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
    from deployments.protocol import authorized
    keys = ServeSettings.from_args({"api_keys": "k1, k2"}).api_key_set
    assert keys == {"k1", "k2"}
    assert authorized({}, {}, frozenset())                                  # no keys configured: open
    assert authorized({"authorization": "Bearer k2"}, {}, keys)
    assert authorized({"x-api-key": "k1"}, {}, keys)
    assert authorized({}, {"api_key": "k1"}, keys)
    assert not authorized({"authorization": "Bearer nope"}, {"api_key": ""}, keys)
    assert not authorized({}, {}, keys)
