"""A session's state on one device, copied to the host after a chunk, and put back into a new session.

What a `WorldSession` carries from chunk to chunk: the K/V slab (one slot per chunk), the VAE decoder's
causal cache, the condition encoder's state, the sampler's RNG, the prompt (and a running transition), the
camera rig and the chunk counter. Each owner gives its own part and takes it back: the K/V window one
committed chunk's slot at a time (`KVWindow.slot_state` / `load_slots`), the session everything else
(`WorldSession.state_dict` / `load_state`, which ask the DiT session, the condition encoder and the decoder
cache for theirs). This module only composes them: a snapshot after chunk k is `SlotSnapshot`s of K/V slots
and a `StateSnapshot` of the rest. To continue after chunk k a new session needs the slots of the chunks
chunk k+1 will attend (`chunks_to_restore(k)`: the sink chunks and the recent history up to k) and the
state of k: older states are not needed. Restoring them is bitwise the session that ran (the slab is
written slot by slot; every other piece is copied back as it was).

What a snapshot copies (only what changed since the session's previous snapshot, where that can be told):
- K/V slots: a committed chunk's slot is never written again while the chunk is in the window, so each is
  copied once, by the first snapshot after its chunk that still needs it (`slots_to_copy`): with a snapshot
  after every chunk, that chunk's slot alone; with one every k chunks, the slots of the chunks since the
  last one that the continuation attends (at most 2 recent ones for LingBot-World, fewer than k once the
  window is full). A slot whose chunk left the window before any snapshot needed it is never copied.
- the state: copied whole, since its bulk changes with every chunk (the decoder cache, 3.5 GiB per chunk at
  14B on one device: the last frames of every causal conv's input; and until the condition's fixed point
  the encoder cache, 2 GiB). A tensor of it that is the very object the session's previous snapshot copied,
  unwritten since (the prompt's text embedding, the condition's fixed or replayed latents: a few MiB) is
  not copied again: the new snapshot shares the earlier host copy (`HostCopier`, per session key).

On a sequence-parallel group each rank snapshots its own share (its heads of the slab, its width of the
decoder cache; the encoder cache lives on rank 0 only): a snapshot restores the same rank of a group of the
same size. Sizes per preset and group: lingbot/runtime/snapshot_budget.py (`lingbot snapshot-budget`).

The copy to the host (`HostCopier`) is plain on CPU; on CUDA it is queued on a side stream into pinned
memory and overlaps the session's next chunk. The owners copy each tensor through the copier's `copy`.
"""
from __future__ import annotations

import weakref
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from .kv_cache import visible_chunks

