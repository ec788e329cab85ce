"""The second realtime protocol: SGLang's `WS /v1/realtime_video/generate` (docs/architecture.md "The second
protocol"). Every message is a MessagePack map in a binary WebSocket frame; frames come back raw (RGB24),
as XOR deltas under gzip, or as WebP/JPEG images, in batches.

Its parser (plain functions: `init` and `event` maps into the same typed requests as the first protocol,
session.requests.StartRequest / Interaction; tests check every refusal without a server), the server's
messages, and its connection (the wire of a session's life).
"""
from __future__ import annotations

import asyncio
import math
import time
from typing import Any, Optional

import msgpack

from lingbot.config import ChunkGeometry
from lingbot.io.frames import DEFAULT_COMPRESSION, FrameBatch, FrameFormat

from ..session.codes import CLOSE_NORMAL, ErrorCode, ProtocolError
from ..session.events import Admitted, ChunkReady, ModelFacts, Resumed
from ..session.ports import ACTIVITY, SAVE, SHARE, UNSHARE
from ..session.requests import Interaction, StartRequest
from .closing import close_quietly, error_message, pack
from .parsing import (
    MAX_CONTAINERS,
    MAX_CONTROL_CONTAINERS,
    MAX_PROMPT_CHARS,
    StartRules,
    ascii_int,
    bounded_text,
    check_size,
    checked_message,
    decode_image,
    first_frame_pixels,
    msgpack_limits,
    parse_keys_list,
    too_complex,
    too_deep,
    unknown_fields,
)
from .viewing import SglangViewing
from .wire import WebSocketWire

SPLIT_BYTES = 64 * 2 ** 10          # a payload this big or bigger follows its header as a binary frame of its own
MAX_SCRIPT_FRAMES = 512             # latent frames in one camera_actions script
MAX_TRANSITIONS = 512               # transitions in one camera_actions state event
FORMATS = ("raw", "webp", "jpeg")
# the checks both dialects share: an init that names no seed gets 42 here (SGLang's); a refused init leaves the
# connection open for another
START = StartRules(default_seed=42, decoder_field="init.decoder")


def unpack(data: bytes, limit: int, containers: int = MAX_CONTAINERS) -> dict:
    """One client message -> a map with a string `type`; ProtocolError for anything else (past `limit` bytes, or
    past `containers` arrays and maps: the decode stops there)."""
    check_size(len(data), limit)
    try:
        msg = msgpack.unpackb(data, raw=False, **msgpack_limits(containers))
    except ProtocolError:                        # too_complex, from the limits' hooks
        raise
    except msgpack.StackError:                   # nested deeper than the decoder's stack: far past MAX_DEPTH
        raise too_deep() from None
    except ValueError as e:
        # msgpack's text for a header over the limits: "N exceeds max_array_len(L)" (or max_map_len); a header
        # that claims more entries than the message has bytes is a mangled one, refused like any other
        claimed = str(e).split(" exceeds max_")[0]
        if claimed.isdigit() and int(claimed) <= len(data):
            raise too_complex(f"an array or map over its limit ({e})") from None
        raise ProtocolError(ErrorCode.INVALID_MSGPACK,
                            f"message is not one valid MessagePack value ({type(e).__name__})") from None
    except Exception as e:                       # truncated, extra bytes, bad UTF-8, unhashable keys...
        raise ProtocolError(ErrorCode.INVALID_MSGPACK,
                            f"message is not one valid MessagePack value ({type(e).__name__})") from None
    return checked_message(msg, ErrorCode.INVALID_MSGPACK, "a MessagePack map")


# ---- init -----------------------------------------------------------------------------------------
def _opt(msg: dict, key: str, kinds, what: str):
    value = msg.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, kinds):
        raise ProtocolError(ErrorCode.INVALID_FIELD, f"init field '{key}' must be {what}, got {type(value).__name__}")
    return value


