"""Client input for the ingress's parsers, built as the parser tests and the served tests need it: the tiny
preset's chunk geometry, a first-protocol session.start parsed, small images (a data: URL, PNG bytes), generated
malformed MessagePack messages, and a decompression bomb."""
import base64
import functools
import io
import random

import msgpack
import numpy as np
from PIL import Image

from deployments.ingress.vllm import parse_start
from lingbot.config import get_preset

GEOMETRY = get_preset("tiny").geometry
frames_for_chunks = GEOMETRY.video_frames


def data_url(w=30, h=20):
    """A grey PNG as a data: URL (the first protocol's image_url)."""
    buf = io.BytesIO()
    Image.fromarray(np.full((h, w, 3), 128, np.uint8)).save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def start(**kw):
    """A session.start of 3 chunks at 112x64, with `kw`, parsed by the first protocol (8 chunks by default, at
    most 100, 16 fps)."""
    msg = {"type": "session.start", "prompt": "p", "image_reference": {"image_url": data_url()}, "width": 112,
           "height": 64, "num_frames": 33, "seed": 1}
    msg.update(kw)
    return parse_start(msg, (112, 64), GEOMETRY, default_chunks=8, max_chunks=100, default_fps=16.0)


def png_bytes(w=30, h=20):
    """A grey PNG's bytes (the second protocol's first_frame)."""
    buf = io.BytesIO()
    Image.fromarray(np.full((h, w, 3), 99, np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def mutations(rng: random.Random):
    """Malformed client messages: random bytes, cut and flipped valid ones, wrong types in every field."""
    good_init = {"type": "init", "prompt": "p", "first_frame": png_bytes(), "size": "112x64", "max_chunks": 2,
                 "condition_inputs": {"camera_actions": [["w"]]}, "realtime_output_format": "raw"}
    good_events = [{"type": "event", "kind": "prompt", "payload": "x", "event_id": 1},
                   {"type": "event", "kind": "camera_actions", "payload": {"mode": "state",
                                                                          "transitions": [{"actions": ["w"]}]}},
                   {"type": "event", "kind": "composite_input",
                    "payload": {"input_types": ["prompt"], "prompt": "y"}}]
    odd = [None, True, -1, 2 ** 64 - 1, 1.5, float("nan"), float("inf"), "", "w" * 300, b"\x00\xff", [], [[]],
           {}, {"mode": "state"}, [["w"] * 40], msgpack.ExtType(5, b"x")]
    for _ in range(120):
        yield bytes(rng.getrandbits(8) for _ in range(rng.randint(0, 64)))
    for base in [good_init] + good_events:
        packed = msgpack.packb(base, use_bin_type=True)
        for _ in range(25):
            cut = bytearray(packed[:rng.randint(0, len(packed))])
            if cut and rng.random() < 0.5:
                cut[rng.randrange(len(cut))] ^= 1 << rng.randrange(8)
            yield bytes(cut)
        for key in list(base) + ["payload", "event_id", "kind"]:
            for value in rng.sample(odd, 4):
                yield msgpack.packb({**base, key: value}, use_bin_type=True)


@functools.cache
def webp_bomb() -> bytes:
    """One colour, lossless, 6300x6300: 40 M pixels (160 MB decoded, 480 MB as float) in a few dozen bytes."""
    buf = io.BytesIO()
    Image.new("RGB", (6300, 6300), (10, 200, 30)).save(buf, "WEBP", lossless=True, method=0, quality=0)
    return buf.getvalue()
