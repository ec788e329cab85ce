"""The one prepared check for a lent GPU: what only a device can show, measured stage by stage in one run
that keeps every figure it measured, whatever fails after it.

    python -m perf.device_check --out /tmp/out                    # lingbot-world-v2-14b dims on cuda
    python -m perf.device_check --preset tiny --device cpu        # the same script end to end on any machine
        [--out DIR] [--deadline-s 480] [--steady 3] [--skip STAGE,...] [--no-compile] [--no-graphs]
        [--peak-seconds 2]

This module owns the stages, their order and guards, the deadline, and the run's output folder. The
stages run in order of value; each runs in its own guard, and its figures (or its error with the
traceback) are written as soon as it ends:

    setup         the preset with seeded random weights built straight on the device in its dtype (no
                  checkpoint, no text encoder: a random text embedding stands in for UMT5's output), the
                  attention kernel chosen at the steady-state shape, the device's measured matmul peak
    eager_dit     the DiT alone, eager: warm-up through every window length, then the steady chunk (prepare,
                  4 probes, commit), its FLOP/s from the cost model against the peak
    eager_whole   the whole chunk, eager (DiT, VAE decode, uint8, the frames' copy to the host) of a session
                  whose first frame reached its condition fixed point before (the serving steady state; the
                  condition encoder's own time per chunk until then is reported)
    compiled      regional compile: the DiT and the whole chunk; latents against eager's (COMPILE_TOLERANCE)
    no_sync       a DiT chunk with every host synchronisation an error (CUDA: set_sync_debug_mode("error"))
    graphs        the compiled regions as CUDA graphs: DiT and whole chunk; replay bitwise the compiled latents
    interleaving  two sessions run chunk by chunk leave each other's outputs intact
    snapshots     the whole chunk alone, with a synchronous copy of its snapshot to the host and with the
                  asynchronous one (side stream, pinned memory); the copies' own time with the device idle;
                  an asynchronous copy made while the next chunk runs is bitwise the synchronous one
    memory        what one session holds, measured and predicted alike: a DiT session against the budget
                  model's DiT parts, a whole session against its whole footprint, part by part
    lifecycle     RankLifecycle as a rank runs it (connect as a single rank, load from a safetensors folder
                  written by the project's checkpoint writer at the preset's dims for LIFECYCLE_LAYERS
                  blocks, warm up, measure, capacity); it frees the main model first, so it runs last

Deadline (`--deadline-s`, from the start of the run): before each stage its cost is estimated from what
earlier stages measured (a priori figures before any did); a stage that would not end before the deadline
is skipped and marked so, and the next, cheaper ones still may run. setup and eager_dit always run.

Output (`--out DIR`, default $OUT, else a new folder under the temp directory): `device_check.json`
(every stage: status, seconds, estimate, figures or error and traceback), `device_check.md` (the markdown
tables to paste into perf/README.md) and `device_check.log` (progress, the engine's log lines). The JSON
and the table are rewritten whole after every stage (a temporary file renamed over the old one, so a kill
never leaves half a file); a stage running when the process died shows as "running".
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import json
import logging
import os
import platform
import statistics
import tempfile
import time
import traceback
import types
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from lingbot.builder import build_pipeline
from lingbot.camera import Controls
from lingbot.config import ConfigError, Preset, TextEncoderConfig, get_preset
from lingbot.io.images import model_image
from lingbot.io.weights import write_random_checkpoint
from lingbot.runtime.attention import choose_for_steady_state
from lingbot.runtime.budget import session_footprint, snapshot_footprint
from lingbot.runtime.compile import compile_blocks, compile_default, uncompile_blocks
from lingbot.runtime.condition import CONDITION_CACHE_CHUNKS, CausalConditionEncoder, LatentCondition
from lingbot.runtime.lifecycle import RankLifecycle
from lingbot.runtime.snapshot import HostCopier, take_snapshot
from perf.cost_model import matmul_peak, preset_chunk_flops

# compiled vs eager on the first chunk, relative to its largest value: bf16 fused kernels round differently
# (later chunks drift further through the chained K/V, so they are reported, not judged)
COMPILE_TOLERANCE = 2e-2
KEYS = Controls(keys=("w", "l", "i"))
DEFAULT_DEADLINE_S = 480.0
LIFECYCLE_LAYERS = 2            # DiT blocks of the folder the lifecycle stage writes and loads
LIFECYCLE_MAX_SESSIONS = 1000   # a cap high enough that the capacity shows what the memory allows
GOAL_WHOLE_CHUNK_S = 1.75       # issue 22's goals, one H200 at 14B dims (reported, never asserted)
GOAL_DIT_FRACTION = 0.70

# a priori figures for the estimates, used until a stage has measured the real ones
EAGER_FRACTION = 0.3            # of the matmul peak, an eager DiT chunk
WHOLE_OVER_DIT = 1.5            # whole chunk (decode, frames) over the DiT chunk
COMPILE_S = {"cuda": 150.0}     # a regional compile and its first chunk; other devices: DEFAULT_COMPILE_S
DEFAULT_COMPILE_S = 60.0
HOST_COPY_BYTES_PER_S = {"cuda": 4e9}   # a synchronous device -> pageable host copy; others: the default
DEFAULT_HOST_COPY_BYTES_PER_S = 2e9
WRITE_BYTES_PER_S = 150e6       # random weights made on the host and written as safetensors
LOAD_BYTES_PER_S = 1e9          # a safetensors folder read to the device


# ---------------------------------------------------------------------------------------------------
# what the stages share
# ---------------------------------------------------------------------------------------------------
def _sync(device: torch.device) -> None:
    if device.type != "cpu":
        torch.accelerator.synchronize(device)


def _timed(device: torch.device, fn: Callable) -> tuple[float, object]:
    _sync(device)
    t0 = time.perf_counter()
    out = fn()
    _sync(device)
    return time.perf_counter() - t0, out


def _allocated(device: torch.device) -> Optional[int]:
    """Live tensor bytes on the device (None where there is no device allocator to ask)."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    return torch.cuda.memory_allocated(device)


