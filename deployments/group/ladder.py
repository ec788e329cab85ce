"""The quality ladder's controller: which rung each session of a group runs its next chunk at (docs/architecture.md,
"Rungs"). Plain Python, decided per chunk: `Ladder` decides, `QualityLadder` seats a group's sessions on it
(group_ladder.py's `GroupLadder`, the switch off or auto, is the one the chunk loop and the leases ask).

It decides from the group's load, not from the playout slack alone (with adaptive pacing a chunk is due one
learned lead before its deadline, so the slack sits near the margin whether the group is idle or nearly full).
The load is the sum over the group's sessions of a chunk's cost at the session's rung times the session's
chunks per second: every deadline can hold while it stays under 1 (`target`, by default 0.9, leaves room for
the noise of chunk times). The slack corrects it: a session behind its deadline steps down first, at once.

- Costs are learned on this group, per rung: measured by the ranks at the group's start where the ladder may
  run (the floor, a sink chunk on the floor's decoder: RankLifecycle.measure_rungs; full: the warm-up), then
  from the chunk times the ranks report (a slower chunk counts at once, a faster one by an exponential mean); a rung not
  measured is seeded from full times the cost model's ratios (perf/rungs.py), which follow the Wan decode's
  share of this group's full chunks (their stage times), which the DiT-only rungs do not save.
- The sink (a session's first chunks) runs every denoising step on its rung's decoder: a session in its sink
  counts a sink chunk's cost (learned per decoder), due as fast as its first chunk's frames play (9 of 12: the
  player has only that chunk while the next is made), and steps down straight onto a rung whose decoder makes
  the sink cheaper.
- Hysteresis: a session changes rung at most once every `hold_chunks` of its chunks, unless it is behind. A
  newcomer starts at the rung of the group's most degraded session (it is the one making the group crowded).
- Fairness: when some must step down, the session at the best rung goes first (ties: the one with the least
  slack), so the group degrades evenly; when there is room, the session at the worst rung climbs first (ties:
  the most slack), and only if the group's load after the climb stays under target - `margin`.
- A session without real-time demand (unpaced delivery) counts no load and runs at the floor while the group
  is loaded, at full when it is not.
- A session that pinned a rung (extra_params.quality: full or a rung's name) stays on it and counts its load
  there; the others make room around it. Pinned rungs hold with the ladder off too (`chunk_rung`).
- The decoder rung (tiny_steps2: two steps and the tiny decoder instead of the Wan one) is the ladder's floor where
  both decoders are loaded and quality_floor says so, below steps2, and applies to a session whose own decoder is
  the Wan one (another runs it on its own decoder). The step down onto it switches at once (the tiny decoder is
  warmed from the session's ring of latents: 3 tiny decodes). The climb back to steps2 waits until the Wan
  decoder is warm: the session stays on tiny_steps2 and each chunk warms the Wan decoder by one decode
  (ChunkControls.prewarm), which makes the chunk cost what a steps2 chunk costs (a group with room to climb has
  room to warm), until a rank reports it ready (14 chunks), and no chunk stalls on a 14-decode warm-up. A warming
  chunk's time is learned as the cost of the rung it climbs to (a climb the group cannot afford shows at once).
- Admission (`holds`, `QualityLadder.admits`): a group takes one more session while every session could run at
  real time at its lowest allowed rung (the floor, or its pinned rung) with the new one's sink at its own cost
  beside them, and no other session's sink is running (one sink at a time). So a group full at the top rung
  still takes sessions (they and the others step down) instead of them waiting for a group start; one it holds
  back waits for that seat, told its place (SessionFailed.seat_held: the ingress waits whether or not a group
  may be added), never joins to stall the others. `capacity` says how many sessions of one rate fit at a rung.
- Turned off on a running group, the ladder leaves its sessions at full from their next chunk, except one on a
  decoder it borrowed (the tiny decoder of tiny_steps2): that one climbs as it would with the ladder on, at every
  step on the borrowed decoder while its own warms a decode a chunk, and switches once a rank reports it warm
  (`wind_down`; GroupLadder keeps the ladder it turned off, `winding`, until none is left borrowing). Turned on
  again meanwhile, the new ladder carries such a climb on (`carry_from`).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Optional

from lingbot.runtime.rungs import FULL, WAN_DECODE_SHARE, Rung, rung, rung_decoders, rung_name, rung_ratio

EMA = 0.2                      # weight of a new chunk time in a rung's learned cost


def learned(old: Optional[float], seconds: float) -> float:
    """A rung's cost after a chunk of `seconds`: a slower chunk counts at once (a group that slowed down, e.g. one
    sharing its cores, must not wait five chunks to step down), a faster one by the exponential mean."""
    return seconds if old is None or seconds > old else (1 - EMA) * old + EMA * seconds


@dataclass
class Seat:
    """One session as the ladder sees it. `rung`: an index into the ladder's rungs (0: full)."""
    id: str
    chunks_per_s: float        # its fps over the frames of a chunk; 0: unpaced (no real-time demand)
    slack_s: float             # video generated ahead of its viewer (negative: behind its deadline)
    rung: int = 0
    chunks: int = 0            # chunks it has run
    changed_at: int = -10 ** 9  # `chunks` when its rung last changed
    pinned: Optional[int] = None  # the rung the session chose for its life (None: the ladder's choice)
    warming: bool = False      # held below the rung it climbed to until its decoder is warm: climbs no further
    in_sink: bool = False      # its next chunk is one of its sink's: every denoising step, on its rung's decoder