SNAPSHOTS_IN_FLIGHT = 2     # per session and rank: snapshots taken and not yet reported stored, at most


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

    What did not change is not copied again: a tensor met twice in one snapshot is copied once, and a tensor
    that is the very object the session's previous snapshot copied (same object, its version counter not
    moved: nothing wrote it) shares that copy while the copy is still alive (the previous snapshot still on
    its way to the keeper). The copier holds only weak references: keeping host copies from one snapshot to
    the next to save the few MiB that stay the same (at 14B the text embedding, 4 MiB, and the condition's
    latents, up to 19 MiB: under 0.3% of a snapshot) would hold a whole state of host memory per session,
    since it cannot tell which tensors will stay unchanged.
    One thread at a time (the rank's device thread)."""

    def __init__(self, device="cpu"):
        self.device = torch.device(device)
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.pending: dict[object, list] = {}        # session -> [(K/V slot, event)] of copies not seen done
        self.last = None                             # the event of the last snapshot's copies (None: done)
        self.copies: dict[object, dict] = {}         # session -> its last snapshot's {id(source): _Copied}
        self._session = None                         # the snapshot being taken: its session and copies
        self._taking: dict[int, _Copied] = {}
        self.reused_bytes = 0                        # bytes not copied again (reports and tests)

    @property
    def asynchronous(self) -> bool:
        return self.stream is not None

    def begin(self, session=None) -> None:
        """Before a snapshot's copies (of `session`: a key, None for none): they see everything the device
        did so far."""
        self.last = None
        self._session, self._taking = session, {}
        if self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))

    def copy(self, t: Optional[Tensor], by_first_dim: bool = False) -> Optional[Tensor]:
        """`t` on the host. A view that is not contiguous is made contiguous on the device first, into a
        temporary as large as it: with `by_first_dim` (a K/V slot: one layer at a time) the temporary is one
        slice of it (at 14B a layer's 23 MiB instead of the slot's 0.9 GiB, outside the memory budget)."""
        if t is None:
            return None
        out = self._unchanged(t)
        if out is not None:
            self.reused_bytes += out.nbytes
            return out
        if self.stream is None or t.device.type != "cuda":
            out = _host(t)
        else:
            out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            parts = [(out[i], t[i]) for i in range(t.shape[0])] if by_first_dim else [(out, t)]
            with torch.cuda.stream(self.stream):
                for dst, src in parts:
                    dst.copy_(src.detach(), non_blocking=True)
            t.record_stream(self.stream)
        self._taking[id(t)] = _Copied(weakref.ref(t), t._version, weakref.ref(out))
        return out

    def _unchanged(self, t: Tensor) -> Optional[Tensor]:
        """The live host copy of `t` made by this snapshot or by its session's previous one, when `t` is the
        very tensor copied and nothing wrote it since; else None."""
        for seen in (self._taking, self.copies.get(self._session) if self._session is not None else None):
            entry = None if seen is None else seen.get(id(t))
            if entry is not None and entry.source() is t and entry.version == t._version:
                out = entry.copy()
                if out is not None:
                    self._taking[id(t)] = entry
                    return out
        return None

    def end(self, session, slots: Iterable[int] = ()) -> None:
        """After a snapshot's copies: `last` is their event; session's chunks writing any of `slots` (the K/V
        slots it copied) wait for it."""
        if session is not None:
            self.copies[session] = self._taking
        self._session, self._taking = None, {}
        if self.stream is None:
            return
        self.last = torch.cuda.Event()
        self.last.record(self.stream)
        self.pending.setdefault(session, []).extend((slot, self.last) for slot in slots)

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
        self.copies.pop(session, None)


@dataclass(frozen=True)
class _Copied:
    """A tensor a snapshot copied: weak references to it and to its host copy, and its version then."""
    source: weakref.ref
    version: int
    copy: weakref.ref


def _tensors(state) -> Iterator[Tensor]:
    """The tensors in a state (nested dicts, tuples and lists; anything else, e.g. the camera state, is not
    a tensor the snapshot copied)."""
    if isinstance(state, Tensor):
        yield state
    elif isinstance(state, dict):
        for value in state.values():
            yield from _tensors(value)
    elif isinstance(state, (tuple, list)):
        for value in state:
            yield from _tensors(value)


@dataclass
class SlotSnapshot:
    """Chunk `index`'s K/V slot on one rank, [layers, B, heads, chunk_tokens, head_dim]."""
    index: int
    rank: int
    world_size: int
    keys: Tensor
    values: Tensor

    def tensors(self) -> list[Tensor]:
        return [self.keys, self.values]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())


@dataclass
class StateSnapshot:
    """Everything else of the session on one rank, as it stands after chunk `index`: `state` is
    `WorldSession.state_dict()` ({"dit", "condition", "decoder"}: each owner's own)."""
    index: int
    rank: int
    world_size: int
    state: dict

    def tensors(self) -> list[Tensor]:
        """Every tensor of the state, in a fixed order (two snapshots of one moment list theirs alike)."""
        return list(_tensors(self.state))

    def nbytes(self) -> int:
        """Bytes of its distinct tensors (a tensor met twice is held, and pickled, once)."""
        return sum(t.numel() * t.element_size() for t in {id(t): t for t in self.tensors()}.values())


