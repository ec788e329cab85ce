"""A client of both realtime video protocols: `python -m deployments.client ws://host:8000/v1/realtime/video
--image first.png --prompt "..." --keys "w,w,wa,,j" --chunks 4 -o out.mp4`.

vllm (/v1/realtime/video): sends session.start (the image as a data: URL) with the keys as its action
script, and writes the fMP4 stream to a file as it arrives. sglang (/v1/realtime_video/generate): sends
an init (MessagePack, the image bytes, the keys as condition_inputs.camera_actions), restores the raw,
delta-gzip, WebP or JPEG frames, and writes them as MP4 (encoded here) or .npy. Both show a progress bar.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from pathlib import Path
from typing import Any

from lingbot.camera import parse_key_script
from lingbot.config import LINGBOT_GEOMETRY

from .connection import image_data_url
from .frames import FramesClient
from .realtime import RealtimeClient


def protocol_of(url: str, protocol: str) -> str:
    if protocol != "auto":
        return protocol
    return "sglang" if "/realtime_video/" in url else "vllm"


def served_config(url: str) -> dict:
    """GET /v1/config of the server at WebSocket `url` (its size, fps, decoders)."""
    import urllib.request
    http = url.replace("ws://", "http://").replace("wss://", "https://").split("/v1/")[0]
    with urllib.request.urlopen(f"{http}/v1/config", timeout=10) as r:
        return json.loads(r.read())


async def _main_frames(args, script: list) -> int:
    """--protocol sglang: frames restored on this side, written as H.264 MP4 (or .npy for the exact uint8)."""
    import numpy as np
    from tqdm import tqdm

    from lingbot.io.video import H264Writer
    actions = [list(k) for chunk in script for k in chunk]
    while actions and not actions[-1]:
        actions.pop()
    async with FramesClient(args.url, api_key=args.api_key) as client:
        await client.init(args.prompt, Path(args.image).read_bytes(), args.chunks, args.seed, args.fps,
                          actions=actions, output_format=args.format, delta=args.delta)
        bar = tqdm(total=args.chunks, unit="chunk", desc="receiving", file=sys.stderr)
        state: dict[str, Any] = {}

        fps = args.fps or served_config(args.url)["fps"]       # the session's: what the MP4 plays at

        def on_chunk(result, chunk):
            if not args.output.endswith(".npy"):
                if "writer" not in state:
                    h, w = chunk.frames.shape[1:3]
                    state["writer"] = H264Writer(args.output, w, h, fps)
                state["writer"].write(chunk.frames)
            bar.update()
            if len(result.arrivals) == 1:
                bar.set_postfix(ttfc=f"{result.arrivals[0] - result.started_at:.2f}s")
        result = await client.receive_session(on_chunk)
        bar.close()
    if "writer" in state:
        state["writer"].close()
    if result.errors:
        error = result.errors[-1]
        print(f"server error {error.get('code')}: {error.get('content')}", file=sys.stderr)
        return 1
    if result.close_code != 1000:
        print(f"server closed the session: {result.close_code} {result.close_reason}", file=sys.stderr)
        return 1
    if args.output.endswith(".npy") and result.chunks:
        np.save(args.output, result.frames)
    frames = sum(len(c.frames) for c in result.chunks)
    print(f"wrote {len(result.chunks)} chunks, {frames} frames ({args.format}) to {args.output}")
    return 0


async def _main(args) -> int:
    from PIL import Image
    from tqdm import tqdm
    Image.open(args.image).verify()
    script = parse_key_script(args.keys, args.chunks, LINGBOT_GEOMETRY.latent_frames)
    if protocol_of(args.url, args.protocol) == "sglang":
        if args.poses or args.intrinsics:
            raise ValueError("--poses/--intrinsics travel over the vllm protocol only (/v1/realtime/video)")
        return await _main_frames(args, script)
    async with RealtimeClient(args.url, api_key=args.api_key) as client:
        width, height = args.width, args.height
        if width is None or height is None:
            served = served_config(args.url)
            width, height = served["width"], served["height"]
        script = [list(keys) for keys in script]
        extra = {}
        if args.poses or args.intrinsics:
            if not (args.poses and args.intrinsics):
                raise ValueError("--poses and --intrinsics go together")
            if args.keys:
                raise ValueError("--keys and --poses both drive the camera; give one")
            import numpy as np
            extra["camera_trajectory"] = {"poses": np.load(args.poses, allow_pickle=False).tolist(),
                                          "intrinsics": np.load(args.intrinsics, allow_pickle=False).tolist()}
            script = None
        await client.start(args.prompt, image_data_url(args.image), width, height, args.chunks, args.fps, args.seed,
                           script=script, **extra)
        out = open(args.output, "wb")
        bar = tqdm(total=args.chunks, unit="chunk", desc="receiving", file=sys.stderr)

        def on_chunk(result, meta):
            out.write(result.data[-1])
            out.flush()
            bar.update()
            if len(result.arrivals) == 1:
                bar.set_postfix(ttfc=f"{result.arrivals[0] - result.started_at:.2f}s")
        result = await client.receive_session(on_chunk)
        bar.close()
        out.close()
    if result.error is not None:
        print(f"server error {result.error.get('code')}: {result.error.get('message')}", file=sys.stderr)
        return 1
    frames = sum(c["num_frames"] for c in result.chunks)
    print(f"wrote {len(result.chunks)} chunks, {frames} frames, {len(result.video)} bytes to {args.output}")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m deployments.client", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("url", help="ws://host:8000/v1/realtime/video (or /v1/realtime_video/generate)")
    p.add_argument("--protocol", default="auto", choices=("auto", "vllm", "sglang"),
                   help="vllm: JSON + fMP4 (/v1/realtime/video); sglang: MessagePack + frames "
                        "(/v1/realtime_video/generate); auto: from the URL's path")
    p.add_argument("--format", default="raw", choices=("raw", "webp", "jpeg"),
                   help="sglang: how frames travel (raw is the model's exact uint8 output)")
    p.add_argument("--delta", action="store_true", help="sglang, raw: XOR with the previous frame, gzipped")
    p.add_argument("--image", required=True)
    p.add_argument("--prompt", required=True)
    p.add_argument("--keys", default="", help='one key set per latent frame, e.g. "w,w,wa,,j"')
    p.add_argument("--poses", default=None, help="offline camera path: .npy [F, 4, 4] camera-to-world per video "
                                                 "frame (sent as extra_params.camera_trajectory)")
    p.add_argument("--intrinsics", default=None, help="with --poses: .npy [F, 4] fx, fy, cx, cy at 832x480")
    p.add_argument("--chunks", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--fps", type=float, default=None, help="default: the server's (GET /v1/config)")
    p.add_argument("--width", type=int, default=None, help="default: the server's size (GET /v1/config)")
    p.add_argument("--height", type=int, default=None)
    p.add_argument("--api-key", default=os.environ.get("LINGBOT_API_KEY"),
                   help="sent as 'Authorization: Bearer KEY' (default: $LINGBOT_API_KEY)")
    p.add_argument("-o", "--output", required=True,
                   help="output .mp4 (vllm: the fMP4 stream as sent; sglang: the frames encoded here), or .npy "
                        "(sglang: the uint8 frames)")
    args = p.parse_args(argv)
    if args.chunks < 1:
        p.error("--chunks must be >= 1")
    try:
        return asyncio.run(_main(args))
    except (OSError, ValueError) as e:
        print(f"deployments.client: error: {e}", file=sys.stderr)
        return 2
