"""The realtime video protocol (vLLM-Omni `WS /v1/realtime/video` compatible, docs/architecture.md "The protocol"):
parsing and validation of client messages into typed requests, and the stable error codes.

Plain Python (no Ray): the ingress uses it, and tests check every refusal without a server."""
from __future__ import annotations

import base64
import binascii
import hmac
import json
import math
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from lingbot.camera import CameraError, CameraEvent, Trajectory, TrajectoryError, parse_keys
from lingbot.config import ChunkGeometry
from lingbot.io.frames import FMP4, FrameFormat
from lingbot.io.images import open_image, resize_image

# close codes
CLOSE_NORMAL = 1000
CLOSE_POLICY = 1008
CLOSE_TOO_BIG = 1009
CLOSE_SERVER_ERROR = 1011
CLOSE_TRY_AGAIN = 1013


class ProtocolError(Exception):
    """A refusal: stable `code`, human `message`; `close` is the WebSocket close code, None = keep open."""

    def __init__(self, code: str, message: str, close: Optional[int] = None, **extra):
        super().__init__(message)
        self.code = code
        self.message = message
        self.close = close
        self.extra = extra

    def to_message(self) -> dict:
        return {"type": "error", "code": self.code, "message": self.message, **self.extra}


@dataclass
class StartRequest:
    prompt: str
    image: np.ndarray                     # float32 [3, H, W] at the session size (lingbot.io.images)
    width: int
    height: int
    chunks: Optional[int]                 # None = endless
    num_frames: Optional[int]
    fps: float
    seed: int
    flow_shift: Optional[float]
    action_script: list[tuple[str, ...]]  # keys per chunk (one set per latent frame)
    model: Optional[str] = None
    profile: bool = False                 # stage timings with device synchronisation (extra_params.profile_stages)
    trajectory: Optional[Trajectory] = None   # offline camera path (extra_params.camera_trajectory)
    output: FrameFormat = FMP4                # fmp4 (this protocol) or the second protocol's frame format


@dataclass
class Interaction:
    event_id: str
    prompt: Optional[str] = None
    camera: Optional[CameraEvent] = None
    keys: Optional[list[str]] = None      # one key set per latent frame, from the next chunk on
    hold: Optional[list[str]] = None      # held keys: the key set after each transition (the level holds)
    transition_chunks: Optional[float] = None
    seq: int = 0                          # arrival order at the ingress (mailbox posts may land out of order)


def _reject_constant(name: str):
    raise ProtocolError("invalid_json", f"{name} is not a number JSON allows")


def parse_json(text: str, limit: int) -> dict:
    if len(text.encode()) > limit:
        raise ProtocolError("message_too_large", f"message of {len(text.encode())} bytes exceeds the limit of "
                            f"{limit} bytes", close=CLOSE_TOO_BIG)
    try:
        msg = json.loads(text, parse_constant=_reject_constant)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ProtocolError("invalid_json", f"message is not valid JSON: {e.msg} at position {e.pos}") from None
    if not isinstance(msg, dict):
        raise ProtocolError("invalid_json", "message must be a JSON object")
    if not isinstance(msg.get("type"), str):
        raise ProtocolError("missing_field", "message has no string field 'type'")
    return msg


def _require(obj: dict, key: str, kind, where: str):
    if key not in obj or obj[key] is None:
        raise ProtocolError("missing_field", f"{where} needs field '{key}'")
    value = obj[key]
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        try:
            value = float(value)
        except OverflowError:
            raise ProtocolError("invalid_field", f"{where} field '{key}' is out of range") from None
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
        raise ProtocolError("invalid_field",
                            f"{where} field '{key}' must be {kind.__name__}, got {type(value).__name__}")
    return value


