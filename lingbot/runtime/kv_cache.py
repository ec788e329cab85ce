"""Per-session caches: the self-attention K/V window (slab layout) and the prompt -> text K/V LRU.

The K/V window (docs/architecture.md, "The K/V slab window"): one fixed slab per layer of
`sliding_window_num_frames` latent frames of K and V (this rank's heads only), allocated once. Keys are
stored after RoPE at absolute positions and attention has no mask inside the window, so a chunk may live in any slot:
chunks 0..5 fill slots 0..5; chunk k >= 6 takes the slot of chunk k-3, which just left the window.
Every forward writes the current chunk into its slot and attends one dense prefix of
min(window, k+1) chunks: no block tables, no gathers, no metadata copies.

A snapshot takes the window one committed chunk at a time (`slot_state`), and a new window is put back
from such slots (`load_slots`), bitwise the window that held them.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable, Mapping

import torch
from torch import Tensor

from ..config import TransformerConfig


def slot_for_chunk(chunk: int, sink_chunks: int, window_chunks: int) -> int:
    """Slab slot of chunk `chunk`: in order while the window fills, then round-robin over the
    non-sink slots (chunk k takes the slot of chunk k - (window_chunks - sink_chunks))."""
    if chunk < window_chunks:
        return chunk
    return sink_chunks + (chunk - sink_chunks) % (window_chunks - sink_chunks)


def visible_chunks(chunk: int, sink_chunks: int, window_chunks: int) -> list[int]:
    """The chunks a forward of `chunk` attends: the sink, the most recent history and itself."""
    recent = window_chunks - sink_chunks
    sink = list(range(min(sink_chunks, chunk)))
    history = list(range(max(sink_chunks, chunk - recent + 1), chunk))
    return sink + history + [chunk]


def check_window(sink_chunks: int, window_chunks: int, model_window_chunks: int) -> None:
    """A session's own K/V window (in chunks): any the model's holds. It must keep the sink, at least one chunk
    of history and the current chunk, and be no larger than the model's (whose slab the memory budget counts);
    ValueError names what is wrong and the served maximum."""
    if sink_chunks < 0:
        raise ValueError(f"the sink may not be negative, got {sink_chunks} chunks")
    if window_chunks > model_window_chunks:
        raise ValueError(f"the window may be at most {model_window_chunks} chunks (the model's), got {window_chunks}")
    if window_chunks < sink_chunks + 2:
        raise ValueError(f"the window ({window_chunks} chunks) must hold the sink ({sink_chunks}), at least one "
                         f"chunk of history and the current chunk")


class KVWindow:
    """Self-attention K/V of one session on one rank: [layers, B, heads, window_tokens, head_dim]. `window`:
    the session's own (sink_chunks, window_chunks), smaller than the model's (check_window); None: the model's.
    A smaller window attends less history (lossy, cheaper) in the model's slab."""

    def __init__(self, config: TransformerConfig, tokens_per_frame: int, heads: int | None = None,
                 batch: int = 1, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 window: tuple[int, int] | None = None):
        self.sink_chunks, self.window_chunks = window or (config.sink_chunks, config.window_chunks)
        check_window(self.sink_chunks, self.window_chunks, config.window_chunks)
        self.chunk_tokens = tokens_per_frame * config.num_frames_per_block
        heads = config.num_attention_heads if heads is None else heads
        # the model's slab whatever the session's window: what the memory budget counts, and the strides every
        # compiled attention was warmed up with (a smaller window attends a prefix of lengths the model's has)
        shape = (config.num_layers, batch, heads, config.window_chunks * self.chunk_tokens, config.attention_head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        self.reset()

    @staticmethod
    def nbytes_for(config: TransformerConfig, tokens_per_frame: int, heads: int, dtype: torch.dtype,
                   batch: int = 1) -> int:
        elems = (2 * config.num_layers * batch * heads * config.sliding_window_num_frames * tokens_per_frame
                 * config.attention_head_dim)
        return elems * torch.empty((), dtype=dtype).element_size()

    def nbytes(self) -> int:
        return 2 * self.keys.numel() * self.keys.element_size()

    def reset(self) -> None:
        """Forget every chunk (the slab memory is kept and overwritten)."""
        self.next_chunk = 0
        self.slot_chunk = [-1] * self.window_chunks   # which committed chunk each slot holds (-1: none)
        self._slot = None
        self._visible_tokens = 0

    def begin_chunk(self, chunk: int) -> None:
        """Prepare the forwards of `chunk` (must be the next one)."""
        assert chunk == self.next_chunk, f"chunk {chunk} out of order; the window expects {self.next_chunk}"
        self._slot = slot_for_chunk(chunk, self.sink_chunks, self.window_chunks)
        self.slot_chunk[self._slot] = -1                   # the evicted chunk (or nothing) is gone now
        self._visible_tokens = min(self.window_chunks, chunk + 1) * self.chunk_tokens

    def update(self, layer: int, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
        """Write this chunk's key/value [B, H, L, D] into its slot; return the visible prefix."""
        assert self._slot is not None, "begin_chunk() was not called"
        assert key.shape[2] == self.chunk_tokens, f"{key.shape[2]} tokens, slab slots hold {self.chunk_tokens}"
        start = self._slot * self.chunk_tokens
        self.keys[layer, :, :, start:start + self.chunk_tokens].copy_(key)
        self.values[layer, :, :, start:start + self.chunk_tokens].copy_(value)
        n = self._visible_tokens
        return self.keys[layer, :, :, :n], self.values[layer, :, :, :n]

    def commit(self) -> None:
        """The last forward of the chunk wrote its final K/V: it is now part of the history."""
        assert self._slot is not None, "commit() without begin_chunk()"
        self.slot_chunk[self._slot] = self.next_chunk
        self.next_chunk += 1
        self._slot = None

    def held_frames(self, frames_per_chunk: int) -> int:
        return sum(1 for c in self.slot_chunk if c >= 0) * frames_per_chunk

    def slot_of(self, chunk: int) -> int:
        """The slot chunk `chunk` is (or will be) written to."""
        return slot_for_chunk(chunk, self.sink_chunks, self.window_chunks)

    def _span(self, slot: int) -> slice:
        return slice(slot * self.chunk_tokens, (slot + 1) * self.chunk_tokens)

    def slot_state(self, chunk: int, copy: Callable[[Tensor], Tensor] = torch.clone) -> tuple[Tensor, Tensor]:
        """Committed chunk `chunk`'s keys and values, [layers, B, heads, chunk_tokens, head_dim] each, through
        `copy`. The slot views are not contiguous (the slot is a span of every layer's window), and the slot is
        written again once the chunk leaves the window: `copy` must copy, not keep the view."""
        slot = self.slot_of(chunk)
        if self.slot_chunk[slot] != chunk:
            raise ValueError(f"chunk {chunk} is not a committed chunk of this window")
        span = self._span(slot)
        return copy(self.keys[:, :, :, span]), copy(self.values[:, :, :, span])

    def load_slots(self, slots: Mapping[int, tuple[Tensor, Tensor]], next_chunk: int) -> None:
        """Forget every chunk, then hold `slots` (chunk -> its keys and values as `slot_state` gives them, on
        any device) as committed, with `next_chunk` the next to come: each chunk goes back to its own slot, so
        the window is bitwise the one they came from. Every chunk must be one that window still held after
        chunk next_chunk - 1. Nothing changes when `slots` are refused."""
        held = visible_chunks(next_chunk - 1, self.sink_chunks, self.window_chunks) if next_chunk > 0 else []
        stale = sorted(c for c in slots if c not in held)
        if stale:
            raise ValueError(f"chunks {stale} are not in the window after chunk {next_chunk - 1}")
        shape = self.keys[:, :, :, self._span(0)].shape             # [layers, B, heads, chunk_tokens, head_dim]
        for chunk, pair in slots.items():                           # copy_ would broadcast or cast silently
            if any(t.shape != shape or t.dtype != self.keys.dtype for t in pair):
                raise ValueError(f"chunk {chunk}: slots of {[(list(t.shape), t.dtype) for t in pair]}, this "
                                 f"window's are {list(shape)} {self.keys.dtype}")
        self.reset()
        for chunk, (keys, values) in slots.items():
            slot = self.slot_of(chunk)
            self.keys[:, :, :, self._span(slot)].copy_(keys)
            self.values[:, :, :, self._span(slot)].copy_(values)
            self.slot_chunk[slot] = chunk
        self.next_chunk = next_chunk


class LRUCache:
    """A small least-recently-used map (prompt -> text K/V) with hit/miss counters; thread-safe (the compute
    of a missing key runs under the lock, so two threads never compute the same prompt twice)."""

    def __init__(self, capacity: int):
        if capacity < 1:
            raise ValueError(f"LRU capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._items: OrderedDict[Hashable, object] = OrderedDict()
        self._lock = threading.RLock()
        self.hits = 0
        self.misses = 0

    def get_or_compute(self, key: Hashable, compute: Callable[[], object]):
        """The value, computed and kept on a miss (values are never None)."""
        with self._lock:
            value = self.get(key)
            if value is None:
                value = compute()
                self.put(key, value)
            return value

    def get(self, key: Hashable):
        """The value (marked most recent), or None."""
        with self._lock:
            if key not in self._items:
                self.misses += 1
                return None
            self.hits += 1
            self._items.move_to_end(key)
            return self._items[key]

    def put(self, key: Hashable, value) -> None:
        with self._lock:
            self._items[key] = value
            self._items.move_to_end(key)
            while len(self._items) > self.capacity:
                self._items.popitem(last=False)

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._items