def parse_size(value: Any) -> tuple[int, int]:
    """'832x480' (any case, spaces allowed) -> (832, 480)."""
    parts = str(value).lower().replace(" ", "").split("x") if isinstance(value, str) else []
    numbers = [ascii_int(p) for p in parts]
    if len(numbers) != 2 or not all(n is not None and 0 < n <= 16384 for n in numbers):
        raise ProtocolError(ErrorCode.INVALID_SIZE,
                            f"size must be 'WIDTHxHEIGHT' with positive integers, got {value!r}")
    return numbers[0], numbers[1]


def first_frame(value: Any, width: int, height: int, fetcher=None):
    """Image bytes or a data: URL -> float32 [3, H, W] at the served size (http(s) URLs only from the
    operator's allow-list: `fetcher`, deployments.fetch)."""
    if value is None:
        raise ProtocolError(ErrorCode.MISSING_FIELD,
                            "init needs first_frame (image bytes or a data:image/...;base64 URL)")
    if isinstance(value, (bytes, bytearray)):
        return first_frame_pixels(bytes(value), width, height, "first_frame")
    if isinstance(value, str):
        if value.startswith(("http://", "https://")) and fetcher is None:
            raise ProtocolError(ErrorCode.INVALID_IMAGE,
                                "first_frame URLs are not fetched by this server; send the image "
                                "bytes or a data: URL")
        return decode_image(value, width, height, fetcher)
    raise ProtocolError(ErrorCode.INVALID_FIELD, f"first_frame must be bytes or a string, got {type(value).__name__}")


def script_chunks(frames: list[str], latent_frames: int) -> list[tuple[str, ...]]:
    """Key sets per latent frame -> per chunk, the last chunk padded with no keys."""
    frames = frames + [""] * (-len(frames) % latent_frames)
    return [tuple(frames[i:i + latent_frames]) for i in range(0, len(frames), latent_frames)]


def parse_actions_script(value: Any, where: str) -> list[str]:
    """[["w"], ["w", "j"], []] (one action list per latent frame) -> ["w", "wj", ""]."""
    if not isinstance(value, list) or not all(isinstance(v, list) for v in value):
        raise ProtocolError(ErrorCode.INVALID_FIELD, f"{where} must be a list of action lists, one per latent frame")
    if len(value) > MAX_SCRIPT_FRAMES:
        raise ProtocolError(ErrorCode.INVALID_FIELD,
                            f"{where} holds {len(value)} latent frames; at most {MAX_SCRIPT_FRAMES}")
    return parse_keys_list(value, where)


# the init fields read here (honoured, or refused with a code when wrong); ACCEPTED_AND_IGNORED: SGLang's fields
# that mean nothing here, with the reason (README); any other field is ignored, counted and logged
INIT_FIELDS = frozenset({"type", "model", "prompt", "first_frame", "size", "fps", "num_frames", "seconds", "seed",
                         "num_inference_steps", "guidance_scale", "max_chunks", "condition_inputs",
                         "realtime_output_format", "output_compression", "realtime_preview_max_width",
                         "delta_reference", "decoder", "realtime_output_pacing", "realtime_causal_sink_size",
                         "realtime_causal_kv_cache_num_frames", "quality", "spectators", "record"})
ACCEPTED_AND_IGNORED: dict[str, str] = {}
# what an init that resumes a saved world takes from the world (naming any is refused)
WORLD_FRAME_FIELDS = frozenset({"prompt", "first_frame", "size", "fps", "seed", "condition_inputs", "decoder",
                                "realtime_causal_sink_size", "realtime_causal_kv_cache_num_frames", "record"})


