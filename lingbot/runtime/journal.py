"""A world's journal: everything that decides a session's frames, and how to run them again.

A session's frames are a function of its start (preset, first frame, prompt, seed, size, sampler shift, decoder,
K/V window, camera path) and of what each chunk applied (`ChunkControls`: keys, camera event, prompt change,
the rung's denoising steps and decoder). A group's ranks apply each chunk's controls through `apply`; a
`WorldJournal` keeps the start and every chunk's controls in order, as JSON, so that `replay` makes the same raw
frames on the same pipeline, bitwise (the first frame is kept as its SHA-256: the replay is given the image
and checks it). Version 2 of the JSON writes each distinct prompt once, in its `prompts` list, and a chunk that
changes the prompt names it by `prompt_ref` (its index there), so a prompt held over many chunks costs its text
once; version 1 journals (each chunk's prompt inline) still read.

Plain Python and torch: no Ray."""
from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

import numpy as np

from ..camera import CameraError, CameraEvent, CameraRig, Controls, Trajectory, parse_keys
from ..io.images import model_image
from .rungs import rung_decoders, rung_name

JOURNAL_VERSION = 2
READABLE_VERSIONS = (1, 2)


class JournalError(ValueError):
    """A journal that cannot be read, or cannot be replayed on this pipeline or with this image."""


@dataclass
class ChunkControls:
    """What every rank applies to one chunk."""
    keys: Optional[tuple[str, ...]] = None
    camera: Optional[CameraEvent] = None
    prompt: Optional[str] = None
    prompt_transition_chunks: int = 0
    profile: bool = False          # synchronise the device at stage boundaries (exact stage times)
    steps: Optional[int] = None    # a cheaper rung's denoising forwards (lingbot/runtime/rungs.py); None: all.
    #                                Journaled with the rest, so a replay runs the chunk as it ran.
    decoder: Optional[str] = None  # a decoder rung's frame decoder (None: the session's own); journaled too
    prewarm: Optional[str] = None  # a decoder to warm ahead of a switch up (frames unchanged; decoding.py)

    @property
    def quality(self) -> str:
        """The name of the rung the chunk runs at (`full`: the top)."""
        return rung_name(self.steps, self.decoder)

    def to_json(self) -> dict:
        """The controls as JSON values (the profile flag is not kept: it changes timings, not frames); `quality`
        is said for the reader and not read back."""
        out: dict[str, Any] = {"quality": self.quality}
        if self.keys is not None:
            out["keys"] = list(self.keys)
        if self.camera is not None:
            out["camera"] = asdict(self.camera)
        if self.prompt is not None:
            out["prompt"], out["prompt_transition_chunks"] = self.prompt, self.prompt_transition_chunks
        for name in ("steps", "decoder", "prewarm"):
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        return out

    @classmethod
    def from_json(cls, data: Any) -> ChunkControls:
        if not isinstance(data, dict):
            raise JournalError(f"a chunk's controls must be an object, not {type(data).__name__}")
        try:
            camera = data.get("camera")
            if camera is not None:
                camera = CameraEvent(camera["mode"], tuple(camera["translation"]), tuple(camera["rotation"]),
                                     float(camera.get("transition_chunks", 1.0)))
            keys = data.get("keys")
            steps = data.get("steps")
            return cls(keys=None if keys is None else tuple(parse_keys(str(k)) for k in keys), camera=camera,
                       prompt=data.get("prompt"), prompt_transition_chunks=int(data.get("prompt_transition_chunks", 0)),
                       steps=None if steps is None else int(steps), decoder=data.get("decoder"),
                       prewarm=data.get("prewarm"))
        except (CameraError, KeyError, TypeError, ValueError) as e:
            raise JournalError(f"a chunk's controls are not valid: {e}") from None


