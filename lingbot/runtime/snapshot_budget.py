"""What keeping sessions resumable costs in host memory (docs/architecture.md, "Sessions that survive faults").

Per rank and session, from the config alone as the device budget is (budget.py), each part at its largest
over a session's life, and checked against the snapshots a real session takes (tests, at SP-1 and SP-2):
- a snapshot: the K/V slots it copies (`slots_to_copy`: one per chunk when every chunk is snapshotted) and
  the state: the decoder cache (this rank's columns, with their halo under SP), the condition encoder's
  cache until its fixed point (rank 0 only under SP; or a replayed first frame's latents), the prompt's
  text embedding (three during a prompt transition) and the RNG;
- held by the keeper for a continuation: the slots it attends (the sink and the recent history,
  `window_chunks - 1`) and the newest state; plus the snapshots on their way, at most `SNAPSHOTS_IN_FLIGHT`
  per session and rank (stored, not yet in the ingress's ledger);
- once per rank, whatever its sessions: its host copies not yet put, at most `SNAPSHOTS_IN_FLIGHT` (on CUDA
  pinned memory from torch's caching host allocator, which rounds every block up to a power of two and
  keeps it cached: the pool stays at its high-water mark), and the put in progress (one at a time), whose
  arguments sit in the object store while the keeper holds their deserialized copy to put it again.
Not counted: a snapshot after a lost put copies the whole set of slots a continuation attends once (the
keeper's failure that loses a put usually frees far more: every snapshot it held).

`SnapshotHost` adds these up for a group (every rank: they share one node) and tells how many sessions a
host budget holds; `plan_snapshots` decides what the group does on that budget (`SnapshotPlan`: snapshots
for the first sessions it holds, or none at all when it holds not one). `lingbot snapshot-budget` prints
them for every preset and SP degree.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

import torch

from ..config import Preset, tae_dtype
from .budget import condition_chunk_bytes, latent_ring_entries, tae_cache_entries, vae_cache_entries
from .condition import CONDITION_CACHE_CHUNKS
from .kv_cache import KVWindow
from .snapshot import SNAPSHOTS_IN_FLIGHT

GIB = 2 ** 30
SNAPSHOT_HOST_SHARE = 0.3    # of a node's memory by default: Ray's default object store, where the keeper puts them
# A budget beyond this part of the node would leave too little for what else the node runs (the ranks'
# processes and their pinned pools, Ray, the page cache a load reads the weights through).
SNAPSHOT_HOST_MAX_SHARE = 0.5
RNG_STATE_BYTES = torch.Generator().get_state().numel()    # the CPU generator's 5 KiB (a CUDA one's is 16 bytes)


def _pinned(nbytes: int) -> int:
    """The pinned block torch's caching host allocator gives a tensor of `nbytes`: the next power of two."""
    return 1 << max(0, nbytes - 1).bit_length()


@dataclass(frozen=True)
class SnapshotFootprint:
    """One rank's snapshots of one session, in host bytes, each part at its largest. The parts are lists of
    the tensors' bytes (what the pinned allocator sees); `interval`: snapshot_interval_chunks."""
    kv_slot: tuple[int, ...]            # one chunk's K/V slot, this rank's heads: keys and values
    decoder_cache: tuple[int, ...]      # the VAE decoder's causal cache, this rank's columns (haloed under SP)
    condition: tuple[int, ...]          # the encoder's causal cache (rank 0) or a replayed first frame's latents
    text: tuple[int, ...]               # the prompt's text embedding, and a running transition's start and target
    rng: int                            # the sampler's RNG state (a host tensor already: never pinned)
    restore_slots: int                  # slots a continuation attends (sink + recent history)
    snapshot_slots: int                 # slots one snapshot copies at most
    steady_slots: int                   # slots one snapshot copies once the window is full
    interval: int
    ring: tuple[int, ...] = ()          # the latents of the last chunks, kept to switch decoders (every rank)

    @property
    def slot(self) -> int:
        return sum(self.kv_slot)

    @property
    def state(self) -> int:
        return sum(self.decoder_cache) + sum(self.condition) + sum(self.text) + sum(self.ring) + self.rng

    @property
    def snapshot(self) -> int:
        """The most one snapshot copies off the device (its first, or the first after a lost put)."""
        return self.snapshot_slots * self.slot + self.state

    @property
    def per_chunk(self) -> float:
        """Copied off the device per chunk once the window is full: a snapshot every `interval` chunks."""
        return (self.steady_slots * self.slot + self.state) / self.interval

    @property
    def held(self) -> int:
        """What the keeper holds for a continuation: the slots it attends and the newest state."""
        return self.restore_slots * self.slot + self.state

    def pinned(self, cuda: bool = True) -> int:
        """Host memory of one snapshot's copies on the rank: power-of-two pinned blocks on CUDA, else as is."""
        blocks = [*self.kv_slot * self.snapshot_slots, *self.decoder_cache, *self.condition, *self.text, *self.ring]
        return sum(map(_pinned, blocks) if cuda else blocks) + self.rng


