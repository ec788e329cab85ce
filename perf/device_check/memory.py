"""The device check's stages about what a session holds and where it goes: snapshots (what a deployment on
this host does with them, `host_plan`; their copies against the chunk, synchronous and asynchronous), one
session's memory measured and predicted part by part (`held_bytes`), and RankLifecycle run from a
safetensors folder of a few layers (`few_layer_preset`)."""
from __future__ import annotations

import dataclasses
import gc
import tempfile
import time
import types
from pathlib import Path

import numpy as np
import torch

from lingbot.config import Preset, TextEncoderConfig
from lingbot.io.weights import write_random_checkpoint
from lingbot.lifecycle import RankLifecycle
from lingbot.runtime.budget import session_footprint
from lingbot.runtime.compile import compile_default
from lingbot.runtime.condition import LatentCondition
from lingbot.runtime.snapshot import HostCopier, take_snapshot
from lingbot.runtime.snapshot_budget import default_host_budget, plan_snapshots, snapshot_footprint, snapshot_host
from perf.timing import sync, time_chunks, timed, whole_chunk

from .check import KEYS, LIFECYCLE_LAYERS, LIFECYCLE_MAX_SESSIONS, Check, _allocated, _free_memory
from .timing import _prime_conditions


def _snapshot_tensors(snapshot) -> list:
    slots, state = snapshot
    return [t for slot in slots for t in slot.tensors()] + state.tensors()


def host_plan(c: Check) -> dict:
    """What a deployment of this preset at SP-1 on this host does with its sessions' snapshots (one group
    holding the node's accelerators: the default share of the whole host), from the budget model alone."""
    host = snapshot_host(c.preset, 1, 1, cuda=c.device.type == "cuda")
    node = c.host_memory_bytes
    plan = plan_snapshots(host, default_host_budget(node), node)
    return {"host_memory_bytes": node, "host_budget_bytes": plan.budget, "host_sessions": plan.sessions,
            "host_first_session_bytes": plan.first_session, "host_per_session_bytes": plan.per_session,
            "host_plan": plan.summary()}


def stage_snapshots(c: Check) -> None:
    """What a deployment on this host does with snapshots (`host_plan`); then the steady whole chunk with no
    snapshot, a synchronous one and an asynchronous one after each (median of `steady` each); the copies
    alone with the device idle; then one asynchronous snapshot copied while the next chunk runs, against a
    synchronous snapshot of the same moment. Per chunk: the bytes copied (the K/V slot and the state, against
    the budget's, lingbot/runtime/snapshot_budget.py), the copy's time and what it adds to the chunk; and the
    copy time of the budget's largest snapshot at the measured rate (the session here replays its first
    frame's conditions: it holds no encoder cache). Each copier copies once before anything is timed, so
    that pinning the host memory on first touch lands in no timed copy."""
    c.keep(**host_plan(c))
    if not c.conditions_primed:
        _prime_conditions(c)
    session = c.pipe.new_session(c.image, None, seed=0, text_embedding=c.text)
    for _ in range(2):
        session.step(KEYS)
    sync_copier, async_copier = HostCopier("cpu"), HostCopier(c.device)
    take_snapshot(session, copier=sync_copier)
    take_snapshot(session, copier=async_copier, key="check")
    if async_copier.last is not None:
        async_copier.last.synchronize()
    sync(c.device)

    def period(after) -> float:
        """The median whole chunk followed by `after()`; the device synchronised only around the `steady`
        chunks, so an asynchronous copy runs on under the next chunk, as on a rank."""
        return time_chunks(lambda: (whole_chunk(session, KEYS), after()), c.steady, c.device,
                           sync_each=False).median(0)

    alone = period(lambda: None)
    synchronous = period(lambda: take_snapshot(session, copier=sync_copier))
    asynchronous = period(lambda: take_snapshot(session, copier=async_copier, key="check"))
    c.keep(regions=c.mode, asynchronous=async_copier.asynchronous, chunk_s=alone, chunk_sync_snapshot_s=synchronous,
           chunk_async_snapshot_s=asynchronous, sync_cost=synchronous / alone - 1, async_cost=asynchronous / alone - 1)
    # the synchronous copy alone, the device idle; then an asynchronous one of the same moment, queued
    # (pinned buffers, side stream) and left to run under the next chunk
    copy_sync_s, reference = timed(c.device, lambda: take_snapshot(session, copier=sync_copier))
    t0 = time.perf_counter()
    copied = take_snapshot(session, copier=async_copier, key="check")
    queue_s = time.perf_counter() - t0
    session.step(KEYS)                                  # the next chunk runs while the copy goes on
    if async_copier.last is not None:
        async_copier.last.synchronize()
    pairs = list(zip(_snapshot_tensors(reference), _snapshot_tensors(copied)))
    exact = len(pairs) == len(_snapshot_tensors(reference)) and all(torch.equal(a, b) for a, b in pairs)
    del copied                                          # as a rank's, put and gone: the next copies it all
    # the asynchronous copy alone, the device idle: from the call to the copy engine's last byte
    sync(c.device)
    t0 = time.perf_counter()
    take_snapshot(session, copier=async_copier, key="check")
    if async_copier.last is not None:
        async_copier.last.synchronize()
    copy_async_s = time.perf_counter() - t0
    slot_bytes, state_bytes = sum(slot.nbytes() for slot in reference[0]), reference[1].nbytes()
    nbytes = slot_bytes + state_bytes
    budget = snapshot_footprint(c.preset)
    rate = nbytes / copy_async_s if async_copier.asynchronous else nbytes / copy_sync_s
    c.keep(bytes=nbytes, slot_bytes=slot_bytes, state_bytes=state_bytes, budget_slot_bytes=budget.slot,
           budget_state_bytes=budget.state, budget_model_bytes=budget.per_chunk, budget_held_bytes=budget.held,
           budget_copy_s=budget.per_chunk / rate, budget_copy_fraction_of_chunk=budget.per_chunk / rate / alone,
           copy_sync_s=copy_sync_s, copy_async_s=copy_async_s, copy_async_queue_s=queue_s,
           copy_sync_gb_per_s=nbytes / copy_sync_s / 1e9, copy_async_gb_per_s=nbytes / copy_async_s / 1e9,
           async_bitwise=exact)


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


