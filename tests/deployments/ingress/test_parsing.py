"""First frames on both dialects' real parsers: a decompression bomb refused from its header (the process's
peak memory does not move), formats other than PNG, JPEG and WebP refused, and decodes bounded in number at
once (a start that finds every slot taken is refused with images_busy, close 1013). And messages bounded in
what they make the decoders build: arrays and maps in all, entries per array, keys per map (too_complex)."""
import base64
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from deployments.ingress import parsing
from deployments.ingress.sglang import parse_init
from deployments.ingress.vllm import parse_start
from deployments.session.codes import ProtocolError
from lingbot.config import get_preset
from tests.deployments.ingress.inputs import webp_bomb

ROOT = Path(__file__).resolve().parents[3]
PRESET = get_preset("tiny")
SIZE, GEOMETRY = (PRESET.width, PRESET.height), PRESET.geometry


def encoded(fmt: str, width=40, height=30) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.full((height, width, 3), 77, np.uint8)).save(buf, fmt)
    return buf.getvalue()


def data_url(data: bytes, mime="image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def vllm_start(data: bytes, mime="image/png"):
    msg = {"type": "session.start", "prompt": "p", "image_reference": {"image_url": data_url(data, mime)},
           "width": SIZE[0], "height": SIZE[1], "num_frames": 9}
    return parse_start(msg, SIZE, GEOMETRY, default_chunks=8, max_chunks=100, default_fps=16.0)


def sglang_init(data: bytes):
    return parse_init({"type": "init", "prompt": "p", "first_frame": data}, SIZE, GEOMETRY, 100, 16.0, 4)


# the bomb through both parsers in a fresh process (Pillow imported, as in a running ingress, by a first start),
# which reports its peak resident memory around them
MEASURE = """
import json, resource, sys, time
from deployments.ingress.sglang import parse_init
from deployments.ingress.vllm import parse_start
from deployments.session.codes import ProtocolError
from lingbot.config import get_preset
preset = get_preset("tiny")
size, bomb = (preset.width, preset.height), sys.stdin.buffer.read()
url = "data:image/webp;base64," + __import__("base64").b64encode(bomb).decode()
calls = [lambda: parse_start({"type": "session.start", "prompt": "p", "image_reference": {"image_url": url}}, size,
                             preset.geometry, default_chunks=8, max_chunks=100, default_fps=16.0),
         lambda: parse_init({"type": "init", "prompt": "p", "first_frame": bomb}, size, preset.geometry, 100, 16.0, 4)]
png = __import__("io").BytesIO()
__import__("PIL.Image").Image.new("RGB", size).save(png, "PNG")
parse_init({"type": "init", "prompt": "p", "first_frame": png.getvalue()}, size, preset.geometry, 100, 16.0, 4)
out = []
for call in calls:
    peak, t0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, time.monotonic()
    try:
        call()
        out.append({"code": None})
    except ProtocolError as e:
        out.append({"code": e.code.value, "message": e.message, "seconds": time.monotonic() - t0,
                    "peak_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak})
print(json.dumps(out))
"""


def test_a_decompression_bomb_is_refused_from_its_header_without_decoding():
    bomb = webp_bomb()
    assert len(bomb) < 4096 and Image.open(io.BytesIO(bomb)).size == (6300, 6300)
    done = subprocess.run([sys.executable, "-c", MEASURE], input=bomb, capture_output=True, cwd=ROOT, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    vllm, sglang = json.loads(done.stdout)
    assert vllm["code"] == sglang["code"] == "invalid_image"
    assert vllm["message"] == f"image data URL: image data: image 6300x6300 has more than {1920 * 1080} pixels; " \
                              "send a smaller one"
    assert sglang["message"] == vllm["message"].replace("image data URL", "first_frame")
    for result in (vllm, sglang):
        assert result["seconds"] < 1.0, result                   # the bound; a header read takes ms
        assert result["peak_kib"] < 32 * 1024, result            # decoding it would take 160 MB at least


@pytest.mark.parametrize("fmt", ["GIF", "BMP", "TIFF", "ICO", "PPM"])
def test_only_png_jpeg_and_webp_are_decoded(fmt):
    data = encoded(fmt)
    for parse, where in ((vllm_start, "image data URL"), (sglang_init, "first_frame")):
        with pytest.raises(ProtocolError) as info:
            parse(data)
        assert info.value.code == "invalid_image"
        assert info.value.message == f"{where}: image data is not a readable PNG, JPEG or WebP image " \
                                     "(UnidentifiedImageError)"
    for fmt in ("PNG", "JPEG", "WEBP"):
        assert vllm_start(encoded(fmt)).image.shape == (3, SIZE[1], SIZE[0])
        assert sglang_init(encoded(fmt)).image.shape == (3, SIZE[1], SIZE[0])


def test_decodes_at_once_are_bounded_and_a_start_beyond_them_is_refused():
    taken = [parsing.DECODES.acquire(f"client-{i}", timeout=5) for i in range(parsing.MAX_DECODES)]  # every slot
    try:
        assert taken == [True] * parsing.MAX_DECODES
        for parse in (vllm_start, sglang_init):
            with pytest.raises(ProtocolError) as info:
                parse(encoded("PNG"))
            error = info.value
            assert (error.code, error.close, error.extra) == ("images_busy", 1013, {"retry_after_s": 1})
            assert error.message == "the server is decoding 2 first frames at once already; retry"
    finally:
        for i in range(parsing.MAX_DECODES):
            parsing.DECODES.release(f"client-{i}")
    assert vllm_start(encoded("PNG")).image.shape == (3, SIZE[1], SIZE[0])     # a slot free again: decoded


def test_one_client_decodes_one_first_frame_at_a_time_and_the_other_slot_stays_for_the_others():
    """A client (its connection's address in `decoding_for`) that holds a decode slot waits for it with its next
    start and is refused images_busy after DECODE_WAIT_S, while another client's start decodes at once."""
    import contextvars

    def as_client(address: str, parse):
        def parsed():
            parsing.decoding_for.set(address)
            return parse(encoded("PNG"))
        return contextvars.copy_context().run(parsed)

    assert parsing.DECODES.acquire("198.51.100.7", timeout=5)          # its first start decoding
    try:
        for parse in (vllm_start, sglang_init):
            with pytest.raises(ProtocolError) as info:
                as_client("198.51.100.7", parse)
            assert (info.value.code, info.value.extra) == ("images_busy", {"retry_after_s": 1})
            assert info.value.message == "this client's first frame is being decoded already; retry once it is done"
            assert as_client("198.51.100.8", parse).image.shape == (3, SIZE[1], SIZE[0])
    finally:
        parsing.DECODES.release("198.51.100.7")
    assert as_client("198.51.100.7", vllm_start).image.shape == (3, SIZE[1], SIZE[0])
    assert parsing.DECODES.held == {}


def test_messages_past_the_container_bounds_are_refused_while_they_decode():
    import msgpack

    from deployments.ingress.sglang import unpack
    from deployments.ingress.vllm import parse_json
    limit = 4 * 2 ** 20
    flat = b"\xdd" + (2 ** 20).to_bytes(4, "big") + b"\x90" * 2 ** 20        # 1 MiB of empty arrays, in one
    nested = msgpack.packb({"type": "init", "x": [[[] for _ in range(1000)] for _ in range(100)]})   # 100,100
    wide = msgpack.packb({"type": "init", **{f"k{i}": i for i in range(parsing.MAX_MAP_LEN)}})      # 257 keys
    cases = [(unpack, flat, "an array or map over its limit (1048576 exceeds max_array_len(65536))"),
             (unpack, nested, "more than 65536 arrays and maps"),
             (unpack, wide, "an array or map over its limit (257 exceeds max_map_len(256))"),
             (parse_json, "[" + ",".join(["[]"] * 70_000) + "]", "more than 65536 arrays and objects"),
             (parse_json, json.dumps({"type": "x", "p": ":" * 70_000}), "more than 65536 keys"),
             (parse_json, json.dumps({"type": "x", **{f"k{i}": i for i in range(parsing.MAX_MAP_LEN)}}),
              "more than 256 keys in one object")]
    for parse, data, what in cases:
        with pytest.raises(ProtocolError) as info:
            parse(data, limit)
        assert (info.value.code, info.value.close, info.value.message) == ("too_complex", 1007,
                                                                           f"the message holds {what}")
    # the largest real messages stay well inside: a camera trajectory of 2,000 frames, a 256-key map
    frames = 2000
    trajectory = {"poses": [np.eye(4).tolist()] * frames, "intrinsics": [[500.0, 500.0, 56.0, 32.0]] * frames}
    msg = parse_json(json.dumps({"type": "session.start", "extra_params": {"camera_trajectory": trajectory}}), limit)
    assert len(msg["extra_params"]["camera_trajectory"]["poses"]) == frames
    keys = {f"k{i}": i for i in range(parsing.MAX_MAP_LEN - 1)}
    assert unpack(msgpack.packb({"type": "init", **keys}), limit)["k254"] == 254
    assert parse_json(json.dumps({"type": "x", **keys}), limit)["k254"] == 254


def test_json_text_nested_too_deep_is_too_deep_before_it_is_too_many():
    """Counted before decoding: one deep nest of brackets is too_deep, many shallow ones too_complex; brackets
    inside strings do not nest."""
    from deployments.ingress.parsing import MAX_CONTAINERS, check_json_text
    from deployments.session.codes import ErrorCode, ProtocolError
    with pytest.raises(ProtocolError) as deep:
        check_json_text("[" * (MAX_CONTAINERS + 1) + "]" * (MAX_CONTAINERS + 1))
    assert deep.value.code == ErrorCode.TOO_DEEP
    with pytest.raises(ProtocolError) as many:
        check_json_text("[" + "[]," * MAX_CONTAINERS + "[]]")
    assert many.value.code == ErrorCode.TOO_COMPLEX
    with pytest.raises(ProtocolError) as strings:
        check_json_text('["' + "[" * 40 + '"' + ",[]" * MAX_CONTAINERS + "]")
    assert strings.value.code == ErrorCode.TOO_COMPLEX