def _free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _quietly(fn: Callable, *args):
    """fn(*args), or None when it raises: bookkeeping between stages (peak memory, freeing caches) must not
    stop the run after a stage left the device in an error state; the stage's own error says why."""
    try:
        return fn(*args)
    except Exception:
        return None


class Check:
    """What the stages share: the settings, the pipeline and its inputs, the figures measured so far (the
    estimates of later stages use them) and the DiT latents each mode made (for the comparisons)."""

    def __init__(self, args, progress: Callable[[str], None]):
        self.args = args
        self.progress = progress
        self.device = torch.device(args.device)
        self.preset = get_preset(args.preset)
        self.warm = self.preset.transformer.window_chunks + 1      # every window length, then the first steady
        self.steady = args.steady
        self.flops = preset_chunk_flops(self.preset, self.warm).total   # a steady chunk's DiT FLOPs
        self.peak_flops: Optional[float] = None
        self.weights_bytes: Optional[int] = None
        self.pipe = None
        self.text = self.latents = self.image = None
        self.conditions_primed = False
        self.mode = "eager"                                    # the DiT regions in place now
        self.latents_by_mode: dict[str, torch.Tensor] = {}      # mode -> DiT latents [16, F, h, w] fp32, host
        self.seconds: dict[str, float] = {}                     # measured: "dit", "whole" (regions in place), "compile"

    # ---- estimates ----------------------------------------------------------------------------
    def chunk_s(self) -> tuple[float, float]:
        """(DiT chunk, whole chunk) seconds with the regions in place: the last measured, else from the FLOPs
        at EAGER_FRACTION of the matmul peak."""
        dit = self.seconds.get("dit")
        if dit is None:
            dit = self.flops / (EAGER_FRACTION * (self.peak_flops or 1e12))
        return dit, self.seconds.get("whole", WHOLE_OVER_DIT * dit)

    def compile_s(self) -> float:
        return self.seconds.get("compile", COMPILE_S.get(self.device.type, DEFAULT_COMPILE_S))

    # ---- the DiT regions ----------------------------------------------------------------------
    def to_eager(self) -> None:
        """Back to the eager regions, compiled code and graphs dropped (before a compile, after a failed one)."""
        if self.pipe is not None:
            uncompile_blocks(self.pipe.runner.model)
        torch._dynamo.reset()
        self.mode = "eager"


def _dit_chunks(c: Check, seed: int = 0) -> dict:
    """A DiT-only session through warm-up (every window length) and `steady` chunks; keeps its latents by
    mode (one session at a time: at 14B a session's K/V slab is ~21 GiB)."""
    session = c.pipe.runner.new_session(LatentCondition(c.latents), text_embedding=c.text, seed=seed)
    times, outs = [], []
    for i in range(c.warm + c.steady):
        seconds, result = _timed(c.device, partial(session.run_chunk, KEYS))
        times.append(seconds)
        outs.append(result.latents)
        if i == 0:
            c.progress(f"  {c.mode}: first DiT chunk {seconds:.2f} s")
    c.latents_by_mode[c.mode] = torch.cat(outs, dim=1).float().cpu()
    steady = statistics.median(times[c.warm:])
    c.seconds["dit"] = steady
    return {"regions": c.mode, "dit_warmup_s": sum(times[:c.warm]), "dit_first_chunk_s": times[0],
            "dit_steady_s": steady, "dit_chunk_s": times, "dit_tflops": c.flops / steady / 1e12,
            "dit_fraction_of_peak": c.flops / steady / c.peak_flops if c.peak_flops else None}


def _prime_conditions(c: Check) -> dict:
    """Runs the condition encoder of the check's first frame alone to its fixed point, into the pipeline's
    shared condition cache: every whole session after it replays the conditions and never encodes, as a
    served session of a first frame seen before does (the steady state the goals speak of). Its time per
    chunk is the encoder's cost until the fixed point."""
    pipe, cfg = c.pipe, c.preset.transformer
    if pipe.condition_cache is None or not pipe.skip_fixed_point:
        return {"condition_replayed": False, "condition_encode_s": []}
    image = model_image(c.image).to(c.device)
    encoder = CausalConditionEncoder(pipe.vae, image, cfg.num_frames_per_block, True, pipe.condition_cache)
    times = []
    for chunk in range(CONDITION_CACHE_CHUNKS):
        if encoder.fixed_point_chunk is not None:
            break
        seconds, _ = _timed(c.device, partial(encoder.chunk_condition, chunk))
        encoder.commit()
        times.append(seconds)
    c.conditions_primed = True
    return {"condition_fixed_point_chunk": encoder.fixed_point_chunk, "condition_encode_s": times,
            "condition_encode_steady_s": statistics.median(times[1:]) if len(times) > 1 else None}


def _whole_chunks(c: Check, seed: int = 0) -> dict:
    """A whole session (conditions, DiT, decode, uint8 frames copied to the host, as a rank runs a chunk)
    through warm-up and `steady` chunks."""
    figures = {} if c.conditions_primed else _prime_conditions(c)
    session = c.pipe.new_session(c.image, None, seed=seed, text_embedding=c.text)
    times = []
    for _ in range(c.warm + c.steady):
        seconds, _ = _timed(c.device, lambda: session.step(KEYS).frames.cpu())
        times.append(seconds)
    steady = statistics.median(times[c.warm:])
    c.seconds["whole"] = steady
    return {**figures, "regions": c.mode, "whole_warmup_s": sum(times[:c.warm]), "whole_first_chunk_s": times[0],
            "whole_steady_s": steady, "whole_chunk_s": times,
            "condition_replayed": session.condition.replay is not None,
            "condition_encoded_chunks": session.condition.encoded_chunks}


