"""The first wire dialect, vLLM-Omni's realtime video protocol (`WS /v1/realtime/video`, docs/architecture.md
"The protocol"): JSON text messages in, a JSON header and one binary fMP4 message per chunk out. Its parser
(plain functions, tested without a server) and its connection (the wire of a session's life).
"""
from __future__ import annotations

import asyncio
import json
import math
from typing import Optional

from lingbot.camera import CameraError, CameraEvent
from lingbot.config import ChunkGeometry

from ..session.codes import CLOSE_NORMAL, CLOSE_POLICY, ErrorCode, ProtocolError
from ..session.events import Admitted, ChunkReady, ModelFacts, Resumed
from ..session.ports import SAVE, SHARE, STOP, UNSHARE
from ..session.requests import Interaction, StartRequest
from .closing import close_quietly
from .parsing import (
    MAX_CONTAINERS,
    MAX_CONTROL_CONTAINERS,
    MAX_EVENT_ID_CHARS,
    MAX_PROMPT_CHARS,
    StartRules,
    bounded_int,
    bounded_text,
    check_json_text,
    check_size,
    checked_message,
    decode_image,
    finite,
    json_object,
    parse_keys_list,
    parse_trajectory,
    require,
    too_deep,
    unknown_fields,
)
from .viewing import VllmViewing
from .wire import WebSocketWire

# ---- the parser -----------------------------------------------------------------------------------
# the checks both dialects share: a start that names no seed gets 0 here; every refusal of a start closes
START = StartRules(default_seed=0, decoder_field="extra_params.decoder", close=CLOSE_POLICY)


def _reject_constant(name: str):
    raise ProtocolError(ErrorCode.INVALID_JSON, f"{name} is not a number JSON allows")


def parse_json(text: str, limit: int, containers: int = MAX_CONTAINERS) -> dict:
    """One client message -> a JSON object with a string `type`, refused past `limit` bytes or `containers` arrays
    and objects (counted on the text, before it is decoded)."""
    check_size(len(text.encode()), limit)
    check_json_text(text, containers)
    try:
        msg = json.loads(text, parse_constant=_reject_constant, parse_int=bounded_int, object_pairs_hook=json_object)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ProtocolError(ErrorCode.INVALID_JSON, f"message is not valid JSON: {e.msg} at position {e.pos}") from None
    except RecursionError:                        # nested deeper than the decoder's stack: far past MAX_DEPTH
        raise too_deep() from None
    return checked_message(msg, ErrorCode.INVALID_JSON, "a JSON object")


# the session.start fields and extra_params read here; any other is ignored, counted and logged
START_FIELDS = frozenset({"type", "model", "prompt", "image_reference", "width", "height", "num_frames", "fps",
                          "seed", "extra_params"})
EXTRA_FIELDS = frozenset({"flow_shift", "camera_action_script", "camera_trajectory", "endless", "profile_stages",
                          "decoder", "realtime_output_pacing", "realtime_causal_sink_size",
                          "realtime_causal_kv_cache_num_frames", "quality", "spectators", "record"})


