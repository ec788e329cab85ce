"""A session's state on one device, copied to the host after each chunk, and put back into a new session.

What a `WorldSession` carries from chunk to chunk: the K/V slab (one slot per chunk), the VAE decoder's
causal cache, the condition encoder's state, the sampler's RNG, the prompt (and a running transition), the
camera rig and the chunk counter. After chunk k, a `SlotSnapshot` holds that chunk's K/V slot and a
`StateSnapshot` everything else. To continue after chunk k a new session needs the slots of the chunks
chunk k+1 will attend (`chunks_to_restore(k)`: the sink chunks and the recent history up to k) and the
state of chunk k: older states are not needed. Restoring them is bitwise the session that ran (the slab is written
slot by slot; every other piece is copied back as it was).

On a sequence-parallel group each rank snapshots its own share (its heads of the slab, its width of the
decoder cache): a snapshot restores the same rank of a group of the same size.

The copy to the host (`HostCopier`) is plain on CPU; on CUDA it is queued on a side stream into pinned
memory and overlaps the session's next chunk.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import Tensor

from ..camera import CameraState
from ..models.vae import CausalCache
from .kv_cache import slot_for_chunk, visible_chunks


def _host(t: Optional[Tensor]) -> Optional[Tensor]:
    return None if t is None else t.detach().to("cpu", copy=True)


class HostCopier:
    """Copies a snapshot's tensors to host memory, for one device.

    On CPU (and NPU) each copy is done when `copy` returns. On CUDA the copies are queued on a side stream
    into pinned memory: `take_snapshot` returns as soon as they are queued, the device goes on with the next
    chunk while the copy engine moves them (at 14B SP-4, 1.8 GiB per rank and chunk), and whoever reads the
    snapshot first waits for `last` (a CUDA event; None on CPU). The sources stay valid meanwhile: the K/V
    slab is written in place only in the slot of the chunk being made, and `before_chunk` makes the device
    wait for a copy still reading that slot; every other piece of a session is replaced, never written in
    place, and its memory is kept from reuse until the side stream is done with it (`record_stream`).
    One thread at a time (the rank's device thread)."""

    def __init__(self, device="cpu"):
        self.device = torch.device(device)
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.pending: dict[object, list] = {}        # session -> [(K/V slot, event)] of copies not seen done
        self.last = None                             # the event of the last snapshot's copies (None: done)

    @property
    def asynchronous(self) -> bool:
        return self.stream is not None

    def begin(self) -> None:
        """Before a snapshot's copies: they see everything the device did so far."""
        self.last = None
        if self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))

    def copy(self, t: Optional[Tensor], by_first_dim: bool = False) -> Optional[Tensor]:
        """`t` on the host. A view that is not contiguous is made contiguous on the device first, into a
        temporary as large as it: with `by_first_dim` (a K/V slot: one layer at a time) the temporary is one
        slice of it (at 14B a layer's 23 MiB instead of the slot's 0.9 GiB, outside the memory budget)."""
        if t is None or self.stream is None or t.device.type != "cuda":
            return _host(t)
        out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        parts = [(out[i], t[i]) for i in range(t.shape[0])] if by_first_dim else [(out, t)]
        with torch.cuda.stream(self.stream):
            for dst, src in parts:
                dst.copy_(src.detach(), non_blocking=True)
        t.record_stream(self.stream)
        return out

    def end(self, session, slot: int) -> None:
        """After a snapshot's copies: `last` is their event; session's chunks writing `slot` wait for it."""
        if self.stream is None:
            return
        self.last = torch.cuda.Event()
        self.last.record(self.stream)
        self.pending.setdefault(session, []).append((slot, self.last))

    def before_chunk(self, session, slot: int) -> None:
        """The device's next chunk of `session` writes K/V slot `slot`: it waits (on the device, the host
        goes on) for a copy that still reads it. Copies seen done are forgotten."""
        pending = [(s, e) for s, e in self.pending.get(session, ()) if not e.query()]
        for s, e in pending:
            if s == slot:
                torch.cuda.current_stream(self.device).wait_event(e)
        if pending:
            self.pending[session] = [(s, e) for s, e in pending if s != slot]
        else:
            self.pending.pop(session, None)

    def forget(self, session) -> None:
        self.pending.pop(session, None)


@dataclass
class SlotSnapshot:
    """Chunk `index`'s K/V slot on one rank, [layers, B, heads, chunk_tokens, head_dim]."""
    index: int
    rank: int
    world_size: int
    keys: Tensor
    values: Tensor

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.keys, self.values))


@dataclass
class StateSnapshot:
    """Everything else of the session on one rank, as it stands after chunk `index`."""
    index: int
    rank: int
    world_size: int
    rng: Tensor                                 # the sampler's generator state
    text: Tensor                                # the text encoder output the current prompt K/V come from
    transition: Optional[tuple[Tensor, Tensor, int, int]]   # (from, to, chunks, done) embeddings
    rig: CameraState
    decoder: dict[str, Tensor]
    condition: dict = field(default_factory=dict)

    def nbytes(self) -> int:
        tensors = [self.rng, self.text, *self.decoder.values(), *self.condition.get("cache", {}).values()]
        extra = (self.condition.get("fixed_latents"), *(self.condition.get("replay") or ()))
        tensors += [t for t in extra if t is not None]
        if self.transition is not None:
            tensors += list(self.transition[:2])
        return sum(t.numel() * t.element_size() for t in tensors)