def parse_init(msg: dict, served_size: tuple[int, int], geometry: ChunkGeometry, max_chunks: int,
               default_fps: float, steps: int, fetcher=None, decoders: tuple[str, ...] = (),
               max_fps: Optional[float] = None, model_window: Optional[tuple[int, int]] = None,
               rungs: tuple[str, ...] = ("full",)) -> StartRequest:
    """An `init` map -> StartRequest; `decoders`: the frame decoders loaded (`decoder` picks one); `max_fps`: the
    highest fps a session may ask for (None: default_fps); `model_window`: the model's (sink, window) chunks (a
    session may ask for a smaller one); `rungs`: those a session may pin (`quality`). Bad input raises
    ProtocolError (the connection then waits for another)."""
    if msg["type"] != "init":
        raise ProtocolError(ErrorCode.NOT_STARTED, f"the first message must be an init, not {msg['type']!r}")
    if "world_id" in msg:                                  # a saved world goes on: max_chunks more chunks
        chunks = _opt(msg, "max_chunks", int, "an integer")
        if chunks is not None and not 1 <= chunks <= max_chunks:
            raise ProtocolError(ErrorCode.INVALID_FIELD, f"max_chunks must be between 1 and {max_chunks}")
        return START.world_start(msg["world_id"], sorted(WORLD_FRAME_FIELDS & set(msg)), chunks, geometry, "init",
                                 model=msg.get("model"), output=parse_output(msg),
                                 paced=START.paced(msg.get("realtime_output_pacing"), "init field "
                                                   "'realtime_output_pacing'"),
                                 quality=START.quality(msg.get("quality"), "init field 'quality'", rungs),
                                 spectators=START.flag(msg.get("spectators"), "init field 'spectators'", False),
                                 unknown_fields=unknown_fields(msg, INIT_FIELDS | {"world_id"}))
    decoder = START.decoder(msg.get("decoder"), decoders)
    prompt = msg.get("prompt")
    if not isinstance(prompt, str) or not prompt.strip():
        raise ProtocolError(ErrorCode.MISSING_FIELD, "init needs a non-empty string 'prompt'")
    START.prompt(prompt, "init.prompt")
    _opt(msg, "model", str, "a string")
    width, height = parse_size(msg["size"]) if msg.get("size") is not None else served_size
    START.served_size(width, height, served_size)
    fps = START.fps(_opt(msg, "fps", (int, float), "a number"), default_fps, max_fps)
    for key in ("num_frames", "seconds"):                  # they size nothing here: a session runs by chunks
        value = _opt(msg, key, (int, float), "a positive number")
        if value is not None and not value > 0:
            raise ProtocolError(ErrorCode.INVALID_FIELD, f"init field '{key}' must be positive, got {value}")
    seed = START.seed(_opt(msg, "seed", int, "an integer"))
    n_steps = _opt(msg, "num_inference_steps", int, "an integer")
    if n_steps is not None and n_steps != steps:
        raise ProtocolError(ErrorCode.INVALID_FIELD, f"this model samples {steps} steps per chunk, not {n_steps}")
    guidance = _opt(msg, "guidance_scale", (int, float), "a number")
    if guidance is not None and not (math.isfinite(guidance) and guidance <= 1.0):   # clients send 1.0 or 0.0
        raise ProtocolError(ErrorCode.INVALID_FIELD, "this distilled model samples without classifier-free "
                            f"guidance: guidance_scale must be at most 1.0 (none), got {guidance:g}")
    chunks = _opt(msg, "max_chunks", int, "an integer")
    if chunks is not None and not 1 <= chunks <= max_chunks:
        raise ProtocolError(ErrorCode.INVALID_FIELD, f"max_chunks must be between 1 and {max_chunks}, got {chunks}")
    script: list[tuple[str, ...]] = []
    conditions = _opt(msg, "condition_inputs", dict, "a map")
    if conditions and conditions.get("camera_actions") is not None:
        script = script_chunks(parse_actions_script(conditions["camera_actions"], "condition_inputs.camera_actions"),
                               geometry.latent_frames)
    paced = START.paced(msg.get("realtime_output_pacing"), "init field 'realtime_output_pacing'")
    window = None if model_window is None else START.window(
        msg.get("realtime_causal_sink_size"), msg.get("realtime_causal_kv_cache_num_frames"), "init",
        geometry.latent_frames, model_window)
    quality = START.quality(msg.get("quality"), "init field 'quality'", rungs)
    spectators = START.flag(msg.get("spectators"), "init field 'spectators'", False)
    output = parse_output(msg)
    if START.flag(msg.get("record"), "init field 'record'", False):
        raise ProtocolError(ErrorCode.INVALID_FIELD, "init field 'record': recordings keep the H.264 stream of "
                            "/v1/realtime/video; this protocol's frames are not recorded")
    image = first_frame(msg.get("first_frame"), width, height, fetcher)
    return StartRequest(prompt, image, width, height, chunks, None if chunks is None else geometry.video_frames(chunks),
                        fps, seed, None, script, msg.get("model"), output=output, decoder=decoder, paced=paced,
                        window=window, quality=quality, spectators=spectators,
                        unknown_fields=unknown_fields(msg, INIT_FIELDS | frozenset(ACCEPTED_AND_IGNORED)))


