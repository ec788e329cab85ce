"""A message after the start is decoded against far fewer containers than a start (a camera trajectory) may hold:
an interaction, a heartbeat or a stop holds a few dozen; 128 KiB of empty arrays would build tens of thousands,
each taking the event loop that every session and /healthz of the replica share. Both dialects, as their wires
decode them."""
import asyncio
import json

import msgpack
import pytest

from deployments.ingress.parsing import MAX_CONTROL_CONTAINERS
from deployments.ingress.sglang import MAX_SCRIPT_FRAMES, MAX_TRANSITIONS, SglangWire
from deployments.ingress.vllm import VllmWire
from deployments.session.codes import CLOSE_INVALID_DATA, ErrorCode, ProtocolError

LIMIT = 128 * 2 ** 10


def decode(wire, raw, start):
    return asyncio.run(wire.decode(raw, LIMIT, start))


def refused(wire, raw) -> ProtocolError:
    with pytest.raises(ProtocolError) as e:
        decode(wire, raw, start=False)
    return e.value


def test_a_control_of_empty_arrays_is_refused_before_it_is_built_and_a_start_keeps_its_bound():
    junk = {"type": "session.interaction", "pad": [[]] * 20_000}          # 40 KiB of JSON: 20,001 arrays
    vllm = VllmWire(None, None)
    error = refused(vllm, {"text": json.dumps(junk)})
    assert (error.code, error.close) == (ErrorCode.TOO_COMPLEX, CLOSE_INVALID_DATA)
    assert error.message == f"the message holds more than {MAX_CONTROL_CONTAINERS} arrays and objects"
    assert len(decode(vllm, {"text": json.dumps(junk)}, start=True)["pad"]) == 20_000

    sglang = SglangWire(None, None)
    packed = msgpack.packb({"type": "event", "pad": [[[]] * 10] * 2_000})     # 22,002 arrays and maps in 22 KiB
    error = refused(sglang, {"bytes": packed})
    assert (error.code, error.close) == (ErrorCode.TOO_COMPLEX, CLOSE_INVALID_DATA)
    assert error.message == f"the message holds more than {MAX_CONTROL_CONTAINERS} arrays and maps"
    with pytest.raises(ProtocolError, match="more than 2048 arrays and maps"):
        decode(sglang, {"bytes": packed}, start=True)       # nor before the init: its bound is a control's
    long = msgpack.packb({"type": "event", "pad": [[]] * 20_000})               # one array past the bound
    assert refused(sglang, {"bytes": long}).message == (f"the message holds an array or map over its limit "
                                                         f"(20000 exceeds max_array_len({MAX_CONTROL_CONTAINERS}))")


def test_the_largest_real_controls_pass():
    """A held-keys event of MAX_TRANSITIONS transitions (SGLang's largest control: a map and a list each), an init
    with a script of MAX_SCRIPT_FRAMES latent frames (its largest start) and a key script of 512 latent frames (the
    first protocol's) all decode within their bounds."""
    state = {"type": "event", "kind": "camera_actions", "payload": {"mode": "state", "transitions": [
        {"actions": ["w", "j"], "client_ts_ms": i} for i in range(MAX_TRANSITIONS)]}}
    assert len(decode(SglangWire(None, None), {"bytes": msgpack.packb(state)}, start=False)["payload"][
        "transitions"]) == MAX_TRANSITIONS
    init = {"type": "init", "first_frame": b"\x89PNG" + bytes(2000),
            "condition_inputs": {"camera_actions": [["w", "j"]] * MAX_SCRIPT_FRAMES}}
    assert len(decode(SglangWire(None, None), {"bytes": msgpack.packb(init)}, start=True)["condition_inputs"][
        "camera_actions"]) == MAX_SCRIPT_FRAMES
    script = {"type": "session.interaction", "interaction": {"event_id": "e", "event": {"keys": ["wa"] * 512}}}
    assert decode(VllmWire(None, None), {"text": json.dumps(script)}, start=False)["interaction"]["event_id"] == "e"