def parse_start(msg: dict, served_size: tuple[int, int], geometry: ChunkGeometry, default_chunks: int,
                max_chunks: int, default_fps: float, fetcher=None, decoders: tuple[str, ...] = (),
                max_fps: Optional[float] = None, model_window: Optional[tuple[int, int]] = None,
                rungs: tuple[str, ...] = ("full",)) -> StartRequest:
    """A session.start map -> StartRequest; `decoders`: the frame decoders loaded (extra_params.decoder picks one);
    `max_fps`: the highest fps a session may ask for (None: default_fps); `model_window`: the model's (sink,
    window) chunks (extra_params may ask for a smaller one); `rungs`: those a session may pin
    (extra_params.quality)."""
    where = "session.start"
    if "world_id" in msg:
        return parse_world_start(msg, geometry, default_chunks, max_chunks, rungs)
    extra = msg.get("extra_params")
    decoder = START.decoder(extra.get("decoder") if isinstance(extra, dict) else None, decoders)
    prompt = START.prompt(require(msg, "prompt", str, where), f"{where}.prompt")
    width = require(msg, "width", int, where) if "width" in msg else served_size[0]
    height = require(msg, "height", int, where) if "height" in msg else served_size[1]
    if width <= 0 or height <= 0 or width % 16 or height % 16:
        raise ProtocolError(ErrorCode.INVALID_SIZE,
                            f"width and height must be positive multiples of 16, got {width}x{height}",
                            close=CLOSE_POLICY)
    START.served_size(width, height, served_size)
    ref = require(msg, "image_reference", dict, where)
    url = require(ref, "image_url", str, "session.start.image_reference")
    extra = msg.get("extra_params") or {}
    if not isinstance(extra, dict):
        raise ProtocolError(ErrorCode.INVALID_FIELD, "session.start field 'extra_params' must be an object")
    endless = extra.get("endless") is True
    num_frames = None
    if endless:
        chunks = None
    elif msg.get("num_frames") is None:
        chunks = default_chunks
        num_frames = geometry.video_frames(chunks)
    else:
        num_frames = require(msg, "num_frames", int, where)
        chunks = geometry.chunks_for(num_frames)
        if chunks is None:
            raise ProtocolError(ErrorCode.INVALID_NUM_FRAMES, f"num_frames {num_frames} is not of the form "
                                f"{geometry.describe()}", close=CLOSE_POLICY)
        if chunks > max_chunks:
            raise ProtocolError(ErrorCode.INVALID_NUM_FRAMES,
                                f"num_frames {num_frames} is more than {max_chunks} chunks",
                                close=CLOSE_POLICY)
    fps = START.fps(require(msg, "fps", float, where) if msg.get("fps") is not None else None, default_fps, max_fps)
    seed = START.seed(require(msg, "seed", int, where) if msg.get("seed") is not None else None)
    shift = extra.get("flow_shift")
    if shift is not None and (not isinstance(shift, (int, float)) or isinstance(shift, bool)
                              or not 0 < finite(shift) <= 100):
        raise ProtocolError(ErrorCode.INVALID_FIELD,
                            f"extra_params.flow_shift must be a number in (0, 100], got {shift!r}",
                            close=CLOSE_POLICY)
    script = []
    if extra.get("camera_action_script") is not None:
        chunks_script = extra["camera_action_script"]
        if not isinstance(chunks_script, list):
            raise ProtocolError(ErrorCode.INVALID_FIELD, f"extra_params.camera_action_script must be "
                                f"[chunk][{geometry.latent_frames}][keys]",
                                close=CLOSE_POLICY)
        for i, chunk in enumerate(chunks_script):
            frames = parse_keys_list(chunk, f"camera_action_script[{i}]")
            if len(frames) != geometry.latent_frames:
                raise ProtocolError(ErrorCode.INVALID_FIELD,
                                    f"camera_action_script[{i}] has {len(frames)} key sets; each "
                                    f"chunk has {geometry.latent_frames} latent frames", close=CLOSE_POLICY)
            script.append(tuple(frames))
    trajectory = None
    if extra.get("camera_trajectory") is not None:
        if script:
            raise ProtocolError(ErrorCode.CONFLICTING_CAMERA,
                                "extra_params takes camera_action_script or camera_trajectory, "
                                "not both", close=CLOSE_POLICY)
        trajectory = parse_trajectory(extra["camera_trajectory"], width, height, geometry,
                                      geometry.video_frames(max_chunks), num_frames)
    profile = extra.get("profile_stages", False)
    if not isinstance(profile, bool):
        raise ProtocolError(ErrorCode.INVALID_FIELD,
                            "extra_params.profile_stages must be true or false", close=CLOSE_POLICY)
    paced = START.paced(extra.get("realtime_output_pacing"), "extra_params.realtime_output_pacing")
    window = None if model_window is None else START.window(
        extra.get("realtime_causal_sink_size"), extra.get("realtime_causal_kv_cache_num_frames"), "extra_params",
        geometry.latent_frames, model_window)
    quality = START.quality(extra.get("quality"), "extra_params.quality", rungs)
    spectators = START.flag(extra.get("spectators"), "extra_params.spectators", False)
    record = START.flag(extra.get("record"), "extra_params.record", None)
    image = decode_image(url, width, height, fetcher)
    return StartRequest(prompt, image, width, height, chunks, num_frames, fps, seed,
                        None if shift is None else float(shift), script, msg.get("model"), profile, trajectory,
                        decoder=decoder, paced=paced, window=window, quality=quality, spectators=spectators,
                        record=record, unknown_fields=unknown_fields(msg, START_FIELDS)
                        + unknown_fields(extra, EXTRA_FIELDS, "extra_params."))


# what a start that resumes a saved world takes from the world (naming any is refused)
WORLD_FRAME_FIELDS = START_FIELDS - {"type", "model", "num_frames", "extra_params"}
WORLD_FRAME_EXTRA = EXTRA_FIELDS - {"endless", "realtime_output_pacing", "quality", "spectators", "record"}