def parse_output(msg: dict) -> FrameFormat:
    kind = msg.get("realtime_output_format")
    kind = "raw" if kind is None else kind
    if kind not in FORMATS:
        raise ProtocolError(ErrorCode.INVALID_FIELD, f"realtime_output_format must be one of {', '.join(FORMATS)}, "
                            f"got {kind!r}")
    compression = _opt(msg, "output_compression", int, "an integer")
    if compression is not None and not 0 <= compression <= 100:
        raise ProtocolError(ErrorCode.INVALID_FIELD, f"output_compression must be between 1 and 100 (0: the "
                            f"format's default), got {compression}")
    max_width = _opt(msg, "realtime_preview_max_width", int, "an integer")
    if max_width is not None and max_width < 0:
        raise ProtocolError(ErrorCode.INVALID_FIELD, f"realtime_preview_max_width must be positive, got {max_width}")
    delta = msg.get("delta_reference")
    if delta not in (None, "previous-frame"):
        raise ProtocolError(ErrorCode.INVALID_FIELD, f"delta_reference must be 'previous-frame', got {delta!r}")
    if delta is not None and kind != "raw":
        raise ProtocolError(ErrorCode.INVALID_FIELD, "delta_reference applies to raw frames only")
    return FrameFormat(kind, compression or DEFAULT_COMPRESSION.get(kind, 0), max_width or None, delta is not None)


# ---- events ---------------------------------------------------------------------------------------
def parse_event(msg: dict, seq: int) -> Optional[Interaction]:
    """An `event` map -> Interaction (None for a heartbeat). Events without an event_id get "~seq"."""
    if msg["type"] == "init":
        raise ProtocolError(ErrorCode.ALREADY_STARTED, "this connection already has a session")
    if msg["type"] != "event":
        raise ProtocolError(ErrorCode.UNKNOWN_TYPE, f"unknown message type {msg['type']!r}")
    event_id = msg.get("event_id")
    if event_id is not None and (isinstance(event_id, bool) or not isinstance(event_id, int)
                                 or not -2 ** 63 <= event_id < 2 ** 64):
        raise ProtocolError(ErrorCode.INVALID_FIELD, "event_id must be an integer")
    kind = msg.get("kind")
    if kind == "heartbeat":
        return None
    out = Interaction(f"~{seq}" if event_id is None else str(event_id))
    try:
        if kind == "composite_input":
            _composite(msg.get("payload"), out)
        elif kind in ("camera_actions", "prompt"):
            _apply(kind, msg.get("payload"), out)
        else:
            raise ProtocolError(ErrorCode.UNSUPPORTED_EVENT,
                                f"unknown event kind {kind!r}; use camera_actions, prompt, "
                                "composite_input or heartbeat")
    except ProtocolError as e:
        if event_id is not None:
            e.extra.setdefault("event_id", event_id)
        raise
    return out


def _apply(kind: str, payload: Any, out: Interaction) -> None:
    if kind == "prompt":
        if not isinstance(payload, str) or not payload.strip():
            raise ProtocolError(ErrorCode.INVALID_FIELD, "prompt event payload must be a non-empty string")
        out.prompt = bounded_text(payload, MAX_PROMPT_CHARS, "prompt event payload")
        return
    if isinstance(payload, dict) and payload.get("mode") == "state":
        transitions = payload.get("transitions")
        if not isinstance(transitions, list) or not transitions:
            raise ProtocolError(ErrorCode.INVALID_FIELD,
                                "camera_actions state payload needs a non-empty list 'transitions'")
        if len(transitions) > MAX_TRANSITIONS:
            raise ProtocolError(ErrorCode.INVALID_FIELD, f"camera_actions state payload holds {len(transitions)} "
                                f"transitions; at most {MAX_TRANSITIONS}")
        held = []
        for i, t in enumerate(transitions):
            if not isinstance(t, dict) or not isinstance(t.get("actions"), list):
                raise ProtocolError(ErrorCode.INVALID_FIELD,
                                    f"camera_actions transitions[{i}] must be a map with a list "
                                    "'actions'")
            ts = t.get("client_ts_ms")
            if ts is not None and (isinstance(ts, bool) or not isinstance(ts, (int, float))):
                raise ProtocolError(ErrorCode.INVALID_FIELD,
                                    f"camera_actions transitions[{i}].client_ts_ms must be a number")
            held += parse_keys_list([t["actions"]], f"camera_actions transitions[{i}].actions")
        out.hold = held
        return
    out.keys = parse_actions_script(payload, "camera_actions payload")