class Ladder:
    def __init__(self, rungs: tuple[Rung, ...], ratios: tuple[float, ...], floor: Optional[int] = None,
                 target: float = 0.9, margin: float = 0.1, hold_chunks: int = 4,
                 sink_ratios: Optional[tuple[float, ...]] = None):
        if len(ratios) != len(rungs) or ratios[0] != 1.0 or list(ratios) != sorted(ratios, reverse=True):
            raise ValueError("ratios: one per rung, the full rung's 1.0 first, then not increasing")
        self.rungs, self.ratios = rungs, ratios
        self.sink_ratios = sink_ratios or (1.0,) * len(rungs)   # a sink chunk on each rung's decoder, against full
        self.floor = len(rungs) - 1 if floor is None else floor
        self.target, self.margin, self.hold_chunks = target, margin, hold_chunks
        self.measured: dict[int, float] = {}   # rung -> learned seconds per chunk
        # a decoder rung's decoder -> a sink chunk's learned seconds on it (on the session's own decoder a sink
        # chunk is a full one: cost(0))
        self.sink_measured: dict[str, float] = {}

    def observe(self, rung: int, seconds: float) -> None:
        """A chunk ran at `rung` in `seconds` (the ranks' engine time)."""
        old = self.measured.get(rung)
        self.measured[rung] = learned(old, seconds)

    def observe_sink(self, rung: int, seconds: float) -> None:
        """A sink chunk ran on `rung`'s decoder in `seconds`."""
        key = self.rungs[rung].decoder
        old = self.sink_measured.get(key)
        self.sink_measured[key] = learned(old, seconds)

    def sink_cost(self, rung: int) -> Optional[float]:
        """Seconds per sink chunk on `rung`'s decoder (every denoising step): learned, else (the session's own
        decoder) the full rung's cost, else the full rung's scaled by the cost model's sink ratio."""
        key = self.rungs[rung].decoder
        if key is None:
            return self.cost(0)
        if key in self.sink_measured:
            return self.sink_measured[key]
        full = self.cost(0)
        return None if full is None else full * self.sink_ratios[rung]

    def seat_cost(self, seat: Seat, rung: int) -> Optional[float]:
        """What `seat`'s next chunk costs at `rung`: a sink chunk's cost while it is in its sink."""
        return self.sink_cost(rung) if seat.in_sink else self.cost(rung)

    def cost(self, rung: int) -> Optional[float]:
        """Seconds per chunk at `rung`: learned, else the full rung's (or any measured one's) scaled by the
        cost model's ratios; None before any chunk was measured."""
        if rung in self.measured:
            return self.measured[rung]
        if not self.measured:
            return None
        base, seconds = next(iter(sorted(self.measured.items())))
        return seconds * self.ratios[rung] / self.ratios[base]

    def load(self, seats: list[Seat], rungs: Optional[dict[str, int]] = None) -> float:
        rungs = rungs or {}
        return sum((self.seat_cost(s, rungs.get(s.id, s.rung)) or 0.0) * s.chunks_per_s for s in seats)

    def holds(self, seats: list[Seat], chunks_per_s: float, rung: Optional[int] = None) -> bool:
        """Whether one more session of `chunks_per_s` (at `rung`; None: the floor) keeps every deadline with each
        session at its lowest allowed rung (a pinned one at its own, the others at the floor): their load within
        target, the new one counted at its sink's cost (every step), since its first chunks are its sink; and no
        paced session in its sink (one sink at a time: a new session's player has one chunk to play while its
        sink's next chunk is made, so nothing else's first chunks may come between). True before anything is
        measured, and for a session without real-time demand."""
        if chunks_per_s <= 0 or self.cost(0) is None:
            return True
        if any(s.in_sink and s.chunks_per_s > 0 for s in seats):
            return False                             # one sink at a time: its player holds one chunk
        lowest = {s.id: self.floor if s.pinned is None else s.pinned for s in seats}
        new = self.floor if rung is None else rung
        return self.load(seats, lowest) + self.sink_cost(new) * chunks_per_s <= self.target

    def _step_down(self, seat: Seat, rung: int) -> int:
        """The rung below `rung` for `seat`; one in its sink goes on to the first whose sink costs less (a sink
        runs every step: only a decoder rung makes it cheaper)."""
        lower = rung + 1
        while seat.in_sink and lower < self.floor and (self.sink_cost(lower) or 0.0) >= (self.sink_cost(rung) or 0.0):
            lower += 1
        return lower

    def capacity(self, chunks_per_s: float, rung: int, cap: int) -> int:
        """How many sessions of `chunks_per_s` the group holds at real time, all at `rung`: at most `cap` (the
        configured one, a hard cap) and at least 1; `cap` before anything is measured."""
        cost = self.cost(rung)
        if cost is None or chunks_per_s <= 0:
            return cap
        return max(1, min(cap, math.floor(self.target / (cost * chunks_per_s) + 1e-9)))

    def decide(self, seats: list[Seat]) -> dict[str, int]:
        """Each seat's rung for its next chunk (changes are also written to the seats)."""
        if self.cost(0) is None:                     # nothing measured yet: every session at full (or pinned)
            return {s.id: s.rung if s.pinned is None else s.pinned for s in seats}
        rungs = {s.id: s.rung if s.pinned is None else s.pinned for s in seats}
        free = {s.id for s in seats if s.chunks - s.changed_at >= self.hold_chunks and s.pinned is None}
        for s in seats:                              # behind its deadline: one rung down, now
            if s.slack_s < 0 and rungs[s.id] < self.floor and s.pinned is None:
                rungs[s.id] = self._step_down(s, rungs[s.id])
                free.discard(s.id)
        loaded = self.load(seats, rungs) > self.target
        for s in seats:                              # no real-time demand: the floor under load, else full
            if s.chunks_per_s == 0 and s.id in free:
                rungs[s.id] = self.floor if loaded else 0
        while self.load(seats, rungs) > self.target:
            down = [s for s in seats if s.id in free and s.chunks_per_s > 0 and rungs[s.id] < self.floor]
            if not down:
                break
            s = min(down, key=lambda s: (rungs[s.id], s.slack_s))
            rungs[s.id] = self._step_down(s, rungs[s.id])
            free.discard(s.id)
        while True:
            up = [s for s in seats if s.id in free and s.chunks_per_s > 0 and rungs[s.id] > 0 and not s.warming]
            if not up:
                break
            s = max(up, key=lambda s: (rungs[s.id], s.slack_s))
            trial = {**rungs, s.id: rungs[s.id] - 1}
            if self.load(seats, trial) > self.target - self.margin:
                break
            rungs[s.id] -= 1
            free.discard(s.id)
        for s in seats:
            if rungs[s.id] != s.rung:
                s.rung, s.changed_at = rungs[s.id], s.chunks
        return rungs