def snapshot_footprint(preset: Preset, world_size: int = 1, rank: int = 0, interval: int = 1, decoder: str = "wan",
                       device: torch.device | str = "cpu", decoders: Sequence[str] = ()) -> SnapshotFootprint:
    """Rank `rank` of a group of `world_size` (rank 0 is the fullest: it holds the condition encoder's cache);
    `decoder`: the session's frame decoder (the tiny one's cache is on the root alone, in its dtype on
    `device`); `decoders`: those loaded (with both, a session keeps a ring of latents to switch between them)."""
    if interval < 1:
        raise ValueError(f"snapshot interval must be >= 1 chunk, got {interval}")
    cfg = preset.transformer
    slot = KVWindow.nbytes_for(cfg, preset.tokens_per_frame, cfg.num_attention_heads // world_size,
                               preset.torch_dtype) // cfg.window_chunks // 2
    wan, encoder = vae_cache_entries(preset, world_size, rank)
    decoded = wan if decoder == "wan" else (tae_cache_entries(preset, tae_dtype(device)) if rank == 0 else [])
    replay = [condition_chunk_bytes(preset)] * CONDITION_CACHE_CHUNKS      # its last is also the fixed latents
    condition = encoder if rank == 0 and sum(encoder) > sum(replay) else replay
    text = [cfg.text_dim * preset.text.max_length * torch.empty((), dtype=preset.torch_dtype).element_size()] * 3
    restore = cfg.window_chunks - 1
    recent = cfg.window_chunks - cfg.sink_chunks - 1            # history chunks besides the sink a continuation attends
    ring = latent_ring_entries(preset, decoders or (decoder,))
    return SnapshotFootprint((slot, slot), tuple(decoded), tuple(condition), tuple(text), RNG_STATE_BYTES,
                             restore, min(interval, restore), min(interval, recent), interval, ring)