def chunks_to_restore(index: int, sink_chunks: int, window_chunks: int) -> list[int]:
    """The chunks whose K/V slots a session continuing after chunk `index` attends (oldest first)."""
    return visible_chunks(index + 1, sink_chunks, window_chunks)[:-1]


def take_snapshot(session, rank: int = 0, world_size: int = 1, copier: Optional[HostCopier] = None,
                  key=None) -> tuple[SlotSnapshot, StateSnapshot]:
    """A WorldSession right after its last committed chunk, copied to the host: that chunk's K/V slot, and
    the rest of the state. A continuation needs the slots of chunks_to_restore(k) and the state of k. With
    an asynchronous `copier` (CUDA) the tensors are valid once `copier.last` completed; `key` names the
    session to its `before_chunk`."""
    dit = session.dit
    kv = dit.kv
    index = dit.chunk_index - 1
    if index < 0 or kv.next_chunk != dit.chunk_index:
        raise ValueError("take_snapshot needs a session right after a committed chunk")
    copier = copier or HostCopier()
    host = copier.copy
    slot_index = slot_for_chunk(index, kv.sink_chunks, kv.window_chunks)
    span = slice(slot_index * kv.chunk_tokens, (slot_index + 1) * kv.chunk_tokens)
    copier.begin()
    transition = None
    if dit._transition is not None:
        start, target, total, done = dit._transition
        transition = (host(start.embedding), host(target.embedding), total, done)
    cond = session.condition
    condition = {"committed": cond.committed_chunks, "fixed_point_chunk": cond.fixed_point_chunk,
                 "fixed_latents": host(cond.fixed_latents),
                 "cache": {k: host(v) for k, v in cond.cache.entries.items()},
                 "replay": tuple(host(t) for t in cond.replay) if cond.replay is not None else None}
    slot = SlotSnapshot(index, rank, world_size, host(kv.keys[:, :, :, span], by_first_dim=True),
                        host(kv.values[:, :, :, span], by_first_dim=True))
    state = StateSnapshot(index, rank, world_size, dit.generator.get_state().clone(), host(dit.text.embedding),
                          transition, dit.rig.state, {k: host(v) for k, v in session.decoder_cache.entries.items()},
                          condition)
    copier.end(key, slot_index)
    return slot, state


def restore_snapshots(session, slots: list[SlotSnapshot], newest: StateSnapshot, rank: int = 0,
                      world_size: int = 1) -> None:
    """Put a fresh WorldSession (same image, prompt, seed, camera path and flow shift) where the session the
    snapshots came from was after chunk `newest.index`. `slots` must cover chunks_to_restore(newest.index)."""
    dit, kv = session.dit, session.dit.kv
    by_index = {s.index: s for s in slots}
    needed = chunks_to_restore(newest.index, kv.sink_chunks, kv.window_chunks)
    missing = [c for c in needed if c not in by_index]
    if missing:
        raise ValueError(f"snapshots of chunks {missing} are missing to continue after chunk {newest.index}")
    if any((s.rank, s.world_size) != (rank, world_size) for s in [*slots, newest]):
        raise ValueError(f"snapshots of another rank or group size than rank {rank} of {world_size}")
    if dit.chunk_index != 0:
        raise ValueError("restore_snapshots needs a session that has not run a chunk")
    device, model = kv.keys.device, dit.runner.model
    kv.reset()
    for chunk in needed:
        slot = slot_for_chunk(chunk, kv.sink_chunks, kv.window_chunks)
        span = slice(slot * kv.chunk_tokens, (slot + 1) * kv.chunk_tokens)
        kv.keys[:, :, :, span].copy_(by_index[chunk].keys.to(device))
        kv.values[:, :, :, span].copy_(by_index[chunk].values.to(device))
        kv.slot_chunk[slot] = chunk
    kv.next_chunk = newest.index + 1
    dit.chunk_index = newest.index + 1
    dit.generator.set_state(newest.rng)
    dit.text = model.text_kv(newest.text.to(device))
    if newest.transition is not None:
        start, target, total, done = newest.transition
        dit._transition = (model.text_kv(start.to(device)), model.text_kv(target.to(device)), total, done)
    else:
        dit._transition = None
    dit.rig.state = newest.rig
    session.decoder_cache = CausalCache({k: v.to(device) for k, v in newest.decoder.items()})
    cond, c = session.condition, newest.condition
    cond.committed_chunks = c["committed"]
    cond.fixed_point_chunk = c["fixed_point_chunk"]
    cond.fixed_latents = None if c["fixed_latents"] is None else c["fixed_latents"].to(cond.image.device)
    cond.cache = CausalCache({k: v.to(cond.image.device) for k, v in c["cache"].items()})
    cond.replay = None if c["replay"] is None else tuple(t.to(cond.image.device) for t in c["replay"])
    cond.history, cond._pending = [], None