def _versus(c: Check, mode: str) -> dict:
    """`mode`'s DiT latents against eager's (chunk 0 relative to its largest value, judged; all chunks,
    reported) and, for graphs, bitwise against the compiled regions' (where those stages ran)."""
    out = {}
    got = c.latents_by_mode[mode]
    if "eager" in c.latents_by_mode:
        ref = c.latents_by_mode["eager"]
        first = c.preset.transformer.num_frames_per_block                 # chunk 0's latent frames
        relative = ((got[:, :first] - ref[:, :first]).abs().max() / ref[:, :first].abs().max()).item()
        out.update(vs_eager_max_abs=(got - ref).abs().max().item(), chunk0_relative_diff=relative,
                   within_tolerance=relative <= COMPILE_TOLERANCE)
    if mode == "compiled+graphs" and "compiled" in c.latents_by_mode:
        out["graphs_vs_compiled_bitwise"] = torch.equal(got, c.latents_by_mode["compiled"])
    return out


# ---------------------------------------------------------------------------------------------------
# the stages
# ---------------------------------------------------------------------------------------------------
def stage_setup(c: Check) -> dict:
    # large matmuls on a GPU: small ones stay far from its peak and would flatter the achieved fraction
    c.peak_flops = matmul_peak(str(c.device), c.preset.dtype, n=8192 if c.device.type == "cuda" else 2048,
                               seconds=c.args.peak_seconds)
    cfg = c.preset.transformer
    t0 = time.perf_counter()
    c.pipe = build_pipeline(c.preset, device=c.device, compile=False, text_encoder=False, seed=0)
    _sync(c.device)
    build_s = time.perf_counter() - t0
    c.weights_bytes = _allocated(c.device) or sum(p.numel() * p.element_size()
                                                  for p in c.pipe.runner.model.parameters())
    g = torch.Generator().manual_seed(0)
    # stand-ins: a text encoder output [1, T, text_dim] and image latents [16, F, h, w] for every chunk run
    c.text = (torch.randn(1, c.preset.text.max_length, cfg.text_dim, generator=g) * 0.1).to(
        c.device, c.preset.torch_dtype)
    c.latents = torch.randn(16, cfg.num_frames_per_block * (c.warm + c.steady), *c.preset.latent_hw,
                            generator=g).to(c.device)
    c.image = np.random.RandomState(0).randint(0, 256, (c.preset.height, c.preset.width, 3), dtype=np.uint8)
    kernel, trials = choose_for_steady_state(c.pipe.runner.model, c.preset, c.device)
    return {"build_s": build_s, "weights_bytes": c.weights_bytes, "matmul_peak_tflops": c.peak_flops / 1e12,
            "dit_chunk_tflop": c.flops / 1e12, "attention_kernel": kernel,
            "attention_trials": [{"name": t.name, "ms": None if t.seconds is None else t.seconds * 1e3,
                                  "dropped": t.error} for t in trials]}


def stage_eager_dit(c: Check) -> dict:
    return _dit_chunks(c)


def stage_eager_whole(c: Check) -> dict:
    return _whole_chunks(c)


def _compiled(c: Check, graphs: bool) -> dict:
    c.to_eager()
    t0 = time.perf_counter()
    compile_blocks(c.pipe.runner.model, graphs=graphs)
    c.mode = "compiled+graphs" if graphs else "compiled"
    figures = _dit_chunks(c)
    # compiles (and graph captures) land in the first chunk; later window lengths reuse them
    c.seconds["compile"] = max(0.0, figures["dit_first_chunk_s"] - figures["dit_steady_s"])
    figures.update(_whole_chunks(c))
    figures["compile_and_warmup_s"] = time.perf_counter() - t0
    figures.update(_versus(c, c.mode))
    return figures


def stage_compiled(c: Check) -> dict:
    return _compiled(c, graphs=False)


def stage_graphs(c: Check) -> dict:
    """On CUDA the regions as CUDA graphs; elsewhere inductor runs the same mode without graphs."""
    return _compiled(c, graphs=True)


def stage_no_sync(c: Check, warm: int = 2) -> dict:
    """A DiT chunk after `warm` chunks with every host synchronisation an error (CUDA); 'ok' or where."""
    session = c.pipe.runner.new_session(LatentCondition(c.latents), text_embedding=c.text, seed=1)
    for _ in range(warm):
        session.run_chunk(KEYS)
    if c.device.type != "cuda":
        return {"regions": c.mode,
                "result": "n/a (CPU: tests/lingbot/runtime/test_dit_runner.py forbids host reads instead)"}
    torch.cuda.set_sync_debug_mode("error")
    try:
        session.run_chunk(KEYS)
        result = "ok"
    except RuntimeError as e:
        where = traceback.extract_tb(e.__traceback__)[-1]
        result = f"synced: {str(e).splitlines()[0][:120]} at {where.filename}:{where.lineno}"
    finally:
        torch.cuda.set_sync_debug_mode(0)
    return {"regions": c.mode, "result": result}


def stage_interleaving(c: Check, chunks: int = 3) -> dict:
    """With the regions in place (graphs when built): session A alone, then A again interleaved chunk by
    chunk with a session B; A's latents must be the same bitwise (no replay overwrote what A still used)."""
    def session(seed):
        return c.pipe.runner.new_session(LatentCondition(c.latents), text_embedding=c.text, seed=seed)
    alone = session(5)
    reference = [alone.run_chunk(KEYS).latents.clone() for _ in range(chunks)]
    del alone                                        # at 14B a session's slab is ~21 GiB: two at a time
    a, b = session(5), session(6)
    again = []
    for _ in range(chunks):
        again.append(a.run_chunk(KEYS).latents)
        b.run_chunk(KEYS)
    _sync(c.device)
    return {"regions": c.mode, "chunks": chunks,
            "intact": all(torch.equal(x, y) for x, y in zip(reference, again))}


def _snapshot_tensors(snapshot) -> list:
    slot, state = snapshot
    return slot.tensors() + state.tensors()