def decode_image(url: str, width: int, height: int, fetcher=None) -> np.ndarray:
    """A data: URL (base64) of an image -> float32 [3, height, width], resized as on every path
    (lingbot.io.images). An http(s) URL only with a `fetcher` (deployments.fetch: the operator's allow-list)."""
    if url.startswith(("http://", "https://")) and fetcher is not None:
        try:
            return resize_image(open_image(fetcher.fetch(url)), width, height)
        except ValueError as e:
            raise ProtocolError("invalid_image", f"image_url: {e}") from None
    if not url.startswith("data:"):
        raise ProtocolError("invalid_image", "image_reference.image_url must be a data: URL (http(s) URLs are not "
                            "fetched by this server)")
    header, _, payload = url.partition(",")
    if ";base64" not in header:
        raise ProtocolError("invalid_image", "image data URL must be base64-encoded")
    try:
        raw = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ProtocolError("invalid_image", "image data URL is not valid base64") from None
    try:
        image = open_image(raw)
    except ValueError as e:
        raise ProtocolError("invalid_image", f"image data URL: {e}") from None
    return resize_image(image, width, height)


def _finite(value) -> float:
    try:
        out = float(value)
    except OverflowError:
        return math.inf
    return out if math.isfinite(out) else math.inf


def parse_keys_list(value: Any, where: str) -> list[str]:
    """["w", "wa", ["w", "d"], ""] -> ["w", "wa", "wd", ""]."""
    if not isinstance(value, list):
        raise ProtocolError("invalid_field", f"{where} must be a list of key sets")
    out = []
    for item in value:
        if isinstance(item, list) and all(isinstance(k, str) for k in item):
            item = "".join(item)
        if not isinstance(item, str):
            raise ProtocolError("invalid_field", f"{where} entries must be strings or lists of strings")
        try:
            out.append(parse_keys(item))
        except CameraError as e:
            raise ProtocolError("invalid_field", f"{where}: {e}") from None
    return out


def parse_start(msg: dict, served_size: tuple[int, int], geometry: ChunkGeometry, default_chunks: int,
                max_chunks: int, default_fps: float, fetcher=None) -> StartRequest:
    where = "session.start"
    prompt = _require(msg, "prompt", str, where)
    width = _require(msg, "width", int, where) if "width" in msg else served_size[0]
    height = _require(msg, "height", int, where) if "height" in msg else served_size[1]
    if width <= 0 or height <= 0 or width % 16 or height % 16:
        raise ProtocolError("invalid_size", f"width and height must be positive multiples of 16, got {width}x{height}",
                            close=CLOSE_POLICY)
    if (width, height) != tuple(served_size):
        raise ProtocolError("unsupported_size", f"this deployment serves {served_size[0]}x{served_size[1]}, "
                            f"not {width}x{height}", close=CLOSE_POLICY)
    ref = _require(msg, "image_reference", dict, where)
    url = _require(ref, "image_url", str, "session.start.image_reference")
    extra = msg.get("extra_params") or {}
    if not isinstance(extra, dict):
        raise ProtocolError("invalid_field", "session.start field 'extra_params' must be an object")
    endless = extra.get("endless") is True
    num_frames = None
    if endless:
        chunks = None
    elif msg.get("num_frames") is None:
        chunks = default_chunks
        num_frames = geometry.video_frames(chunks)
    else:
        num_frames = _require(msg, "num_frames", int, where)
        chunks = geometry.chunks_for(num_frames)
        if chunks is None:
            raise ProtocolError("invalid_num_frames", f"num_frames {num_frames} is not of the form "
                                f"{geometry.describe()}", close=CLOSE_POLICY)
        if chunks > max_chunks:
            raise ProtocolError("invalid_num_frames", f"num_frames {num_frames} is more than {max_chunks} chunks",
                                close=CLOSE_POLICY)
    fps = float(_require(msg, "fps", float, where)) if msg.get("fps") is not None else default_fps
    if not (math.isfinite(fps) and 1 <= fps <= 120):
        raise ProtocolError("invalid_field", f"fps must be between 1 and 120, got {fps}", close=CLOSE_POLICY)
    seed = _require(msg, "seed", int, where) if msg.get("seed") is not None else 0
    if not -2 ** 63 <= seed < 2 ** 63:
        raise ProtocolError("invalid_field", f"seed must fit in 64 bits, got {seed}", close=CLOSE_POLICY)
    shift = extra.get("flow_shift")
    if shift is not None and (not isinstance(shift, (int, float)) or isinstance(shift, bool)
                              or not 0 < _finite(shift) <= 100):
        raise ProtocolError("invalid_field", f"extra_params.flow_shift must be a number in (0, 100], got {shift!r}",
                            close=CLOSE_POLICY)
    script = []
    if extra.get("camera_action_script") is not None:
        chunks_script = extra["camera_action_script"]
        if not isinstance(chunks_script, list):
            raise ProtocolError("invalid_field", f"extra_params.camera_action_script must be "
                                f"[chunk][{geometry.latent_frames}][keys]",
                                close=CLOSE_POLICY)
        for i, chunk in enumerate(chunks_script):
            frames = parse_keys_list(chunk, f"camera_action_script[{i}]")
            if len(frames) != geometry.latent_frames:
                raise ProtocolError("invalid_field", f"camera_action_script[{i}] has {len(frames)} key sets; each "
                                    f"chunk has {geometry.latent_frames} latent frames", close=CLOSE_POLICY)
            script.append(tuple(frames))
    trajectory = None
    if extra.get("camera_trajectory") is not None:
        if script:
            raise ProtocolError("conflicting_camera", "extra_params takes camera_action_script or camera_trajectory, "
                                "not both", close=CLOSE_POLICY)
        trajectory = parse_trajectory(extra["camera_trajectory"], width, height, geometry,
                                      geometry.video_frames(max_chunks), num_frames)
    profile = extra.get("profile_stages", False)
    if not isinstance(profile, bool):
        raise ProtocolError("invalid_field", "extra_params.profile_stages must be true or false", close=CLOSE_POLICY)
    image = decode_image(url, width, height, fetcher)
    return StartRequest(prompt, image, width, height, chunks, num_frames, fps, seed,
                        None if shift is None else float(shift), script, msg.get("model"), profile, trajectory)