def apply(world, controls: ChunkControls, index: int, should_stop: Callable[[], bool] = lambda: False):
    """Run one chunk of `world` (a WorldSession at chunk `index`) with `controls`: (the VideoChunk, or None when
    stopped; the prewarm's result, or None)."""
    prompt = None if controls.prompt is None else (controls.prompt, controls.prompt_transition_chunks)
    warm = None if controls.prewarm is None else world.decoding.prewarm(controls.prewarm, index)
    chunk = world.step(Controls(keys=controls.keys, camera=controls.camera), should_stop=should_stop,
                       prompt=prompt, profile=controls.profile, steps=controls.steps, decoder=controls.decoder)
    return chunk, warm


def open_world(pipeline, image, prompt: str, seed: int, trajectory: Optional[Trajectory] = None,
               flow_shift: Optional[float] = None, decoder: Optional[str] = None,
               window: Optional[tuple[int, int]] = None):
    """A new WorldSession as a group's rank opens one: the preset's camera rig (following `trajectory` if given),
    the session's own decoder (None: the pipeline's default) and the decoder rungs it may switch to."""
    preset = pipeline.runner.preset
    own = pipeline.decoder_name(decoder)
    return pipeline.new_session(image, prompt, seed, rig=CameraRig.default(preset.width, preset.height, trajectory),
                                flow_shift=flow_shift, decoder=own, window=window,
                                switch_to=rung_decoders(own, tuple(pipeline.decoders)))


def image_digest(image) -> str:
    """The SHA-256 of a first frame as the model takes it (float32 [3, H, W] in [-1, 1], C order)."""
    pixels = np.ascontiguousarray(model_image(image).numpy(), dtype="<f4")
    return hashlib.sha256(pixels.tobytes()).hexdigest()


@dataclass
class WorldJournal:
    """A session's start and every delivered chunk's controls, in order."""
    preset: str
    random_weights: bool
    width: int
    height: int
    fps: float
    seed: int
    prompt: str
    image_sha256: str
    decoder: str                                   # the session's own frame decoder
    flow_shift: Optional[float] = None
    window: Optional[tuple[int, int]] = None       # its own K/V window (sink, window chunks); None: the model's
    trajectory: Optional[Trajectory] = None        # the offline camera path, if it followed one
    chunks: list[ChunkControls] = field(default_factory=list)

    def to_json(self) -> str:
        traj = None if self.trajectory is None else {
            "poses": self.trajectory.poses.tolist(), "intrinsics": self.trajectory.intrinsics.tolist(),
            "unit": self.trajectory.unit}
        refs: dict[str, int] = {}
        chunks = [_refer(c.to_json(), refs) for c in self.chunks]
        body = {"version": JOURNAL_VERSION, "preset": self.preset, "random_weights": self.random_weights,
                "width": self.width, "height": self.height, "fps": self.fps, "seed": self.seed, "prompt": self.prompt,
                "image_sha256": self.image_sha256, "decoder": self.decoder, "flow_shift": self.flow_shift,
                "window": None if self.window is None else list(self.window), "trajectory": traj,
                "prompts": list(refs), "chunks": chunks}
        return json.dumps(body, allow_nan=False)

    @classmethod
    def from_json(cls, text: str | bytes) -> WorldJournal:
        try:
            data = json.loads(text)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise JournalError(f"not a JSON journal: {e}") from None
        if not isinstance(data, dict) or data.get("version") not in READABLE_VERSIONS:
            raise JournalError(f"not a version {' or '.join(map(str, READABLE_VERSIONS))} world journal")
        try:
            chunks = data["chunks"] if data["version"] == 1 else _resolve(data["chunks"], data["prompts"])
            traj = data.get("trajectory")
            if traj is not None:
                traj = Trajectory(np.asarray(traj["poses"], dtype=np.float64),
                                  np.asarray(traj["intrinsics"], dtype=np.float64), float(traj["unit"]))
            window = data.get("window")
            flow_shift = data.get("flow_shift")
            journal = cls(str(data["preset"]), bool(data["random_weights"]), int(data["width"]), int(data["height"]),
                          float(data["fps"]), int(data["seed"]), str(data["prompt"]), str(data["image_sha256"]),
                          str(data["decoder"]), None if flow_shift is None else float(flow_shift),
                          None if window is None else (int(window[0]), int(window[1])), traj,
                          [ChunkControls.from_json(c) for c in chunks])
        except (KeyError, TypeError, ValueError, IndexError) as e:
            if isinstance(e, JournalError):
                raise
            raise JournalError(f"the journal lacks or garbles a field: {e!r}") from None
        if not (math.isfinite(journal.fps) and journal.fps > 0):
            raise JournalError(f"fps {journal.fps} must be a positive number")
        return journal