def stage_snapshots(c: Check) -> dict:
    """The steady whole chunk with no snapshot, a synchronous one and an asynchronous one after each (median
    of `steady` each); the copies alone with the device idle; then one asynchronous snapshot copied while
    the next chunk runs, against a synchronous snapshot of the same moment."""
    if not c.conditions_primed:
        _prime_conditions(c)
    session = c.pipe.new_session(c.image, None, seed=0, text_embedding=c.text)
    for _ in range(2):
        session.step(KEYS)
    sync_copier, async_copier = HostCopier("cpu"), HostCopier(c.device)

    def period(after) -> float:
        times = []
        for _ in range(c.steady):
            t0 = time.perf_counter()
            session.step(KEYS).frames.cpu()
            after()
            times.append(time.perf_counter() - t0)
        _sync(c.device)
        return statistics.median(times)

    alone = period(lambda: None)
    synchronous = period(lambda: take_snapshot(session, copier=sync_copier))
    asynchronous = period(lambda: take_snapshot(session, copier=async_copier, key="check"))
    # the synchronous copy alone, the device idle; then an asynchronous one of the same moment, queued
    # (pinned buffers, side stream) and left to run under the next chunk
    copy_sync_s, reference = _timed(c.device, lambda: take_snapshot(session, copier=sync_copier))
    t0 = time.perf_counter()
    copied = take_snapshot(session, copier=async_copier, key="check")
    queue_s = time.perf_counter() - t0
    session.step(KEYS)                                  # the next chunk runs while the copy goes on
    if async_copier.last is not None:
        async_copier.last.synchronize()
    pairs = list(zip(_snapshot_tensors(reference), _snapshot_tensors(copied)))
    exact = len(pairs) == len(_snapshot_tensors(reference)) and all(torch.equal(a, b) for a, b in pairs)
    # the asynchronous copy alone, the device idle: from the call to the copy engine's last byte
    _sync(c.device)
    t0 = time.perf_counter()
    take_snapshot(session, copier=async_copier, key="check")
    if async_copier.last is not None:
        async_copier.last.synchronize()
    copy_async_s = time.perf_counter() - t0
    nbytes = reference[0].nbytes() + reference[1].nbytes()
    return {"regions": c.mode, "bytes": nbytes, "budget_model_bytes": snapshot_footprint(c.preset).per_chunk,
            "asynchronous": async_copier.asynchronous, "chunk_s": alone, "chunk_sync_snapshot_s": synchronous,
            "chunk_async_snapshot_s": asynchronous, "sync_cost": synchronous / alone - 1,
            "async_cost": asynchronous / alone - 1, "copy_sync_s": copy_sync_s, "copy_async_s": copy_async_s,
            "copy_async_queue_s": queue_s, "copy_sync_gb_per_s": nbytes / copy_sync_s / 1e9,
            "copy_async_gb_per_s": nbytes / copy_async_s / 1e9, "async_bitwise": exact}


def held_bytes(root, shared=()) -> int:
    """Bytes of the distinct tensor storages reachable from `root` without passing through a `shared`
    object or any module (the weights): what `root` alone keeps alive, on any device."""
    opaque = (torch.nn.Module, type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType)
    seen = {id(x) for x in shared}
    stack, storages = [root], {}
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, opaque):
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            storage = obj.untyped_storage()
            storages[(storage.device, storage.data_ptr())] = storage.nbytes()
            continue
        stack.extend(gc.get_referents(obj))
    return sum(storages.values())


def stage_memory(c: Check) -> dict:
    """One session's memory, measured and predicted alike. The budget model (`session_footprint`) is per
    part; a DiT-only session holds two of them (its K/V window and its prompt's text K/V), a whole session
    all of them but the camera modulation, which lives within a chunk. Measured twice: the tensors the
    session owns (any device), and the device allocator's growth (CUDA; the shared condition cache's own
    growth taken out). A whole session from a first frame not seen before, so its encoder runs and its
    caches are held; the maximum over `warm` chunks (every window length)."""
    pipe, device = c.pipe, c.device
    footprint = session_footprint(c.preset)
    budget = {**dataclasses.asdict(footprint), "total": footprint.total}
    shared = [pipe, pipe.runner, pipe.vae, pipe.decoder, pipe.condition_cache]

    _free_memory(device)
    before = _allocated(device)
    dit = pipe.runner.new_session(LatentCondition(c.latents), text_embedding=c.text, seed=2)
    for _ in range(2):                          # the slab and the text K/V exist from the start; 2 chunks show
        dit.run_chunk(KEYS)                     # anything made lazily
    dit_figures = {"owned_bytes": held_bytes(dit, shared + [dit.time]),
                   "allocated_bytes": None if before is None else _allocated(device) - before,
                   "budget_bytes": budget["kv_window"] + budget["text_kv"],
                   "kv_window_bytes": held_bytes(dit.kv), "text_kv_bytes": held_bytes(dit.text)}
    del dit
    _free_memory(device)

    image = np.random.RandomState(1).randint(0, 256, (c.preset.height, c.preset.width, 3), dtype=np.uint8)
    cache_before, before = held_bytes(pipe.condition_cache), _allocated(device)
    session = pipe.new_session(image, None, seed=2, text_embedding=c.text)
    owned, allocated, parts = [], [], []
    for _ in range(c.warm):
        session.step(KEYS)                      # the chunk's frames are dropped at once
        owned.append(held_bytes(session, shared + [session.dit.time]))    # time embeddings: the runner's
        if before is not None:
            allocated.append(_allocated(device) - before - (held_bytes(pipe.condition_cache) - cache_before))
        enc = session.condition
        parts.append({"kv_window": held_bytes(session.dit.kv), "text_kv": held_bytes(session.dit.text),
                      "decoder_cache": session.decoder_cache.nbytes(), "condition_cache": enc.cache.nbytes(),
                      "condition_history": sum(t.numel() * t.element_size() for t in enc.history),
                      "camera_modulation": 0})          # made and dropped within each chunk
    whole = {"chunks": c.warm, "owned_bytes": owned, "allocated_bytes": allocated or None,
             "max_owned_bytes": max(owned), "max_allocated_bytes": max(allocated) if allocated else None,
             "parts_max": {k: max(p[k] for p in parts) for k in parts[0]},
             "budget_bytes": footprint.total,
             "budget_held_bytes": footprint.total - budget.get("camera_modulation", 0),
             "fixed_point_chunk": session.condition.fixed_point_chunk}
    return {"regions": c.mode, "budget_model": budget, "dit_session": dit_figures, "whole_session": whole}