def stage_memory(c: Check) -> None:
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
    c.keep(regions=c.mode, budget_model=budget, dit_session=dit_figures)
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
    c.keep(whole_session=whole)


def few_layer_preset(preset: Preset, layers: int = LIFECYCLE_LAYERS) -> Preset:
    """`preset` at its own dims with `layers` DiT blocks, and a one-layer text encoder as wide as the DiT
    reads (byte vocabulary, narrow attention and FFN): a checkpoint folder of ~1.5 GB at 14B dims, not ~60."""
    t = preset.text
    text = TextEncoderConfig(max_length=t.max_length, vocab_size=259, d_model=t.d_model, d_kv=min(t.d_kv, 64),
                             d_ff=min(t.d_ff, 1024), num_layers=1, num_heads=min(t.num_heads, 8))
    return dataclasses.replace(preset, name=f"{preset.name}-{layers}-layers", text=text, weights_seed=0,
                               transformer=dataclasses.replace(preset.transformer, num_layers=layers))


def stage_lifecycle(c: Check) -> None:
    """RankLifecycle as a serving rank runs it, compile as the serving default (on for accelerators), on a
    folder of LIFECYCLE_LAYERS blocks: its capacity is that model's, not the preset's. The main model is
    freed first, so the rank measures the device as a rank would find it."""
    if c.pipe is not None:
        c.to_eager()
        c.pipe = c.text = c.latents = None
        c.latents_by_mode.clear()
        _free_memory(c.device)
    preset = few_layer_preset(c.preset)
    c.keep(layers=LIFECYCLE_LAYERS, compiled=compile_default(c.device), capacity_cap=LIFECYCLE_MAX_SESSIONS,
           session_budget_bytes=session_footprint(preset).total)
    with tempfile.TemporaryDirectory(prefix="lingbot-device-check-") as folder:
        t0 = time.perf_counter()
        write_random_checkpoint(preset, folder, seed=0)
        write_s = time.perf_counter() - t0
        nbytes = sum(p.stat().st_size for p in Path(folder).rglob("*") if p.is_file())
        c.progress(f"  wrote {nbytes / 2 ** 30:.2f} GiB of safetensors in {write_s:.1f} s")
        c.keep(checkpoint_bytes=nbytes, write_s=write_s)
        life = RankLifecycle(rank=0, world_size=1, device=c.device)
        t0 = time.perf_counter()
        life.connect(None, timeout_s=60)
        life.load(preset, folder)
        sync(c.device)
        load_s = time.perf_counter() - t0
        c.progress(f"  connected and loaded in {load_s:.1f} s")
        c.keep(connect_and_load_s=load_s, loaded_bytes=life.loaded_bytes)
        warmup = life.warm_up()
        c.keep(warmup=dataclasses.asdict(warmup), attention_kernel=life.attention_kernel)
        memory = life.measure()
        c.keep(memory=None if memory is None else dataclasses.asdict(memory))
        c.keep(capacity=life.capacity(LIFECYCLE_MAX_SESSIONS))