def _refer(chunk: dict, refs: dict[str, int]) -> dict:
    """A chunk's JSON with its prompt's text replaced by the prompt's index in `refs` (each prompt -> its index,
    in order of first use; a new one is added)."""
    if "prompt" not in chunk:
        return chunk
    ref = refs.setdefault(chunk["prompt"], len(refs))
    return {("prompt_ref" if k == "prompt" else k): (ref if k == "prompt" else v) for k, v in chunk.items()}


def _resolve(chunks: Any, prompts: Any) -> list:
    """A version 2 journal's chunks with each `prompt_ref` replaced by its prompt's text, as version 1 wrote it."""
    if not isinstance(prompts, list) or not all(isinstance(p, str) for p in prompts):
        raise JournalError("the journal's prompts must be a list of strings")
    out = []
    for chunk in chunks:
        if isinstance(chunk, dict) and "prompt" in chunk:
            raise JournalError("a version 2 chunk names its prompt by prompt_ref, not its text")
        if isinstance(chunk, dict) and "prompt_ref" in chunk:
            ref = chunk["prompt_ref"]
            if type(ref) is not int or not 0 <= ref < len(prompts):
                raise JournalError(f"prompt_ref {ref!r} is not an index into the journal's {len(prompts)} "
                                   f"prompt{'' if len(prompts) == 1 else 's'}")
            chunk = {("prompt" if k == "prompt_ref" else k): (prompts[ref] if k == "prompt_ref" else v)
                     for k, v in chunk.items()}
        out.append(chunk)
    return out


def replay(pipeline, journal: WorldJournal, image, chunks: Optional[int] = None) -> Iterator:
    """The journal's chunks run again on `pipeline` (one rank: SP-1 makes the frames every group size makes),
    yielding each VideoChunk; `image` is the session's first frame (checked against the journal's digest),
    `chunks` how many to run (None: all). The pipeline must run the journal's preset and load its decoders
    (JournalError otherwise, at once)."""
    preset = pipeline.runner.preset
    if preset.name != journal.preset or (preset.width, preset.height) != (journal.width, journal.height):
        raise JournalError(f"the journal was made by preset {journal.preset} at {journal.width}x{journal.height}; "
                           f"this pipeline runs {preset.name} at {preset.width}x{preset.height}")
    if image_digest(image) != journal.image_sha256:
        raise JournalError("this image is not the session's first frame (its SHA-256 differs from the journal's)")
    needed = {journal.decoder} | {c.decoder for c in journal.chunks if c.decoder} | \
        {c.prewarm for c in journal.chunks if c.prewarm}
    missing = sorted(needed - set(pipeline.decoders))
    if missing:
        raise JournalError(f"the journal's chunks decode with {', '.join(missing)}, which this pipeline did not load")
    world = open_world(pipeline, image, journal.prompt, journal.seed, journal.trajectory, journal.flow_shift,
                       journal.decoder, journal.window)
    return _run(world, journal.chunks[:chunks])


def _run(world, chunks: list[ChunkControls]) -> Iterator:
    for index, controls in enumerate(chunks):
        chunk, _ = apply(world, controls, index)
        yield chunk