def parse_world_start(msg: dict, geometry: ChunkGeometry, default_chunks: int, max_chunks: int,
                      rungs: tuple[str, ...]) -> StartRequest:
    """A session.start with `world_id`: the saved world goes on for `num_frames` more frames (a multiple of a
    chunk's; default_chunks chunks when absent, none with extra_params.endless)."""
    where = "session.start"
    extra = msg.get("extra_params") or {}
    if not isinstance(extra, dict):
        raise ProtocolError(ErrorCode.INVALID_FIELD, "session.start field 'extra_params' must be an object",
                            close=CLOSE_POLICY)
    per_chunk = geometry.pixel_frames(1)
    chunks: Optional[int] = default_chunks
    if extra.get("endless") is True:
        chunks = None
    elif msg.get("num_frames") is not None:
        frames = require(msg, "num_frames", int, where)
        if frames <= 0 or frames % per_chunk or frames // per_chunk > max_chunks:
            raise ProtocolError(ErrorCode.INVALID_NUM_FRAMES, f"a resumed world's num_frames counts the frames it "
                                f"adds: a multiple of {per_chunk}, at most {max_chunks} chunks", close=CLOSE_POLICY)
        chunks = frames // per_chunk
    named = sorted(WORLD_FRAME_FIELDS & set(msg)) + [f"extra_params.{k}"
                                                     for k in sorted(WORLD_FRAME_EXTRA & set(extra))]
    pacing = "extra_params.realtime_output_pacing"
    return START.world_start(msg["world_id"], named, chunks, geometry, where, model=msg.get("model"),
                             paced=START.paced(extra.get("realtime_output_pacing"), pacing),
                             quality=START.quality(extra.get("quality"), "extra_params.quality", rungs),
                             spectators=START.flag(extra.get("spectators"), "extra_params.spectators", False),
                             record=START.flag(extra.get("record"), "extra_params.record", None),
                             unknown_fields=unknown_fields(msg, START_FIELDS | {"world_id"})
                             + unknown_fields(extra, EXTRA_FIELDS, "extra_params."))


def parse_interaction(msg: dict) -> Interaction:
    where = "session.interaction"
    body = require(msg, "interaction", dict, where)
    event_id = body.get("event_id")
    if event_id is None:
        raise ProtocolError(ErrorCode.MISSING_FIELD, "session.interaction needs interaction.event_id")
    if isinstance(event_id, bool) or not isinstance(event_id, (str, int)):
        raise ProtocolError(ErrorCode.INVALID_FIELD, "interaction.event_id must be a string or an integer")
    event_id = bounded_text(str(event_id), MAX_EVENT_ID_CHARS, "interaction.event_id")
    try:
        return _parse_event(body, event_id)
    except ProtocolError as e:
        e.extra.setdefault("event_id", event_id)        # the client can tell which of its events failed
        raise


def _parse_event(body: dict, event_id: str) -> Interaction:
    where = "session.interaction"
    event = require(body, "event", dict, f"{where}.interaction")
    transition = body.get("transition_chunks")
    if transition is not None and (not isinstance(transition, (int, float)) or isinstance(transition, bool)
                                   or not 0 <= transition <= 1000):
        raise ProtocolError(ErrorCode.INVALID_FIELD,
                            f"transition_chunks must be a number in [0, 1000], got {transition!r}",
                            event_id=event_id)
    out = Interaction(event_id, transition_chunks=transition)
    if event.get("prompt") is not None:
        if not isinstance(event["prompt"], str):
            raise ProtocolError(ErrorCode.INVALID_FIELD, "event.prompt must be a string", event_id=event_id)
        out.prompt = bounded_text(event["prompt"], MAX_PROMPT_CHARS, "event.prompt", event_id=event_id)
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
            raise ProtocolError(ErrorCode.INVALID_FIELD,
                                f"event.multi_modal_data.camera {detail}", event_id=event_id) from None
    if event.get("keys") is not None:
        out.keys = parse_keys_list(event["keys"], "event.keys")
        if len(out.keys) > 300:
            raise ProtocolError(ErrorCode.INVALID_FIELD,
                                "event.keys holds at most 300 latent frames", event_id=event_id)
    if out.prompt is None and out.camera is None and out.keys is None:
        raise ProtocolError(ErrorCode.INVALID_FIELD,
                            "event needs prompt, multi_modal_data.camera or keys", event_id=event_id)
    return out