@dataclass(frozen=True)
class ChunkRung:
    """What one chunk runs at: its rung, the frame decoder that means for its session (None: its own), and a
    decoder to warm ahead of a climb (None: none)."""
    rung: Rung
    decoder: Optional[str] = None
    prewarm: Optional[str] = None


def own_decoder(session, loaded: tuple[str, ...]) -> str:
    """The session's own frame decoder: the one it asked for, else the deployment's default (the first loaded)."""
    return session.start.decoder or loaded[0]


def session_decoder(r: Rung, own: str, loaded: tuple[str, ...]) -> Optional[str]:
    """The decoder a session whose own is `own` runs rung `r` with: the rung's where the session may switch to it,
    else its own (None)."""
    return r.decoder if r.decoder in rung_decoders(own, loaded) else None


class QualityLadder:
    """The controller as the chunk loop asks it (quality_ladder: auto): a seat per session, its chunks per second
    (its fps over a chunk's frames; 0 when unpaced) and its slack (its next chunk's deadline at the player, from
    now), the rung of each chunk past the sink, and what each chunk cost at its rung."""

    def __init__(self, ladder: Ladder, sink_chunks: int, frames_per_chunk: int, loaded: tuple[str, ...] = ("wan",),
                 steps: int = 4, first_frames: Optional[int] = None):
        self.ladder, self.sink_chunks, self.frames_per_chunk = ladder, sink_chunks, frames_per_chunk
        # a session's first chunk is shorter (9 frames of 12): in its sink, the player has only that to play
        # while the next chunk is made, so a sink chunk is due within the first chunk's time
        self.first_frames = first_frames or frames_per_chunk
        self.loaded, self.steps = loaded, steps
        self.decode_share: Optional[float] = None  # the Wan decode's share of a full chunk, measured here
        self.seats: dict[str, Seat] = {}
        self.last: dict[str, ChunkRung] = {}        # each session's last chunk as it ran
        self.warm: dict[str, bool] = {}             # a climb's decoder reported warm by the ranks

    @classmethod
    def of(cls, settings, model) -> Optional[QualityLadder]:
        """The group's ladder (None: quality_ladder off): the rungs down to quality_floor that the model runs (the
        decoder rungs where both decoders are loaded), seeded with the cost model's ratios (the forward counts';
        with decoder rungs, also the Wan decode's share and the tiny decoder's FLOP ratio)."""
        if settings.quality_ladder != "auto" or model is None:
            return None
        loaded = tuple(model.decoders)
        rungs = ladder_rungs(settings, loaded)
        share = WAN_DECODE_SHARE if any(r.decoder for r in rungs) else 0.0
        return cls(Ladder(rungs, tuple(rung_ratio(model.steps, r, share) for r in rungs),
                          sink_ratios=sink_ratios(model.steps, rungs, share)), model.sink_chunks,
                   model.geometry.pixel_frames(1), loaded, model.steps, model.geometry.pixel_frames(0))

    def _seat(self, session, now: float) -> Seat:
        seat = self.seats.get(session.id)
        if seat is None:                # a newcomer starts where the group's most degraded session is
            pinned = self.pinned(session.start)
            start = max((s.rung for s in self.seats.values() if s.pinned is None), default=0)
            seat = self.seats[session.id] = Seat(session.id, 0.0, 0.0, rung=start if pinned is None else pinned,
                                                 pinned=pinned)
        seat.in_sink = session.next_chunk < sink_chunks(session, self.sink_chunks)
        seat.chunks_per_s = self.chunks_per_s(session.start, seat.in_sink)
        seat.slack_s = session.clock.deadline() - now
        return seat

    def seed(self, costs: dict[str, float]) -> None:
        """Costs measured before any session ran (GroupLadder.measured_at_start)."""
        for i, r in enumerate(self.ladder.rungs):
            if r.name in costs:
                self.ladder.observe(i, costs[r.name])
            sink = rung_name(None, r.decoder)
            if r.decoder is not None and sink in costs and r.decoder not in self.ladder.sink_measured:
                self.ladder.observe_sink(i, costs[sink])

    def chunks_per_s(self, start, in_sink: bool = False) -> float:
        """A session's chunks per second at real time (0: unpaced, no real-time demand); in its sink, as due as
        its first chunk's frames make them."""
        return start.fps / (self.first_frames if in_sink else self.frames_per_chunk) if start.paced else 0.0

    def pinned(self, start) -> Optional[int]:
        """The rung a session pinned, as an index into this ladder's rungs (None: the ladder chooses)."""
        return None if start.quality == "auto" else [r.name for r in self.ladder.rungs].index(start.quality)

    def admits(self, start, sessions, opening: int = 0, default_fps: float = 16.0) -> bool:
        """Whether the group takes a session of `start` beside `sessions` (and `opening` sessions admitted but not
        yet running, counted at `default_fps`) with the floor holding for every one of them (Ladder.holds)."""
        now = time.monotonic()
        seats = [self._seat(s, now) for s in sessions]
        seats += [Seat(f"opening-{i}", default_fps / self.frames_per_chunk, 0.0, in_sink=True) for i in range(opening)]
        return self.ladder.holds(seats, self.chunks_per_s(start), self.pinned(start))

    def capacities(self, fps: float, cap: int) -> dict[str, int]:
        """Sessions of `fps` the group holds at real time at the top rung and at the floor (within `cap`)."""
        cps = fps / self.frames_per_chunk
        return {"top": self.ladder.capacity(cps, 0, cap), "floor": self.ladder.capacity(cps, self.ladder.floor, cap)}

    def rung_for(self, session, sessions, index: int, in_sink: bool = False) -> ChunkRung:
        """The rung the ladder gives `session`'s chunk `index`; in its sink (`in_sink`) every denoising step runs
        and only the rung's decoder applies (the decoder does not touch the K/V). A climb back to the session's own
        decoder keeps the chunk on the decoder it ran on, at the chosen steps, and warms its own decoder until a
        rank reports it ready."""
        now = time.monotonic()
        rungs = self.ladder.decide([self._seat(s, now) for s in sessions])
        own = own_decoder(session, self.loaded)
        chosen = self.ladder.rungs[rungs[session.id]]
        steps, decoder, prewarm = None if in_sink else chosen.steps, session_decoder(chosen, own, self.loaded), None
        last, seat = self.last.get(session.id), self.seats[session.id]
        climbing = last is not None and last.decoder is not None and decoder is None        # back to its own
        seat.warming = climbing and not self.warm.get(session.id)
        if seat.warming:
            decoder, prewarm = last.decoder, own
        if not (in_sink or seat.warming):
            return ChunkRung(chosen, decoder)
        name = rung_name(steps, decoder)
        return ChunkRung(chosen if name == chosen.name else Rung(name, steps, decoder), decoder, prewarm)

    def ran(self, session, index: int, chunk: ChunkRung, seconds: float, warm: Optional[bool] = None,
            timings: Optional[dict] = None) -> None:
        """Chunk `index` of `session` ran at `chunk` in `seconds` (the slowest rank's engine time); `warm`: the
        ranks' answer to its prewarm (ready to switch); `timings`: its stage times (the root's)."""
        seat = self.seats.get(session.id)
        if seat is not None:
            seat.chunks += 1
        self.last[session.id] = chunk
        self.warm[session.id] = bool(warm) if chunk.prewarm is not None else False
        names = [r.name for r in self.ladder.rungs]
        decoders = [r.decoder for r in self.ladder.rungs]
        if chunk.prewarm is not None:             # a warming chunk costs what the rung it climbs to costs (so a
            above = rung_name(chunk.rung.steps, None)     # climb the group cannot afford is seen, and given up)
            if above in names:
                self.ladder.observe(names.index(above), seconds)
        elif chunk.decoder in decoders and chunk.decoder is not None and index < sink_chunks(session,
                                                                                              self.sink_chunks):
            self.ladder.observe_sink(decoders.index(chunk.decoder), seconds)   # (on its own decoder: a full chunk)
        elif chunk.rung.name in names:
            self.ladder.observe(names.index(chunk.rung.name), seconds)
        if chunk.rung.name == "full" and chunk.decoder is None and chunk.prewarm is None \
                and own_decoder(session, self.loaded) == "wan":
            self._learn_decode_share(timings or {})

    def _learn_decode_share(self, timings: dict) -> None:
        """The seeds of the rungs not measured yet follow the Wan decode's share of this group's full chunks (the
        cost model's share is the 14B one: 0.3 there, 0.8 for the tiny preset on a CPU, where a step rung saves
        little)."""
        total, decode = sum(timings.values()), timings.get("decode")
        if decode is None or total <= 0:
            return
        share = decode / total
        self.decode_share = share if self.decode_share is None else (1 - EMA) * self.decode_share + EMA * share
        self.ladder.ratios = tuple(rung_ratio(self.steps, r, self.decode_share) for r in self.ladder.rungs)
        self.ladder.sink_ratios = sink_ratios(self.steps, self.ladder.rungs, self.decode_share)

    def wind_down(self, session) -> Optional[ChunkRung]:
        """With this ladder turned off: the chunk of `session` while its last one ran on a decoder this ladder lent
        it (not its own, not pinned), at every denoising step on that decoder, warming its own (prewarm) until a
        rank reported it warm; None once its chunks run on its own decoder, and for any other session (its chunk
        is then what the ladder off gives: full, or its pinned rung)."""
        last = self.last.get(session.id)
        if session.start.quality != "auto" or last is None or last.decoder is None or self.warm.get(session.id):
            return None
        return ChunkRung(rung(rung_name(None, last.decoder)), last.decoder, own_decoder(session, self.loaded))

    def lending(self, sessions) -> bool:
        """Whether some of `sessions` still runs on a decoder this ladder lent it (wind_down)."""
        return any(self.wind_down(s) is not None for s in sessions)

    def carry_from(self, other: QualityLadder) -> None:
        """Carry on the climbs back to the sessions' own decoders that `other` (a ladder turned off) was winding
        down: each session's last chunk and whether its own decoder was reported warm."""
        self.last.update(other.last)
        self.warm.update(other.warm)

    def forget(self, session_id: str) -> None:
        for held in (self.seats, self.last, self.warm):
            held.pop(session_id, None)