def chunks_to_restore(index: int, sink_chunks: int, window_chunks: int) -> list[int]:
    """The chunks whose K/V slots a session continuing after chunk `index` attends (oldest first)."""
    return visible_chunks(index + 1, sink_chunks, window_chunks)[:-1]


def slots_to_copy(index: int, since: int, sink_chunks: int, window_chunks: int) -> list[int]:
    """The chunks whose K/V slots a snapshot after chunk `index` copies when the session's previous snapshot
    was after chunk `since` (-1: none): those a continuation after `index` attends that no earlier snapshot
    copied. A committed chunk's slot stays as it was while the chunk is in the window, so the earlier copies
    still hold: e.g. every 3 chunks (window 6, sink 3), chunk 3 copies 1-3, chunk 6 copies 5 and 6 (4 has
    left the window), chunk 9 copies 8 and 9."""
    return [c for c in chunks_to_restore(index, sink_chunks, window_chunks) if c > since]


def take_snapshot(session, rank: int = 0, world_size: int = 1, copier: Optional[HostCopier] = None,
                  key=None, since: Optional[int] = None) -> tuple[list[SlotSnapshot], StateSnapshot]:
    """A WorldSession right after its last committed chunk k, copied to the host: the K/V slots of
    slots_to_copy(k, since) (oldest first; `since`, the chunk of the session's previous snapshot, defaults to
    k - 1: chunk k's slot alone, as after every chunk), and the rest of the state. A continuation needs the
    slots of chunks_to_restore(k), from this snapshot and earlier ones, and the state of k. With an
    asynchronous `copier` (CUDA) the tensors are valid once `copier.last` completed; `key` names the session
    to the copier (its `before_chunk`, and what its previous snapshot copied)."""
    index = session.chunk_index - 1
    if index < 0:
        raise ValueError("take_snapshot needs a session right after a committed chunk")
    kv = session.dit.kv
    chunks = slots_to_copy(index, index - 1 if since is None else since, kv.sink_chunks, kv.window_chunks)
    copier = copier or HostCopier()
    copier.begin(key)
    try:
        state = session.state_dict(copy=copier.copy)       # refuses a session not at one chunk, before copying
        # the slots' views are strided over the whole slab: made contiguous one layer at a time
        slots = [SlotSnapshot(c, rank, world_size,
                              *kv.slot_state(c, copy=lambda t: copier.copy(t, by_first_dim=True))) for c in chunks]
    finally:
        copier.end(key, [kv.slot_of(c) for c in chunks])  # the next chunk writing those slots waits for the copy
    return slots, StateSnapshot(index, rank, world_size, state)


def restore_snapshots(session, slots: list[SlotSnapshot], newest: StateSnapshot, rank: int = 0,
                      world_size: int = 1) -> None:
    """Put a fresh WorldSession (same image, prompt, seed, camera path and flow shift) where the session the
    snapshots came from was after chunk `newest.index`. `slots` must cover chunks_to_restore(newest.index)."""
    kv = session.dit.kv
    by_index = {s.index: s for s in slots}
    needed = chunks_to_restore(newest.index, kv.sink_chunks, kv.window_chunks)
    missing = [c for c in needed if c not in by_index]
    if missing:
        raise ValueError(f"snapshots of chunks {missing} are missing to continue after chunk {newest.index}")
    if any((s.rank, s.world_size) != (rank, world_size) for s in [*slots, newest]):
        raise ValueError(f"snapshots of another rank or group size than rank {rank} of {world_size}")
    if session.chunk_index != 0:
        raise ValueError("restore_snapshots needs a session that has not run a chunk")
    if not isinstance(getattr(newest, "state", None), dict):    # unpickled from a version with other fields
        raise ValueError("a state snapshot of another version of this module")
    kv.load_slots({c: (by_index[c].keys, by_index[c].values) for c in needed}, next_chunk=newest.index + 1)
    session.load_state(newest.state)