# ---- the connection -------------------------------------------------------------------------------
class VllmWire(VllmViewing, WebSocketWire):
    """`/v1/realtime/video`: JSON text messages, one binary fMP4 message per chunk (its viewers': viewing.py)."""

    async def decode(self, raw: dict, limit: int, start: bool) -> dict:
        if raw.get("bytes") is not None:
            raise ProtocolError(ErrorCode.UNSUPPORTED_MESSAGE, "binary messages are not accepted from clients")
        return await self._decoded(parse_json, raw.get("text") or "", limit,
                                   MAX_CONTAINERS if start else MAX_CONTROL_CONTAINERS)

    def keepalive_reply(self, msg: dict) -> Optional[dict]:
        return {"type": "session.pong", "t": msg.get("t")} if msg["type"] == "session.ping" else None

    def error_close(self, error: ProtocolError):
        return error.to_message(), error.code

    async def send_error(self, error: ProtocolError) -> None:
        await self.ws.send_json(error.to_message())

    def limit_error(self, code: ErrorCode, text: str) -> ProtocolError:
        return ProtocolError(code, text, close=CLOSE_POLICY)

    async def parse_start(self, msg: dict, facts: ModelFacts) -> StartRequest:
        s, kind = self.settings, msg["type"]
        if kind == "session.start":
            try:
                return await asyncio.to_thread(parse_start, msg, facts.size, facts.geometry, s.default_chunks,
                                               s.max_chunks, s.fps, self.fetcher, facts.decoders, s.resolved_max_fps,
                                               (facts.sink_chunks, facts.window_chunks), s.quality_rungs)
            except ProtocolError as e:
                if e.close is None:
                    e.close = CLOSE_POLICY
                raise
        if kind in ("session.interaction", "session.stop"):
            raise ProtocolError(ErrorCode.NOT_STARTED, f"{kind} before session.start")
        raise ProtocolError(ErrorCode.UNKNOWN_TYPE, f"unknown message type {kind!r}")

    def control(self, msg: dict, seq: int):
        kind = msg["type"]
        if kind == "session.stop":
            return STOP
        if kind in ("session.share", "session.unshare"):
            return SHARE if kind == "session.share" else UNSHARE
        if kind == "session.save":
            return SAVE
        if kind == "session.interaction":
            return parse_interaction(msg)
        if kind == "session.start":
            raise ProtocolError(ErrorCode.ALREADY_STARTED, "this connection already has a session")
        raise ProtocolError(ErrorCode.UNKNOWN_TYPE, f"unknown message type {kind!r}")

    def queued(self, interaction: Interaction) -> Optional[dict]:
        return {"type": "session.interaction.queued", "event_id": interaction.event_id}

    def queued_message(self, position: int, eta_s: Optional[float]) -> dict:
        return {"type": "session.queued", "position": position, "eta_s": eta_s}

    async def send_admitted(self, admitted: Admitted, start: StartRequest, session_id: str) -> None:
        geometry = admitted.facts.geometry
        config = {"width": start.width, "height": start.height, "fps": start.fps, "num_frames": start.num_frames,
                  "chunks": start.chunks, "endless": start.chunks is None, "mime": admitted.mime,
                  "frames_per_chunk": [geometry.pixel_frames(0), geometry.pixel_frames(1)], "seed": start.seed,
                  "group": admitted.group}
        await self.ws.send_json({"type": "video.start", "request_id": session_id, "format": "m4s", "config": config})

    async def send_chunk(self, event: ChunkReady, transport_index: int, send) -> bool:
        meta = {"type": "video.chunk_metadata", "kind": "media", "generation_chunk_index": event.index,
                "transport_chunk_index": transport_index, "num_frames": event.num_frames,
                "byte_length": len(event.data), "started_event_ids": event.started,
                "active_event_ids": event.active, "completed_event_ids": event.completed,
                "timings": {k: round(v, 5) for k, v in event.timings.items()},
                "quality": event.quality, "denoising_steps": event.steps,     # full, None: every step
                "group_clock": {k: round(v, 4) for k, v in event.clock.items() if math.isfinite(v)}}  # unpaced: no lead
        return await send(meta) and await send(event.data)

    async def send_resumed(self, event: Resumed, chunk_index: int, transport_index: int, gap_s: float, reason: str,
                           send) -> bool:
        return await send({"type": "session.resumed", "generation_chunk_index": chunk_index,
                           "transport_chunk_index": transport_index, "restored_chunks": event.restored,
                           "replayed_chunks": event.replayed, "replay_s": round(event.replay_s, 3),
                           "gap_s": round(gap_s, 3), "reason": reason})

    async def finish(self, stopped: bool, chunks: int) -> None:
        await self.ws.send_json({"type": "session.done", "chunks": chunks, "stopped": stopped})
        await close_quietly(self.ws, None, CLOSE_NORMAL)