def few_layer_preset(preset: Preset, layers: int = LIFECYCLE_LAYERS) -> Preset:
    """`preset` at its own dims with `layers` DiT blocks, and a one-layer text encoder as wide as the DiT
    reads (byte vocabulary, narrow attention and FFN): a checkpoint folder of ~1.5 GB at 14B dims, not ~60."""
    t = preset.text
    text = TextEncoderConfig(max_length=t.max_length, vocab_size=259, d_model=t.d_model, d_kv=min(t.d_kv, 64),
                             d_ff=min(t.d_ff, 1024), num_layers=1, num_heads=min(t.num_heads, 8))
    return dataclasses.replace(preset, name=f"{preset.name}-{layers}-layers", text=text, weights_seed=0,
                               transformer=dataclasses.replace(preset.transformer, num_layers=layers))


def stage_lifecycle(c: Check) -> dict:
    """RankLifecycle as a serving rank runs it, compile as the serving default (on for accelerators). The
    main model is freed first, so the rank measures the device as a rank would find it."""
    if c.pipe is not None:
        c.to_eager()
        c.pipe = c.text = c.latents = None
        c.latents_by_mode.clear()
        _free_memory(c.device)
    preset = few_layer_preset(c.preset)
    with tempfile.TemporaryDirectory(prefix="lingbot-device-check-") as folder:
        t0 = time.perf_counter()
        write_random_checkpoint(preset, folder, seed=0)
        write_s = time.perf_counter() - t0
        nbytes = sum(p.stat().st_size for p in Path(folder).rglob("*") if p.is_file())
        c.progress(f"  wrote {nbytes / 2 ** 30:.2f} GiB of safetensors in {write_s:.1f} s")
        life = RankLifecycle(rank=0, world_size=1, device=c.device)
        t0 = time.perf_counter()
        life.connect(None, timeout_s=60)
        life.load(preset, folder)
        _sync(c.device)
        load_s = time.perf_counter() - t0
        c.progress(f"  connected and loaded in {load_s:.1f} s")
        warmup = life.warm_up()
        memory = life.measure()
        capacity = life.capacity(LIFECYCLE_MAX_SESSIONS)
    return {"layers": LIFECYCLE_LAYERS, "checkpoint_bytes": nbytes, "write_s": write_s, "connect_and_load_s": load_s,
            "compiled": compile_default(c.device), "warmup": dataclasses.asdict(warmup),
            "attention_kernel": life.attention_kernel, "loaded_bytes": life.loaded_bytes,
            "memory": None if memory is None else dataclasses.asdict(memory), "capacity": capacity,
            "capacity_cap": LIFECYCLE_MAX_SESSIONS, "session_budget_bytes": session_footprint(preset).total}


# ---- estimates, in seconds, from what the check has measured so far -----------------------------
def _estimate_whole_session(c: Check) -> float:
    whole = c.chunk_s()[1]
    priming = 0.0 if c.conditions_primed else CONDITION_CACHE_CHUNKS * 0.2 * whole
    return (c.warm + c.steady) * whole + priming


def _estimate_compiled(c: Check, factor: float) -> float:
    dit, whole = c.chunk_s()
    return factor * c.compile_s() + (c.warm + c.steady) * (dit + whole)


def _estimate_snapshots(c: Check) -> float:
    whole = c.chunk_s()[1]
    copy = snapshot_footprint(c.preset).per_chunk / HOST_COPY_BYTES_PER_S.get(c.device.type,
                                                                             DEFAULT_HOST_COPY_BYTES_PER_S)
    return (3 + 3 * c.steady + 1) * whole + (c.steady + 3) * copy


def _estimate_memory(c: Check) -> float:
    dit, whole = c.chunk_s()
    return 2 * dit + c.warm * whole


def _estimate_lifecycle(c: Check) -> float:
    whole = c.chunk_s()[1]
    share = LIFECYCLE_LAYERS / c.preset.transformer.num_layers
    nbytes = share * (c.weights_bytes or 0)
    compile = 0.5 * c.compile_s() if compile_default(c.device) else 0.0     # the inductor caches are warm
    return 5 + nbytes / WRITE_BYTES_PER_S + nbytes / LOAD_BYTES_PER_S + compile + c.warm * whole * (share + 0.3)


@dataclass(frozen=True)
class Stage:
    name: str
    title: str
    run: Callable[[Check], dict]
    estimate: Callable[[Check], float]
    required: bool = False          # runs whatever the deadline says
    needs_pipeline: bool = True     # skipped when setup did not build it
    on_failure: Optional[Callable[[Check], None]] = None


STAGES = (
    Stage("setup", "build, attention kernel, matmul peak", stage_setup, lambda c: 0.0, required=True,
          needs_pipeline=False),
    Stage("eager_dit", "eager DiT chunk", stage_eager_dit, lambda c: (c.warm + c.steady) * c.chunk_s()[0],
          required=True),
    Stage("eager_whole", "eager whole chunk with decode", stage_eager_whole, _estimate_whole_session),
    Stage("compiled", "regional compile", stage_compiled, lambda c: _estimate_compiled(c, 1.0),
          on_failure=Check.to_eager),
    Stage("no_sync", "no host sync on the DiT step path", stage_no_sync, lambda c: 3 * c.chunk_s()[0]),
    Stage("graphs", "compiled regions as CUDA graphs", stage_graphs, lambda c: _estimate_compiled(c, 1.3),
          on_failure=Check.to_eager),
    Stage("interleaving", "two sessions interleaved", stage_interleaving, lambda c: 9 * c.chunk_s()[0]),
    Stage("snapshots", "snapshot copies against the chunk", stage_snapshots, _estimate_snapshots),
    Stage("memory", "one session measured and predicted", stage_memory, _estimate_memory),
    Stage("lifecycle", "RankLifecycle from a safetensors folder", stage_lifecycle, _estimate_lifecycle,
          needs_pipeline=False),
)
STAGE_NAMES = tuple(s.name for s in STAGES)