def ladder_rungs(settings, loaded: tuple[str, ...]) -> tuple[Rung, ...]:
    """The ladder's rungs down to quality_floor that a group of `loaded` decoders runs (the decoder rungs where
    both are loaded)."""
    runs = {None, *loaded} if len(loaded) > 1 else {None}
    return tuple(r for r in map(rung, settings.quality_rungs) if r.decoder in runs)


def ladder_floor(settings, loaded: tuple[str, ...]) -> Rung:
    return ladder_rungs(settings, loaded)[-1]


def sink_ratios(steps: int, rungs: tuple[Rung, ...], decode_share: float) -> tuple[float, ...]:
    """A sink chunk's cost on each rung's decoder against a full chunk's: every step, decoded by the rung's decoder
    (1 on the session's own)."""
    return tuple(1.0 if r.decoder is None else rung_ratio(steps, Rung(rung_name(None, r.decoder), None, r.decoder),
                                                           decode_share) for r in rungs)


def sink_chunks(session, model_sink: int) -> int:
    """The session's attention sink in chunks: its own window's, else the model's."""
    window = session.start.window
    return model_sink if window is None else window[0]


def chunk_rung(ladder: Optional[QualityLadder], session, sessions, index: int, model_sink: int,
               loaded: tuple[str, ...] = ("wan",)) -> ChunkRung:
    """What `session`'s chunk `index` runs at: the sink at every denoising step (on the decoder of the rung the
    session pinned or the ladder chose: the decoder does not touch the K/V); a session that pinned a rung
    (extra_params.quality) at its rung, whether the ladder is on or off; else the ladder's choice (off: full)."""
    quality = session.start.quality
    pinned = None if quality == "auto" else rung(quality)
    in_sink = index < sink_chunks(session, model_sink)
    if ladder is not None and pinned is None:
        return ladder.rung_for(session, sessions, index, in_sink)
    if in_sink:
        decoder = None if pinned is None else session_decoder(pinned, own_decoder(session, loaded), loaded)
        return ChunkRung(rung(rung_name(None, decoder)), decoder)
    if ladder is not None:
        return ladder.rung_for(session, sessions, index)
    if pinned is None:
        return ChunkRung(FULL)
    return ChunkRung(pinned, session_decoder(pinned, own_decoder(session, loaded), loaded))


AT_FULL = ChunkRung(FULL)             # a chunk of the model's own configuration: every step, the session's decoder