def parse_trajectory(value: Any, width: int, height: int, geometry: ChunkGeometry, max_frames: int,
                     session_frames: Optional[int]) -> Trajectory:
    """extra_params.camera_trajectory {poses [F][4][4], intrinsics [F][4]} (per video frame, as the offline
    poses.npy / intrinsics.npy) -> Trajectory, cut to the session's video frames (None: endless) as the
    reference cuts it. F is at most `max_frames` (max_chunks' worth). Each violation has its code:
    invalid_field, trajectory_too_long, trajectory_shape, trajectory_not_finite, trajectory_not_rigid,
    trajectory_intrinsics."""
    where = "extra_params.camera_trajectory"
    if not isinstance(value, dict) or not isinstance(value.get("poses"), list) \
            or not isinstance(value.get("intrinsics"), list):
        raise ProtocolError("invalid_field", f"{where} must be an object with lists 'poses' [frames][4][4] and "
                            f"'intrinsics' [frames][4]", close=CLOSE_POLICY)
    frames = len(value["poses"])
    if frames > max_frames or len(value["intrinsics"]) > max_frames:
        raise ProtocolError("trajectory_too_long", f"{where} has {max(frames, len(value['intrinsics']))} frames; "
                            f"at most {max_frames} (max_chunks) are taken", close=CLOSE_POLICY)
    numbers = (int, float)
    def numeric(x, depth: int) -> bool:                  # nested lists of JSON numbers only (no bools, strings)
        if depth == 0:
            return isinstance(x, numbers) and not isinstance(x, bool)
        return isinstance(x, list) and all(numeric(v, depth - 1) for v in x)
    if not numeric(value["poses"], 3) or not numeric(value["intrinsics"], 2):
        raise ProtocolError("trajectory_shape", f"{where}: poses must be [frames][4][4] and intrinsics [frames][4], "
                            f"all numbers", close=CLOSE_POLICY)
    try:
        return Trajectory.from_video_frames(value["poses"], value["intrinsics"], width, height,
                                            geometry.temporal_stride, max_video_frames=session_frames)
    except TrajectoryError as e:
        raise ProtocolError(e.code, f"{where}: {e}", close=CLOSE_POLICY) from None