# ---------------------------------------------------------------------------------------------------
# the output folder
# ---------------------------------------------------------------------------------------------------
def _plain(value):
    """JSON for what json does not know (numpy and torch scalars, devices, paths): a number or a string."""
    if isinstance(value, (np.generic, torch.Tensor)) and getattr(value, "ndim", 1) == 0:
        return value.item()
    return str(value)


def _write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class Output:
    """The run's folder: the JSON and the markdown table rewritten whole after every stage (written to a
    temporary file renamed over the old one: a reader or a kill never sees half a file); the log appended
    line by line, progress echoed to stdout."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.json = self.folder / "device_check.json"
        self.table = self.folder / "device_check.md"
        self.log_path = self.folder / "device_check.log"
        self._log = open(self.log_path, "a", buffering=1)
        self.handler = logging.StreamHandler(self._log)       # the engine's own log lines go to the log file
        self.handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))

    def log(self, line: str) -> None:
        print(line, flush=True)
        self._log.write(line + "\n")
        self._log.flush()

    def write(self, report: dict) -> None:
        report["modes"] = modes_of(report)
        _write_atomically(self.json, json.dumps(report, indent=2, default=_plain) + "\n")
        try:
            table = render_table(report)
        except Exception as e:                     # a figure the table did not expect never costs the JSON
            table = f"(no table: {type(e).__name__}: {e}; the figures are in {self.json.name})\n"
        _write_atomically(self.table, table)

    def close(self) -> None:
        self._log.close()


# ---------------------------------------------------------------------------------------------------
# the run
# ---------------------------------------------------------------------------------------------------
class InjectedFailure(RuntimeError):
    """Raised by --fail-stage: a stage that fails on purpose (tests of the guards)."""


def _fail_on_purpose(name: str) -> None:
    raise InjectedFailure(f"stage {name} failed on purpose (--fail-stage {name})")


def _skip_reason(stage: Stage, args, report: dict, estimate: Optional[float], elapsed: float) -> Optional[str]:
    if stage.name in args.skip:
        return "--skip"
    if stage.name == "compiled" and not args.compile:
        return "--no-compile"
    if stage.name == "graphs" and not args.graphs:
        return "--no-graphs"
    if stage.needs_pipeline and report["stages"]["setup"]["status"] != "ok":
        return "setup did not build the pipeline"
    if not stage.required and estimate is not None and elapsed + estimate > args.deadline_s:
        return (f"deadline: needs ~{estimate:.0f} s, {max(0.0, args.deadline_s - elapsed):.0f} s left "
                f"of {args.deadline_s:g} s")
    return None


def _device_name(device: torch.device) -> str:
    if device.type != "cuda":
        return platform.machine()
    try:
        return torch.cuda.get_device_name(device)
    except Exception as e:                       # no CUDA here: setup will fail and say why
        return f"unknown ({type(e).__name__})"


def run(args, out: Output, started: Optional[float] = None) -> dict:
    """Every stage in order, each guarded; the report is written after each. `started`: when the deadline's
    clock started (perf_counter; default now)."""
    started = time.perf_counter() if started is None else started
    elapsed = lambda: time.perf_counter() - started
    c = Check(args, lambda line: out.log(f"[{elapsed():7.1f} s] {line}"))
    preset, device = c.preset, c.device
    cuda = device.type == "cuda" and torch.cuda.is_available()
    report = {
        "check": "lingbot_device_check", "preset": preset.name, "device": str(device),
        "device_name": _device_name(device),
        "torch": torch.__version__, "size": f"{preset.width}x{preset.height}", "dtype": preset.dtype,
        "started_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "deadline_s": args.deadline_s, "steady": args.steady, "elapsed_s": 0.0,
        "compile_tolerance": COMPILE_TOLERANCE,
        "stages": {s.name: {"title": s.title, "status": "pending"} for s in STAGES},
    }
    out.write(report)
    with torch.no_grad():
        for stage in STAGES:
            record = report["stages"][stage.name]
            try:
                estimate = stage.estimate(c)
            except Exception as e:                # an estimate that cannot be made: the stage runs
                estimate = None
                c.progress(f"{stage.name}: no estimate ({type(e).__name__}: {e})")
            reason = _skip_reason(stage, args, report, estimate, elapsed())
            record["estimate_s"] = estimate
            if reason is not None:
                record.update(status="skipped", reason=reason)
                c.progress(f"{stage.name}: skipped ({reason})")
                report["elapsed_s"] = elapsed()
                out.write(report)
                continue
            record.update(status="running", started_s=elapsed())
            report["elapsed_s"] = elapsed()
            out.write(report)
            c.progress(f"{stage.name}: {stage.title} ..."
                       + ("" if estimate is None else f" (estimate {estimate:.0f} s, "
                                                      f"{args.deadline_s - elapsed():.0f} s left)"))
            if cuda:
                _quietly(torch.cuda.reset_peak_memory_stats, device)
            t0 = time.perf_counter()
            try:
                if args.fail_stage == stage.name:
                    _fail_on_purpose(stage.name)
                record["figures"] = stage.run(c)
                record["status"] = "ok"
            except KeyboardInterrupt:
                record.update(status="interrupted", seconds=time.perf_counter() - t0)
                report["elapsed_s"] = elapsed()
                out.write(report)
                raise
            except Exception as e:
                record.update(status="failed", error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc())
                if stage.on_failure is not None:
                    try:
                        stage.on_failure(c)
                    except Exception as cleanup:
                        record["cleanup_error"] = f"{type(cleanup).__name__}: {cleanup}"
            record["seconds"] = time.perf_counter() - t0
            if cuda:
                record["device_peak_bytes"] = _quietly(torch.cuda.max_memory_allocated, device)
            _quietly(_free_memory, device)
            report["elapsed_s"] = elapsed()
            out.write(report)
            c.progress(f"{stage.name}: {record['status']} in {record['seconds']:.1f} s"
                       + (f": {record['error']}" if record["status"] == "failed" else ""))
    return report


# ---------------------------------------------------------------------------------------------------
# the table
# ---------------------------------------------------------------------------------------------------
GIB = 2 ** 30
MODES = {"eager": ("eager_dit", "eager_whole"), "compiled": ("compiled",), "compiled+graphs": ("graphs",)}


def _figures(report: dict, stage: str) -> Optional[dict]:
    record = report["stages"].get(stage, {})
    return record.get("figures") if record.get("status") == "ok" else None


def modes_of(report: dict) -> dict:
    """mode -> the DiT and whole-chunk figures its stages measured (eager's come from two stages)."""
    modes = {}
    for mode, stages in MODES.items():
        merged = {}
        for stage in stages:
            merged.update(_figures(report, stage) or {})
        if merged:
            merged.pop("regions", None)
            modes[mode] = {k: v for k, v in merged.items() if not isinstance(v, list)}
    return modes


def _ms(seconds) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.1f}"


