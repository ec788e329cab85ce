"""Parsing shared by both wire dialects: required fields, images, key lists, camera trajectories, the start
checks (StartRules). Every failure is a ProtocolError with its code (deployments/session/codes.py).

First frames are decoded here, bounded twice: each in pixels, from its header, before any is decoded
(lingbot/io/images.py: PNG, JPEG or WebP, at most 4x the served size per side), and in number at once per
process, that is per ingress replica, and per client address (DECODES: a start that finds no slot it may take for
DECODE_WAIT_S is refused with images_busy, close 1013 with retry_after_s). The address is the connection's
(`decoding_for`, a context variable its task sets: the worker threads that parse starts inherit it), so one
client sending near-cap images back to back holds one slot at most, and the others stay for everyone else.

Plain Python: no Ray, no Starlette; tests check every refusal without a server."""
from __future__ import annotations

import base64
import binascii
import itertools
import math
import re
import threading
import time
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from lingbot.camera import CameraError, Trajectory, TrajectoryError, parse_keys
from lingbot.config import ChunkGeometry
from lingbot.io.images import load_image
from lingbot.runtime.kv_cache import check_window

from ..session.codes import CLOSE_INVALID_DATA, CLOSE_POLICY, CLOSE_TOO_BIG, CLOSE_TRY_AGAIN, ErrorCode, ProtocolError
from ..session.requests import StartRequest

# Bounds on a decoded message, checked before any field is read (both dialects). Real messages nest at most 6
# containers deep (a key script: message, extra_params, script, chunk, frame, keys) and hold no integer wider
# than 64 bits (20 digits); a message past either bound is hostile or broken, and closes the connection.
MAX_DEPTH = 32
MAX_INT_DIGITS = 40
# Bounds on what a message may make the decoder build, enforced while it decodes (MessagePack: the unpacker's
# limits and hooks) or before (JSON: counted on the text), so that 1 MiB of empty arrays (a million lists, over
# a second of a core that the C decoders spend holding the GIL) is refused after a bounded amount of work. The
# largest real messages are camera trajectories, 6 containers per video frame: 65,536 hold about 10,900 frames
# (11 minutes at 16 fps); real maps hold a few dozen keys.
MAX_CONTAINERS = 2 ** 16            # arrays and maps in one start message
# Any later message (an interaction, a heartbeat, a stop) holds a few dozen: the most is an SGLang camera_actions
# state event of MAX_TRANSITIONS (512) transitions, a map and a list each. 2,048 is far below what max_control_bytes
# of empty arrays would build (43,000 in 128 KiB of JSON, 131,000 in 128 KiB of MessagePack: 40 ms of a core to
# build and walk), so a session at its message rate cannot take the event loop from the others.
MAX_CONTROL_CONTAINERS = 2 ** 11
MAX_MAP_LEN = 256                   # keys in one map
# text a client sends that is kept: a prompt is tokenized whole before the text encoder cuts it at 512 tokens
# (umT5: about 4 characters each in English, 1 in Chinese), and it stays in the session's journal; an event id is
# echoed in every chunk's metadata
MAX_PROMPT_CHARS = 4096
MAX_EVENT_ID_CHARS = 128
INLINE_DECODE_BYTES = 16 * 2 ** 10  # larger messages (starts with their image, large controls) decode in a thread
# First frames decoded at once in this process. One at the pixel cap (6.4 M pixels at 832x480) takes about
# 150 MB (the decoded image, its RGB copy, uint8 and float arrays) and under a second of a core; starts parse in
# worker threads (asyncio.to_thread), so a start beyond these waits for a slot in its thread, at most
# DECODE_WAIT_S.
MAX_DECODES = 2
MAX_DECODES_PER_CLIENT = 1
DECODE_WAIT_S = 1.0
decoding_for: ContextVar[str] = ContextVar("decoding_for", default="")     # the client address (limit_key)


def decode_as(client: str) -> None:
    """The first frames this task (a connection) and its worker threads decode are `client`'s."""
    decoding_for.set(client)