@dataclass(frozen=True)
class SnapshotHost:
    """A group's snapshots on the host, every rank's: `per_session` (what the keeper holds for a session,
    with its snapshots on their way) and `once` (per rank, whatever its sessions: its host copies waiting
    for the put thread, and the put in progress)."""
    ranks: tuple[SnapshotFootprint, ...]
    in_flight: int
    cuda: bool

    @property
    def per_session(self) -> int:
        """In the keeper's object store: the continuation's set and up to `in_flight` snapshots stored and
        not yet in the ingress's ledger."""
        return sum(r.held + self.in_flight * r.snapshot for r in self.ranks)

    @property
    def copies(self) -> int:
        """In the ranks' processes: up to `in_flight` snapshots copied and not yet put (a rank takes no more,
        whatever its sessions), in pinned blocks the caching allocator keeps."""
        return sum(self.in_flight * r.pinned(self.cuda) for r in self.ranks)

    @property
    def staged(self) -> int:
        """The put in progress on each rank (one at a time): its arguments in the object store, and the
        keeper's deserialized copy of them, which it puts again."""
        return sum(2 * r.snapshot for r in self.ranks)

    @property
    def once(self) -> int:
        return self.copies + self.staged

    def for_sessions(self, sessions: int) -> int:
        return self.once + sessions * self.per_session

    def sessions_within(self, budget_bytes: int) -> int:
        """Sessions whose snapshots fit in `budget_bytes`."""
        return max(0, (budget_bytes - self.once) // self.per_session)


def snapshot_host(preset: Preset, world_size: int = 1, interval: int = 1, cuda: bool = True,
                  in_flight: int = SNAPSHOTS_IN_FLIGHT, decoders: Sequence[str] = ("wan",)) -> SnapshotHost:
    """`decoders`: those the ranks loaded; a session's snapshots are counted with the Wan decoder's cache (the
    larger) and, with both loaded, the ring of latents it keeps to switch between them."""
    return SnapshotHost(tuple(snapshot_footprint(preset, world_size, r, interval, decoders=decoders)
                              for r in range(world_size)), in_flight, cuda)


def default_host_budget(node_memory: int, group_share: float = 1.0) -> int:
    """The host bytes a group's snapshots may use when its settings do not say (snapshot_host_budget_gib
    unset): SNAPSHOT_HOST_SHARE of its node's memory, times the group's part of the node's accelerators."""
    return int(SNAPSHOT_HOST_SHARE * node_memory * group_share)


@dataclass(frozen=True)
class SnapshotPlan:
    """What a group does with its sessions' snapshots on a host budget: the first `sessions` to open keep
    them, the others resume by replaying their journal. With none (`enabled` false) the group takes no
    snapshot at all, and says so once when it starts: on one H200 with a 128 GiB host, a 14B SP-1 session's
    snapshots take 88 GiB (46 once, 42 per session) against a default share of 38, so every session resumes
    by replay. A budget large enough for one (`first_session`) would be over SNAPSHOT_HOST_MAX_SHARE of that
    host: none is worth it there, and the ranks save the copy of 9 GiB per chunk that nobody would keep."""
    budget: int
    sessions: int
    first_session: int            # host bytes the first session's snapshots take: the ranks' once and its own
    per_session: int              # and each session after it
    node_memory: Optional[int] = None

    @property
    def enabled(self) -> bool:
        return self.sessions > 0

    @property
    def host_can_hold_one(self) -> Optional[bool]:
        """Whether a budget for one session stays within SNAPSHOT_HOST_MAX_SHARE of the node (None: unknown)."""
        if self.node_memory is None:
            return None
        return self.first_session <= SNAPSHOT_HOST_MAX_SHARE * self.node_memory

    def summary(self) -> str:
        """One line for the group's log at start (and the device check's report)."""
        budget = f"the budget is {_size(self.budget)}"
        if self.enabled:
            return (f"snapshots for {self.sessions} session{'s' if self.sessions > 1 else ''} ({budget}; the first "
                    f"takes {_size(self.first_session)}, each more {_size(self.per_session)}); sessions beyond "
                    f"resume by replaying their journal")
        line = (f"no snapshots: one session's take {_size(self.first_session)} of host memory and {budget}; "
                f"every session resumes by replaying its journal")
        if self.host_can_hold_one is True:
            line += (f" (snapshot_host_budget_gib >= {self.first_session / GIB:.1f}, with Ray's object store as "
                     f"large, would keep one)")
        elif self.host_can_hold_one is False:
            line += (f" (more than {SNAPSHOT_HOST_MAX_SHARE:.0%} of this host's {_size(self.node_memory)}: no "
                     f"budget here keeps one)")
        return line


def plan_snapshots(host: SnapshotHost, budget_bytes: int, node_memory: Optional[int] = None) -> SnapshotPlan:
    """The group's snapshots on `budget_bytes` of host memory (`node_memory`: its node's, for the advice)."""
    return SnapshotPlan(budget_bytes, host.sessions_within(budget_bytes), host.for_sessions(1), host.per_session,
                        node_memory)


def _size(nbytes: float) -> str:
    if nbytes >= GIB:
        return f"{nbytes / GIB:.2f} GiB"
    if nbytes >= 2 ** 20:
        return f"{nbytes / 2 ** 20:.1f} MiB"
    return f"{nbytes / 2 ** 10:.0f} KiB"


def budget_table(presets: list[Preset], degrees: list[int], interval: int = 1, sessions: tuple[int, ...] = (1, 2, 4, 8),
                 cuda: bool = True, host_bytes: Optional[int] = None) -> str:
    """The markdown table `lingbot snapshot-budget` prints: per rank (rank 0, the fullest) a K/V slot, the
    state at its largest, what is copied per chunk and what the keeper holds per session; per group (every
    rank) what the keeper holds per session, the host memory per session (with the snapshots on their way
    and the ranks' copies) and for N sessions; with `host_bytes`, the sessions whose snapshots fit in it."""
    head = ["preset", "SP", "K/V slot", "state (of it: decoder, condition)", "copied per chunk",
            "held per session", "held per session, group", "host per session, group",
            *(f"host, {n} session{'s' if n > 1 else ''}" for n in sessions)]
    if host_bytes is not None:
        head.append(f"sessions in {_size(host_bytes)}")
    rows = []
    for preset in presets:
        for sp in degrees:
            if preset.transformer.num_attention_heads % sp:
                continue
            host = snapshot_host(preset, sp, interval, cuda)
            r = host.ranks[0]
            rows.append([preset.name, str(sp), _size(r.slot),
                         f"{_size(r.state)} ({_size(sum(r.decoder_cache))}, {_size(sum(r.condition))})",
                         _size(r.per_chunk), _size(r.held), _size(sum(x.held for x in host.ranks)),
                         _size(host.per_session), *(_size(host.for_sessions(n)) for n in sessions),
                         *([] if host_bytes is None else [str(host.sessions_within(host_bytes))])])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * 2 + "---:|" * (len(head) - 2)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    copies = "pinned, power-of-two blocks" if cuda else "plain host copies"
    note = (f"Snapshot every {interval} chunk{'s' if interval > 1 else ''}; each part at its largest (the condition "
            f"encoder's cache until its fixed point); per rank: rank 0, which also holds that cache under SP. Host "
            f"per session, group: held + {SNAPSHOTS_IN_FLIGHT} snapshots on their way, in the keeper. Host for N "
            f"sessions adds once per rank its copies not yet put ({SNAPSHOTS_IN_FLIGHT} snapshots, {copies}) and the "
            f"put in progress (its arguments and the keeper's copy of them).")
    return "\n".join([note, "", *lines]) + "\n"