def _gib(nbytes) -> str:
    return "-" if nbytes is None else f"{nbytes / GIB:.3f}"


def _pct(x) -> str:
    return "-" if x is None else f"{x:+.1%}"


def render_table(report: dict) -> str:
    """The markdown for perf/README.md: a heading line, the modes, the checks, the stages."""
    lines = [f"Device check: {report['preset']} {report['size']} {report['dtype']} on {report['device']} "
             f"({report['device_name']}), torch {report['torch']}, {report['started_utc']}; "
             f"{report['elapsed_s']:.0f} s of a {report['deadline_s']:g} s deadline.", ""]
    setup = _figures(report, "setup")
    if setup:
        lines += [f"Build {setup['build_s']:.1f} s; weights {_gib(setup['weights_bytes'])} GiB; matmul peak "
                  f"{setup['matmul_peak_tflops']:.3g} TFLOP/s; steady DiT chunk {setup['dit_chunk_tflop']:.4g} TFLOP.",
                  ""]
    modes = report.get("modes") or modes_of(report)
    if modes:
        lines += ["| mode | DiT warm-up s | DiT 1st chunk s | DiT steady ms | whole steady ms | DiT TFLOP/s | of peak |"
                  " chunk 0 vs eager |",
                  "|---|---:|---:|---:|---:|---:|---:|---|"]
        for mode, m in modes.items():
            tflops = "-" if m.get("dit_tflops") is None else f"{m['dit_tflops']:.3g}"
            frac = "-" if m.get("dit_fraction_of_peak") is None else f"{m['dit_fraction_of_peak']:.1%}"
            warm = "-" if m.get("dit_warmup_s") is None else f"{m['dit_warmup_s']:.1f}"
            first = "-" if m.get("dit_first_chunk_s") is None else f"{m['dit_first_chunk_s']:.2f}"
            versus = "-"
            if "chunk0_relative_diff" in m:
                versus = (f"{m['chunk0_relative_diff']:.2e} ({'within' if m['within_tolerance'] else 'OUTSIDE'} "
                          f"{report['compile_tolerance']:g})")
            lines.append(f"| {mode} | {warm} | {first} | {_ms(m.get('dit_steady_s'))} | "
                         f"{_ms(m.get('whole_steady_s'))} | {tflops} | {frac} | {versus} |")
        lines.append("")
    lines += ["| check | result |", "|---|---|"] + [f"| {k} | {v} |" for k, v in _checks(report, modes)]
    lines += ["", "| stage | status | s | estimate s | note |", "|---|---|---:|---:|---|"]
    for name, r in report["stages"].items():
        note = r.get("reason") or (r.get("error", "").splitlines() or [""])[0][:160]
        seconds = "-" if r.get("seconds") is None else f"{r['seconds']:.1f}"
        estimate = "-" if r.get("estimate_s") is None else f"{r['estimate_s']:.0f}"
        lines.append(f"| {name} | {r['status']} | {seconds} | {estimate} | {note.replace('|', '/')} |")
    return "\n".join(lines) + "\n"