class DecodeSlots:
    """At most `slots` first frames decoded at once, and at most `per_client` of them for one client. Taken in a
    worker thread (a start parses off the event loop), waiting up to a timeout."""

    def __init__(self, slots: int, per_client: int):
        self.slots, self.per_client = slots, per_client
        self.held: dict[str, int] = {}
        self.changed = threading.Condition()

    def acquire(self, client: str, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        with self.changed:
            while sum(self.held.values()) >= self.slots or self.held.get(client, 0) >= self.per_client:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self.changed.wait(left)
            self.held[client] = self.held.get(client, 0) + 1
            return True

    def holds(self, client: str) -> bool:
        """Whether `client` holds its share."""
        with self.changed:
            return self.held.get(client, 0) >= self.per_client

    def release(self, client: str) -> None:
        with self.changed:
            self.held[client] -= 1
            if not self.held[client]:
                del self.held[client]
            self.changed.notify_all()


DECODES = DecodeSlots(MAX_DECODES, MAX_DECODES_PER_CLIENT)


def unknown_fields(msg: dict, known: frozenset, prefix: str = "") -> tuple[str, ...]:
    """The fields of `msg` not in `known`, sorted, as a log line may show them (a client chose them): each cut to
    64 characters and escaped. A map holds at most MAX_MAP_LEN keys."""
    return tuple(prefix + str(k)[:64].encode("unicode_escape").decode("ascii")
                 for k in sorted(msg, key=str) if k not in known)


def too_deep() -> ProtocolError:
    return ProtocolError(ErrorCode.TOO_DEEP, f"the message nests containers more than {MAX_DEPTH} deep",
                         close=CLOSE_INVALID_DATA)


def too_complex(what: str) -> ProtocolError:
    return ProtocolError(ErrorCode.TOO_COMPLEX, f"the message holds {what}", close=CLOSE_INVALID_DATA)


def check_json_text(text: str, containers: int = MAX_CONTAINERS) -> None:
    """Refuse JSON text that could decode to more than `containers` arrays and objects or hold more than
    `containers` keys, counted before it is decoded (an upper bound: brackets and colons in strings count too;
    a real message has a few)."""
    if text.count("[") + text.count("{") > containers:
        if _json_depth(text) > MAX_DEPTH:          # one deep nest is too deep before it is too many
            raise too_deep()
        raise too_complex(f"more than {containers} arrays and objects")
    if text.count(":") > containers:
        raise too_complex(f"more than {containers} keys")


def _json_depth(text: str) -> int:
    """How deep arrays and objects nest in JSON text (its strings left out), without decoding it."""
    brackets = re.sub(r"[^\[\]{}]", "", re.sub(r'"(?:[^"\\]|\\.)*"', "", text))
    steps = [1 if c in "[{" else -1 for c in brackets]
    return max(itertools.accumulate(steps), default=0)


def json_object(pairs: list) -> dict:
    """json.loads' object_pairs_hook: an object of at most MAX_MAP_LEN keys (the last of a repeated key wins, as
    in json.loads' own objects)."""
    if len(pairs) > MAX_MAP_LEN:
        raise too_complex(f"more than {MAX_MAP_LEN} keys in one object")
    return dict(pairs)


def msgpack_limits(containers: int = MAX_CONTAINERS) -> dict:
    """Keyword arguments of msgpack.unpackb for one client message: at most MAX_MAP_LEN keys per map and
    `containers` entries per array (the unpacker refuses such a header before reading on), and at most
    `containers` arrays and maps in all (counted by hooks as the unpacker builds them; past it the decode stops
    with too_complex)."""
    built = 0

    def count(container):
        nonlocal built
        built += 1
        if built > containers:
            raise too_complex(f"more than {containers} arrays and maps")
        return container
    return {"max_array_len": containers, "max_map_len": MAX_MAP_LEN, "list_hook": count, "object_hook": count}


def bounded_int(text: str) -> int:
    """JSON's integer literal -> int, refused past MAX_INT_DIGITS digits (Python's own bound is 4300, and a
    conversion that long already costs quadratic time)."""
    if len(text) - text.startswith("-") > MAX_INT_DIGITS:
        raise ProtocolError(ErrorCode.NUMBER_TOO_LARGE, f"an integer of {len(text)} digits; at most "
                            f"{MAX_INT_DIGITS} are accepted", close=CLOSE_INVALID_DATA)
    return int(text)


def check_depth(value: Any) -> None:
    """Refuse `value` when containers (lists, maps) nest in it more than MAX_DEPTH deep. Iterative: no
    recursion for the message to exhaust."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children = item.values()
        elif isinstance(item, (list, tuple)):
            children = item
        else:
            continue
        if depth > MAX_DEPTH:
            raise too_deep()
        stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list, tuple)))


def check_size(size: int, limit: int) -> None:
    """A client message of `size` bytes, against max_start_bytes or max_control_bytes."""
    if size > limit:
        raise ProtocolError(ErrorCode.MESSAGE_TOO_LARGE, f"message of {size} bytes exceeds the limit of {limit} "
                            "bytes", close=CLOSE_TOO_BIG)


def checked_message(msg: Any, not_a_map: ErrorCode, what: str) -> dict:
    """A decoded client message, either dialect: bounded in depth, a map (`what` in the dialect's words) with a
    string `type`."""
    check_depth(msg)
    if not isinstance(msg, dict):
        raise ProtocolError(not_a_map, f"message must be {what}")
    if not isinstance(msg.get("type"), str):
        raise ProtocolError(ErrorCode.MISSING_FIELD, "message has no string field 'type'")
    return msg


def ascii_int(text: str) -> Optional[int]:
    """A string of ASCII digits -> its value; None for anything else ("²", "①" pass str.isdigit)."""
    return int(text) if text.isascii() and text.isdigit() and len(text) <= MAX_INT_DIGITS else None


def require(obj: dict, key: str, kind, where: str):
    if key not in obj or obj[key] is None:
        raise ProtocolError(ErrorCode.MISSING_FIELD, f"{where} needs field '{key}'")
    value = obj[key]
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        try:
            value = float(value)
        except OverflowError:
            raise ProtocolError(ErrorCode.INVALID_FIELD, f"{where} field '{key}' is out of range") from None
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
        raise ProtocolError(ErrorCode.INVALID_FIELD,
                            f"{where} field '{key}' must be {kind.__name__}, got {type(value).__name__}")
    return value


def first_frame_pixels(data: bytes, width: int, height: int, where: str) -> np.ndarray:
    """Encoded image bytes -> float32 [3, height, width], resized as on every path (lingbot.io.images), one
    of at most MAX_DECODES decodes at once in this process (MAX_DECODES_PER_CLIENT for the client `decoding_for`
    names). Blocks (a worker thread's call) up to DECODE_WAIT_S for a slot. Refusals: invalid_image (not a PNG,
    JPEG or WebP image, or over the pixel cap), images_busy."""
    client = decoding_for.get()
    if not DECODES.acquire(client, DECODE_WAIT_S):
        mine = DECODES.holds(client)
        raise ProtocolError(ErrorCode.IMAGES_BUSY, "this client's first frame is being decoded already; retry once "
                            "it is done" if mine else f"the server is decoding {MAX_DECODES} first frames at once "
                            "already; retry", close=CLOSE_TRY_AGAIN, retry_after_s=1)
    try:
        return load_image(data, width, height)
    except ValueError as e:
        raise ProtocolError(ErrorCode.INVALID_IMAGE, f"{where}: {e}") from None
    finally:
        DECODES.release(client)


def decode_image(url: str, width: int, height: int, fetcher=None) -> np.ndarray:
    """A data: URL (base64) of an image -> float32 [3, height, width] (first_frame_pixels). An http(s) URL
    only with a `fetcher` (deployments.fetch: the operator's allow-list)."""
    if url.startswith(("http://", "https://")) and fetcher is not None:
        return first_frame_pixels(fetcher.fetch(url), width, height, "image_url")
    if not url.startswith("data:"):
        raise ProtocolError(ErrorCode.INVALID_IMAGE,
                            "image_reference.image_url must be a data: URL (http(s) URLs are not "
                            "fetched by this server)")
    header, _, payload = url.partition(",")
    if ";base64" not in header:
        raise ProtocolError(ErrorCode.INVALID_IMAGE, "image data URL must be base64-encoded")
    try:
        raw = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ProtocolError(ErrorCode.INVALID_IMAGE, "image data URL is not valid base64") from None
    return first_frame_pixels(raw, width, height, "image data URL")


def bounded_text(value: str, limit: int, what: str, close: Optional[int] = None, **extra) -> str:
    """`value` when it holds at most `limit` characters; else the refusal text_too_long."""
    if len(value) > limit:
        raise ProtocolError(ErrorCode.TEXT_TOO_LONG, f"{what} holds {len(value)} characters; at most {limit}",
                            close=close, **extra)
    return value


def finite(value) -> float:
    try:
        out = float(value)
    except OverflowError:
        return math.inf
    return out if math.isfinite(out) else math.inf


def parse_keys_list(value: Any, where: str) -> list[str]:
    """["w", "wa", ["w", "d"], ""] -> ["w", "wa", "wd", ""]."""
    if not isinstance(value, list):
        raise ProtocolError(ErrorCode.INVALID_FIELD, f"{where} must be a list of key sets")
    out = []
    for item in value:
        if isinstance(item, list) and all(isinstance(k, str) for k in item):
            item = "".join(item)
        if not isinstance(item, str):
            raise ProtocolError(ErrorCode.INVALID_FIELD, f"{where} entries must be strings or lists of strings")
        try:
            out.append(parse_keys(item))
        except CameraError as e:
            raise ProtocolError(ErrorCode.INVALID_FIELD, f"{where}: {e}") from None
    return out


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
        raise ProtocolError(ErrorCode.INVALID_FIELD, f"{where} must be an object with lists 'poses' [frames][4][4] and "
                            f"'intrinsics' [frames][4]", close=CLOSE_POLICY)
    frames = len(value["poses"])
    if frames > max_frames or len(value["intrinsics"]) > max_frames:
        raise ProtocolError(ErrorCode.TRAJECTORY_TOO_LONG,
                            f"{where} has {max(frames, len(value['intrinsics']))} frames; "
                            f"at most {max_frames} (max_chunks) are taken", close=CLOSE_POLICY)
    numbers = (int, float)
    def numeric(x, depth: int) -> bool:                  # nested lists of JSON numbers only (no bools, strings)
        if depth == 0:
            return isinstance(x, numbers) and not isinstance(x, bool)
        return isinstance(x, list) and all(numeric(v, depth - 1) for v in x)
    if not numeric(value["poses"], 3) or not numeric(value["intrinsics"], 2):
        raise ProtocolError(ErrorCode.TRAJECTORY_SHAPE,
                            f"{where}: poses must be [frames][4][4] and intrinsics [frames][4], "
                            f"all numbers", close=CLOSE_POLICY)
    try:
        return Trajectory.from_video_frames(value["poses"], value["intrinsics"], width, height,
                                            geometry.temporal_stride, max_video_frames=session_frames)
    except TrajectoryError as e:
        raise ProtocolError(e.code, f"{where}: {e}", close=CLOSE_POLICY) from None


@dataclass(frozen=True)
class StartRules:
    """The start checks both dialects share (the served size, fps, seed, decoder), each written once here and
    applied by the dialect's parser before it builds the StartRequest, with what differs between the dialects:
    the seed of a start that names none, where a start names its decoder, and how a refusal of these closes
    (None: the connection stays open for another try)."""
    default_seed: int
    decoder_field: str
    close: Optional[int] = None

    def served_size(self, width: int, height: int, served: tuple[int, int]) -> None:
        if (width, height) != tuple(served):
            raise ProtocolError(ErrorCode.UNSUPPORTED_SIZE, f"this deployment serves {served[0]}x{served[1]}, "
                                f"not {width}x{height}", close=self.close)

    def prompt(self, value: str, what: str) -> str:
        return bounded_text(value, MAX_PROMPT_CHARS, what, close=self.close)

    def fps(self, value: Optional[float], default: float, highest: Optional[float] = None) -> float:
        """The session's fps (`value` a number the dialect read, None: the deployment's `default`), at most
        `highest` (the deployment's max_fps; None: `default`, the rate its capacity is counted at)."""
        fps = default if value is None else float(value)
        highest = min(default if highest is None else highest, 120)
        if not (math.isfinite(fps) and 1 <= fps <= highest):
            raise ProtocolError(ErrorCode.INVALID_FIELD, f"fps must be between 1 and {highest:g}, got {fps:g}",
                                close=self.close)
        return fps

    def paced(self, value: Any, what: str) -> bool:
        """realtime_output_pacing (`what` names where it was read): False delivers each chunk as soon as it is
        made; absent or null: paced."""
        return self.flag(value, what, True)

    def flag(self, value: Any, what: str, default: bool) -> bool:
        """A true-or-false field (`what` names where it was read); absent or null: `default`."""
        if value is None:
            return default
        if not isinstance(value, bool):
            raise ProtocolError(ErrorCode.INVALID_FIELD, f"{what} must be true or false, got {type(value).__name__}",
                                close=self.close)
        return value

    def window(self, sink: Any, frames: Any, where: str, latent_frames: int,
               model: tuple[int, int]) -> Optional[tuple[int, int]]:
        """The session's own K/V window from realtime_causal_sink_size and realtime_causal_kv_cache_num_frames
        (latent frames, read `where`; either absent: the model's), as (sink_chunks, window_chunks); None: the
        model's `model` window. Both must be multiples of a chunk's latent frames, and the window must hold the
        sink, one chunk of history and the current chunk and be no larger than the model's (check_window)."""
        if sink is None and frames is None:
            return None
        chunks = []
        for name, value, default in (("realtime_causal_sink_size", sink, model[0]),
                                     ("realtime_causal_kv_cache_num_frames", frames, model[1])):
            if value is None:
                chunks.append(default)
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 0 or value % latent_frames:
                raise ProtocolError(ErrorCode.INVALID_FIELD, f"{where} field '{name}' must be a multiple of "
                                    f"{latent_frames} latent frames (a chunk's), got {value!r}", close=self.close)
            chunks.append(value // latent_frames)
        try:
            check_window(chunks[0], chunks[1], model[1])
        except ValueError as e:
            raise ProtocolError(ErrorCode.INVALID_FIELD, f"{where}: {e}; served: realtime_causal_sink_size up to "
                                f"{(model[1] - 2) * latent_frames}, realtime_causal_kv_cache_num_frames up to "
                                f"{model[1] * latent_frames} latent frames", close=self.close) from None
        window = (chunks[0], chunks[1])
        return None if window == tuple(model) else window

    def seed(self, value: Optional[int]) -> int:
        """The session's seed (`value` an integer the dialect read, None: the dialect's default)."""
        seed = self.default_seed if value is None else value
        if not -2 ** 63 <= seed < 2 ** 63:
            raise ProtocolError(ErrorCode.INVALID_FIELD, f"seed must fit in 64 bits, got {seed}", close=self.close)
        return seed

    def quality(self, value: Any, what: str, rungs: tuple[str, ...]) -> str:
        """A session's quality (`what` names where it was read): `auto` (absent or null: the quality ladder
        chooses each chunk's rung, or full where it is off), or one of the deployment's `rungs` (full down to
        quality_floor), pinned for the session's life."""
        if value is None:
            return "auto"
        if not isinstance(value, str) or value not in ("auto", *rungs):
            shown = repr(value[:40]) if isinstance(value, str) else type(value).__name__
            raise ProtocolError(ErrorCode.INVALID_FIELD, f"{what} must be one of {['auto', *rungs]}, got {shown}",
                                close=self.close)
        return value

    def decoder(self, value: Any, loaded: tuple[str, ...]) -> Optional[str]:
        """A session's frame decoder by name (None: the deployment's default); one it did not load is refused."""
        if value is None:
            return None
        if not isinstance(value, str):
            raise ProtocolError(ErrorCode.INVALID_FIELD, f"{self.decoder_field} must be a string, one of "
                                f"{list(loaded)}", close=self.close)
        if value not in loaded:
            raise ProtocolError(ErrorCode.DECODER_NOT_LOADED, f"{self.decoder_field} {value[:40]!r} is not loaded "
                                f"here; loaded: {list(loaded)}", close=self.close)
        return value

    def world_start(self, world_id: Any, frame_fields: list[str], chunks: Optional[int], geometry: ChunkGeometry,
                    where: str, **transport) -> StartRequest:
        """A start that resumes a saved world (deployments/session/worlds.py): everything that makes its frames
        comes from the world, so a start that names any of it (`frame_fields` present) is refused; `chunks`
        more chunks (None: endless) and the client's `transport` choices (output, pacing, rung, sharing)."""
        if not isinstance(world_id, str) or not world_id:
            raise ProtocolError(ErrorCode.INVALID_FIELD, f"{where}.world_id must be a saved world's id (a string)",
                                close=self.close)
        if frame_fields:
            raise ProtocolError(ErrorCode.INVALID_FIELD, f"{where} with a world_id takes the world's own prompt, "
                                f"first frame, seed, size and camera; remove {', '.join(frame_fields)}",
                                close=self.close)
        frames = None if chunks is None else chunks * geometry.pixel_frames(1)
        return StartRequest("", np.zeros((3, 0, 0), np.float32), 0, 0, chunks, frames, 0.0, 0, None, [],
                            world_id=world_id[:64], **transport)