def _composite(payload: Any, out: Interaction) -> None:
    if not isinstance(payload, dict):
        raise ProtocolError(ErrorCode.INVALID_FIELD, "composite_input payload must be a map")
    types = payload.get("input_types")
    if not isinstance(types, list) or not types or not all(isinstance(t, str) and t for t in types):
        raise ProtocolError(ErrorCode.INVALID_FIELD, "composite_input needs a non-empty list of strings 'input_types'")
    for kind in types:
        if kind not in ("camera_actions", "prompt"):
            raise ProtocolError(ErrorCode.UNSUPPORTED_EVENT, f"unsupported composite_input type {kind!r}")
        if payload.get(kind) is None:
            raise ProtocolError(ErrorCode.MISSING_FIELD, f"composite_input lists {kind!r} but has no field {kind!r}")
        _apply(kind, payload[kind], out)


# ---- server messages ------------------------------------------------------------------------------
def batch_messages(request_id: str, chunk_index: int, event_id: Optional[int], fmt: FrameFormat, width: int,
                   height: int, batches: tuple[FrameBatch, ...]) -> list[bytes]:
    """The WebSocket messages of one chunk's frame batches: a `frame_batch` map with its payload inside, or for
    payloads of 64 KiB and more a `frame_batch_header` map followed by the payload as a binary message."""
    out = []
    for i, batch in enumerate(batches):
        header: dict[str, Any] = {
            "type": "frame_batch_header", "request_id": request_id, "chunk_index": chunk_index,
            "content_type": fmt.content_type, "num_frames": batch.num_frames, "total_size": len(batch.payload),
            "frame_batch_index": i, "num_frame_batches": len(batches), "is_final_frame_batch": i == len(batches) - 1}
        if event_id is not None:
            header["event_id"] = event_id
        header.update(channels=3, bytes_per_frame=width * height * 3)
        if fmt.kind == "raw":
            header.update(format="rgb24", width=width, height=height, raw_size=batch.raw_size,
                          encoding="delta-gzip" if fmt.delta else "raw")
            if batch.delta_reference:
                header["delta_reference"] = "previous-frame"
        else:
            pw, ph = fmt.image_size(width, height)
            header.update(format=fmt.kind, encoding=fmt.kind, source_width=width, source_height=height,
                          preview_width=pw, preview_height=ph, width=pw, height=ph,
                          payload_lengths=list(batch.lengths))
        if len(batch.payload) >= SPLIT_BYTES:
            out += [pack(header), batch.payload]
        else:
            out.append(pack({**header, "type": "frame_batch", "payload": batch.payload}))
    return out


def ms(seconds: float) -> int:
    return max(0, int(seconds * 1000 + 0.5))