def parse_interaction(msg: dict) -> Interaction:
    where = "session.interaction"
    body = _require(msg, "interaction", dict, where)
    event_id = body.get("event_id")
    if event_id is None:
        raise ProtocolError("missing_field", "session.interaction needs interaction.event_id")
    event_id = str(event_id)
    try:
        return _parse_event(body, event_id)
    except ProtocolError as e:
        e.extra.setdefault("event_id", event_id)        # the client can tell which of its events failed
        raise


def _parse_event(body: dict, event_id: str) -> Interaction:
    where = "session.interaction"
    event = _require(body, "event", dict, f"{where}.interaction")
    transition = body.get("transition_chunks")
    if transition is not None and (not isinstance(transition, (int, float)) or isinstance(transition, bool)
                                   or not 0 <= transition <= 1000):
        raise ProtocolError("invalid_field", f"transition_chunks must be a number in [0, 1000], got {transition!r}",
                            event_id=event_id)
    out = Interaction(event_id, transition_chunks=transition)
    if event.get("prompt") is not None:
        if not isinstance(event["prompt"], str):
            raise ProtocolError("invalid_field", "event.prompt must be a string", event_id=event_id)
        out.prompt = event["prompt"]
    camera = (event.get("multi_modal_data") or {}).get("camera") if isinstance(event.get("multi_modal_data"), dict) \
        else None
    if camera is not None:
        try:
            data = camera["data"]
            out.camera = CameraEvent(camera["mode"], tuple(float(v) for v in data["translation"]),
                                     tuple(float(v) for v in data["rotation"]),
                                     1.0 if transition is None else float(transition))
        except (KeyError, TypeError, ValueError, OverflowError) as e:
            detail = str(e) if isinstance(e, CameraError) else f"needs mode and data.translation [x,y,z], " \
                                                                 f"data.rotation [x,y,z,w] ({type(e).__name__}: {e})"
            raise ProtocolError("invalid_field", f"event.multi_modal_data.camera {detail}", event_id=event_id) from None
    if event.get("keys") is not None:
        out.keys = parse_keys_list(event["keys"], "event.keys")
        if len(out.keys) > 300:
            raise ProtocolError("invalid_field", "event.keys holds at most 300 latent frames", event_id=event_id)
    if out.prompt is None and out.camera is None and out.keys is None:
        raise ProtocolError("invalid_field", "event needs prompt, multi_modal_data.camera or keys", event_id=event_id)
    return out


def presented_key(headers: dict, query: dict, keys: frozenset) -> Optional[str]:
    """The configured key the client presents: `Authorization: Bearer KEY` (or `X-API-Key: KEY`) for
    programs, `?api_key=KEY` for pages (browsers cannot set WebSocket headers). None if it presents none of
    them; "" when no keys are configured (everyone is let in)."""
    if not keys:
        return ""
    auth = headers.get("authorization", "")
    presented = {auth[7:].strip() if auth.lower().startswith("bearer ") else "", headers.get("x-api-key", ""),
                 query.get("api_key", "")}
    return next((k for k in sorted(keys) for p in presented if p and hmac.compare_digest(k, p)), None)


def authorized(headers: dict, query: dict, keys: frozenset) -> bool:
    """True when no keys are configured, or the client presents one (see presented_key)."""
    return presented_key(headers, query, keys) is not None


def origin_allowed(headers: dict, allowed: frozenset) -> bool:
    """A WebSocket handshake's Origin: absent (programs send none), the page's own (the same host and port
    as the request), listed in `allowed`, or anything when `allowed` holds "*"."""
    origin = headers.get("origin")
    if origin is None or "*" in allowed or origin.rstrip("/") in allowed:
        return True
    from urllib.parse import urlsplit
    return urlsplit(origin).netloc.lower() == headers.get("host", "").lower()