def _checks(report: dict, modes: dict) -> list[tuple[str, str]]:
    rows = []
    setup = _figures(report, "setup")
    if setup:
        trials = ", ".join(f"{t['name']} {t['ms']:.3f} ms" if t["ms"] is not None else f"{t['name']} dropped"
                           for t in setup["attention_trials"])
        rows.append(("attention kernel", f"{setup['attention_kernel']} ({trials})"))
    whole = _figures(report, "eager_whole") or _figures(report, "compiled") or _figures(report, "graphs")
    if whole and whole.get("condition_encode_s"):
        steady = whole.get("condition_encode_steady_s")
        rows.append(("condition encoder until its fixed point",
                     f"fixed point at chunk {whole.get('condition_fixed_point_chunk')}; "
                     f"{_ms(steady)} ms per chunk after chunk 0 (the whole chunks above replay it: "
                     f"{whole['condition_replayed']})"))
    for mode, m in modes.items():
        if "vs_eager_max_abs" in m:
            rows.append((f"{mode} vs eager latents, all chunks", f"max abs diff {m['vs_eager_max_abs']:.2e}"))
    graphs = _figures(report, "graphs")
    if graphs and "graphs_vs_compiled_bitwise" in graphs:
        rows.append(("graph replay vs compiled latents, bitwise", str(graphs["graphs_vs_compiled_bitwise"])))
    no_sync = _figures(report, "no_sync")
    if no_sync:
        rows.append((f"no host sync on the DiT step path ({no_sync['regions']})", no_sync["result"]))
    inter = _figures(report, "interleaving")
    if inter:
        rows.append((f"two sessions interleaved ({inter['regions']}): outputs intact", str(inter["intact"])))
    snap = _figures(report, "snapshots")
    if snap:
        how = "side stream, pinned" if snap["asynchronous"] else "no side stream on this device: a plain copy"
        rows.append((f"snapshot per chunk ({snap['regions']})",
                     f"{_gib(snap['bytes'])} GiB (budget model {_gib(snap['budget_model_bytes'])} GiB); whole chunk "
                     f"{_ms(snap['chunk_s'])} ms alone, {_ms(snap['chunk_sync_snapshot_s'])} ms with a synchronous "
                     f"copy ({_pct(snap['sync_cost'])}), {_ms(snap['chunk_async_snapshot_s'])} ms with the "
                     f"asynchronous one ({_pct(snap['async_cost'])}; {how})"))
        rows.append(("snapshot copy alone, device idle",
                     f"synchronous {_ms(snap['copy_sync_s'])} ms ({snap['copy_sync_gb_per_s']:.1f} GB/s); asynchronous "
                     f"{_ms(snap['copy_async_s'])} ms ({snap['copy_async_gb_per_s']:.1f} GB/s), queued in "
                     f"{_ms(snap['copy_async_queue_s'])} ms; copied during the next chunk, bitwise: "
                     f"{snap['async_bitwise']}"))
    mem = _figures(report, "memory")
    if mem:
        dit, whole_s, budget = mem["dit_session"], mem["whole_session"], mem["budget_model"]
        rows.append(("one DiT session (K/V window + text K/V)",
                     f"owns {_gib(dit['owned_bytes'])} GiB, allocator {_gib(dit['allocated_bytes'])} GiB; "
                     f"budget model {_gib(dit['budget_bytes'])} GiB"))
        rows.append((f"one whole session, max over {whole_s['chunks']} chunks",
                     f"owns {_gib(whole_s['max_owned_bytes'])} GiB, allocator {_gib(whole_s['max_allocated_bytes'])} "
                     f"GiB; budget model {_gib(whole_s['budget_bytes'])} GiB, of it held between chunks "
                     f"{_gib(whole_s['budget_held_bytes'])} GiB"))
        parts = ", ".join(f"{k} {_gib(v)} / {_gib(budget.get(k))}" for k, v in whole_s["parts_max"].items())
        rows.append(("whole session by part, GiB measured / budget model",
                     parts + " (camera modulation: made and dropped within each chunk)"))
    life = _figures(report, "lifecycle")
    if life:
        w, memory = life["warmup"], life["memory"]
        mem_text = "no device memory to measure (the budget rule)" if memory is None else (
            f"free {_gib(memory['free'])} of {_gib(memory['total'])} GiB, peak {_gib(memory['peak'])} GiB")
        rows.append((f"RankLifecycle, {life['layers']} layers at these dims, from safetensors",
                     f"wrote {_gib(life['checkpoint_bytes'])} GiB in {life['write_s']:.1f} s; connect + load "
                     f"{life['connect_and_load_s']:.1f} s; warm-up {w['chunks']} chunks in {w['seconds']:.1f} s "
                     f"(first {w['first_chunk_s']:.2f} s, compiled: {life['compiled']}); kernel "
                     f"{life['attention_kernel']}; {mem_text}; capacity {life['capacity']} sessions "
                     f"(cap {life['capacity_cap']})"))
    if report["preset"] == "lingbot-world-v2-14b" and modes:
        wholes = {k: m["whole_steady_s"] for k, m in modes.items() if m.get("whole_steady_s") is not None}
        fracs = {k: m["dit_fraction_of_peak"] for k, m in modes.items() if m.get("dit_fraction_of_peak") is not None}
        if wholes:
            best = min(wholes, key=wholes.get)
            met = "met" if wholes[best] <= GOAL_WHOLE_CHUNK_S else "not met"
            rows.append((f"goal: whole steady chunk <= {GOAL_WHOLE_CHUNK_S * 1e3:.0f} ms",
                         f"{_ms(wholes[best])} ms ({best}): {met}"))
        if fracs:
            best = max(fracs, key=fracs.get)
            rows.append((f"goal: DiT >= {GOAL_DIT_FRACTION:.0%} of the matmul peak",
                         f"{fracs[best]:.1%} ({best}): {'met' if fracs[best] >= GOAL_DIT_FRACTION else 'not met'}"))
    return [(k, v.replace("|", "/")) for k, v in rows]


# ---------------------------------------------------------------------------------------------------
def _stage_list(text: str) -> list[str]:
    names = [n for n in text.split(",") if n]
    unknown = [n for n in names if n not in STAGE_NAMES]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown stage {unknown[0]!r}; stages: {', '.join(STAGE_NAMES)}")
    return names


def _default_out() -> str:
    if os.environ.get("OUT"):
        return os.environ["OUT"]
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    return os.path.join(tempfile.gettempdir(), f"lingbot-device-check-{stamp}")


def main(argv=None) -> dict:
    started = time.perf_counter()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="lingbot-world-v2-14b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", default=None, help="folder for device_check.json, .md and .log "
                                                "(default: $OUT, else a new folder under the temp directory)")
    ap.add_argument("--deadline-s", type=float, default=DEFAULT_DEADLINE_S,
                    help="a stage whose estimate would end after this many seconds from the start is skipped")
    ap.add_argument("--steady", type=int, default=3, help="steady chunks timed per measurement")
    ap.add_argument("--skip", type=_stage_list, default=[], help=f"stages not to run: {','.join(STAGE_NAMES)}")
    ap.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--graphs", action=argparse.BooleanOptionalAction, default=True,
                    help="also compiled regions as CUDA graphs (on CPU: compiled without graphs)")
    ap.add_argument("--peak-seconds", type=float, default=2.0, help="how long the matmul peak is measured")
    ap.add_argument("--fail-stage", choices=STAGE_NAMES, default=None, help=argparse.SUPPRESS)   # tests only
    args = ap.parse_args(argv)
    if args.steady < 1:
        ap.error("--steady must be >= 1")
    if args.deadline_s <= 0:
        ap.error("--deadline-s must be > 0")
    try:
        get_preset(args.preset)
    except ConfigError as e:
        ap.error(str(e))
    out = Output(args.out or _default_out())
    engine = logging.getLogger("lingbot")
    level = engine.level
    engine.addHandler(out.handler)
    engine.setLevel(logging.INFO)
    try:
        out.log(f"device check: {args.preset} on {args.device}, deadline {args.deadline_s:g} s; "
                f"writing to {out.folder}")
        report = run(args, out, started)
        out.log("")
        out.log(out.table.read_text().rstrip("\n"))
        out.log("")
        out.log(f"wrote {out.json}, {out.table}, {out.log_path}")
    finally:
        engine.removeHandler(out.handler)
        engine.setLevel(level)
        out.close()
    return report


if __name__ == "__main__":
    main()