# ---- the connection -------------------------------------------------------------------------------
class SglangWire(SglangViewing, WebSocketWire):
    """MessagePack maps in binary messages; frames raw, delta-gzip, WebP or JPEG in batches, then a chunk_stats
    map per chunk. A bad init or event gets an error and the connection goes on; the end of the session is the
    close (1000 "generation complete"). Its viewers' messages: viewing.py."""
    batch_messages = staticmethod(batch_messages)

    def __init__(self, ws, settings, fetcher=None):
        super().__init__(ws, settings, fetcher)
        self.output: Optional[FrameFormat] = None
        self.size: tuple[int, int] = (0, 0)
        self.session_id = ""
        self.event_id: Optional[int] = None      # the last client event applied, echoed with every chunk

    async def decode(self, raw: dict, limit: int, start: bool) -> dict:
        if raw.get("bytes") is None:
            raise ProtocolError(ErrorCode.UNSUPPORTED_MESSAGE, "send MessagePack maps as binary messages, not text")
        # an init holds no more containers than a control (its largest part is a camera_actions script of
        # MAX_SCRIPT_FRAMES): a client that sends junk before its init, which this dialect lets it retry, gets no
        # more decoding per message than one that sends it later
        return await self._decoded(unpack, raw["bytes"], limit, MAX_CONTROL_CONTAINERS)

    def error_close(self, error: ProtocolError):
        if error.close == CLOSE_NORMAL:          # the session's own limits end it normally, with their reason
            return None, error.message
        return error_message(error), error.message

    async def send_error(self, error: ProtocolError) -> None:
        await self.ws.send_bytes(error_message(error))

    def limit_error(self, code: ErrorCode, text: str) -> ProtocolError:
        return ProtocolError(code, text, close=CLOSE_NORMAL)

    async def parse_start(self, msg: dict, facts: ModelFacts) -> StartRequest:
        s = self.settings
        start = await asyncio.to_thread(parse_init, msg, facts.size, facts.geometry, s.max_chunks, s.fps, facts.steps,
                                        self.fetcher, facts.decoders, s.resolved_max_fps,
                                        (facts.sink_chunks, facts.window_chunks), s.quality_rungs)
        self.output, self.size = start.output, facts.size
        return start

    def queued_message(self, position: int, eta_s: Optional[float]) -> bytes:
        return pack({"type": "queued", "position": position, "eta_s": eta_s})

    def control(self, msg: dict, seq: int):
        if msg["type"] in ("share", "unshare"):
            return SHARE if msg["type"] == "share" else UNSHARE
        if msg["type"] == "save":
            return SAVE
        interaction = parse_event(msg, seq)
        return ACTIVITY if interaction is None else interaction      # a heartbeat: the client is here

    async def send_admitted(self, admitted: Admitted, start: StartRequest, session_id: str) -> None:
        self.session_id = session_id             # SGLang's protocol has no start message: chunks name the session

    async def send_chunk(self, event: ChunkReady, transport_index: int, send) -> bool:
        t0 = time.monotonic()
        started = [int(e) for e in event.started if not e.startswith("~")]
        if started:
            self.event_id = started[-1]
        width, height = self.size
        messages = batch_messages(self.session_id, event.index, self.event_id, self.output, width, height,
                                  event.batches)
        for message in messages:
            if not await send(message):
                return False
        sent = time.monotonic()
        stats = {"type": "chunk_stats", "session_id": self.session_id, "request_id": self.session_id,
                 "chunk_index": event.index, "event_id": self.event_id,
                 "request_prepare_ms": ms(event.timings.get("prepare_next_chunk", 0.0)),
                 "scheduler_forward_ms": ms(event.wall_s),
                 "raw_payload_build_ms": ms(event.timings.get("encode", 0.0)),
                 "ws_write_ms": ms(sent - t0), "chunk_total_ms": ms(event.wall_s + sent - t0),
                 "num_batches": len(messages), "num_frames": event.num_frames,
                 "raw_bytes": sum(b.raw_size for b in event.batches),
                 "ws_payload_bytes": sum(len(m) for m in messages), "content_type": self.output.content_type,
                 "quality": event.quality, "denoising_steps": event.steps,
                 "actions": None if event.keys is None else [list(k) for k in event.keys]}
        return await send(pack(stats))

    async def send_resumed(self, event: Resumed, chunk_index: int, transport_index: int, gap_s: float, reason: str,
                           send) -> bool:
        return await send(pack({"type": "session_resumed", "session_id": self.session_id, "chunk_index": chunk_index,
                                "restored_chunks": event.restored, "replayed_chunks": event.replayed,
                                "replay_ms": ms(event.replay_s), "gap_ms": ms(gap_s), "reason": reason}))

    async def finish(self, stopped: bool, chunks: int) -> None:
        await close_quietly(self.ws, None, CLOSE_NORMAL, "generation complete")
