"""The quality ladder's controller as a pure function of the group's sessions and learned chunk costs: the load
(cost at each session's rung times its chunks per second) kept under target, the sessions degraded evenly and
climbing back with a margin, a change at most every few chunks unless a session is behind, and unpaced sessions
counting no load."""
import time

import pytest

from deployments.group.ladder import ChunkRung, Ladder, QualityLadder, Seat, chunk_rung
from deployments.session.events import ModelFacts
from deployments.settings import ServeSettings
from lingbot.config import ConfigError, get_preset
from lingbot.runtime.rungs import FULL, RUNGS
from tests.deployments.group.standins import scheduled

STEPS = RUNGS[:3]                          # full, steps3, steps2
RATIOS = (1.0, 0.81, 0.61)                # the cost model's at 14B (perf/rungs.py)
CPS = 16 / 12                             # 16 fps, 12 frames a chunk


def ladder(**kw):
    return Ladder(STEPS, RATIOS, **kw)


def test_nothing_measured_keeps_every_session_at_full():
    assert ladder().decide([Seat("a", CPS, 1.0), Seat("b", CPS, 1.0)]) == {"a": 0, "b": 0}


def test_an_overloaded_group_degrades_evenly_and_climbs_back_with_a_margin_after_the_hold():
    lad = ladder()
    lad.observe(0, 0.4)                                       # full: 0.4 s a chunk; two sessions: load 1.07
    seats = [Seat("a", CPS, 1.0), Seat("b", CPS, 0.5)]
    assert lad.cost(1) == pytest.approx(0.4 * 0.81) and lad.cost(2) == pytest.approx(0.4 * 0.61)
    assert lad.decide(seats) == {"a": 1, "b": 1}             # one rung each (load 0.86), not one session two
    assert lad.load(seats) == pytest.approx(2 * 0.4 * 0.81 * CPS)
    lad.observe(0, 0.2)                                       # the group got faster (EMA: 0.36)
    assert lad.measured[0] == pytest.approx(0.36)
    assert lad.decide(seats) == {"a": 1, "b": 1}             # held: no change within hold_chunks
    for s in seats:
        s.chunks += 4
    lad.measured = {0: 0.32, 1: 0.32 * 0.81}                  # both rungs measured now
    # one back at full: (0.32 + 0.259) * CPS = 0.77 <= 0.8 (target - margin), the one with more slack; both would
    # be 0.85: the other stays
    assert lad.decide(seats) == {"a": 0, "b": 1}
    for s in seats:
        s.chunks += 4
    assert lad.decide(seats) == {"a": 0, "b": 1}
    lad.measured = {0: 0.25, 1: 0.25 * 0.81}                  # faster still: both at full is 0.67
    assert lad.decide(seats) == {"a": 0, "b": 0}


def test_a_session_behind_its_deadline_steps_down_at_once_even_when_held():
    lad = ladder()
    lad.observe(0, 0.1)                                       # an idle group: load 0.27
    seats = [Seat("a", CPS, 0.5, chunks=10, changed_at=9), Seat("b", CPS, -0.2, chunks=10, changed_at=9)]
    assert lad.decide(seats) == {"a": 0, "b": 1}
    assert seats[1].rung == 1 and seats[1].changed_at == 10


def test_the_floor_is_the_lowest_rung_and_unpaced_sessions_count_no_load():
    lad = ladder(floor=1)
    lad.observe(0, 1.0)                                       # one paced session alone overloads the group
    seats = [Seat("a", CPS, 0.0), Seat("u", 0.0, 0.0)]
    assert lad.decide(seats) == {"a": 1, "u": 1}              # at the floor (1), no lower; u: the floor under load
    quiet = ladder()
    quiet.observe(0, 0.1)
    assert quiet.decide([Seat("u", 0.0, 0.0, rung=2)]) == {"u": 0}


def test_a_pinned_session_keeps_its_rung_counts_its_load_there_and_the_others_make_room():
    lad = ladder()
    lad.observe(0, 0.4)                                       # two sessions at full: a load of 1.07
    seats = [Seat("full", CPS, 1.0, pinned=0), Seat("auto", CPS, 0.5)]
    assert lad.decide(seats) == {"full": 0, "auto": 1}       # the pinned one stays; the other steps down,
    seats[1].chunks += 4                                      # (load 0.97) and after its hold, to the floor
    assert lad.decide(seats) == {"full": 0, "auto": 2}
    behind = [Seat("low", CPS, -1.0, pinned=1, rung=1)]       # behind its deadline, pinned: no step down
    assert lad.decide(behind) == {"low": 1}
    lad.observe(0, 0.01)                                      # idle: a pinned lower rung does not climb
    assert lad.decide([Seat("low", CPS, 1.0, pinned=2, rung=2, chunks=50)]) == {"low": 2}
    assert ladder().decide([Seat("low", CPS, 1.0, pinned=1)]) == {"low": 1}    # nothing measured yet


def test_a_session_is_admitted_while_the_floor_holds_for_everyone_and_capacity_is_counted_per_rung():
    lad = ladder()
    assert lad.holds([Seat("a", CPS, 1.0)] * 9, CPS) and lad.capacity(CPS, 0, cap=6) == 6   # nothing measured
    lad.observe(0, 0.3)                                       # full: 0.3 s a chunk -> 0.40 load per session
    seats = [Seat("a", CPS, 1.0), Seat("b", CPS, 1.0), Seat("c", CPS, 1.0)]
    # at the floor (0.61 of full) each is 0.244; a newcomer counts its sink (every step on its own decoder: 0.4):
    # three and a new one 1.13 > 0.9, two and a new one 0.89
    assert not lad.holds(seats, CPS) and lad.holds(seats[:2], CPS)
    assert lad.holds(seats[:2] + [Seat("u", 0.0, 0.0)], CPS)          # an unpaced session counts no load
    assert lad.holds(seats, 0.0)                                       # nor does an unpaced newcomer
    assert lad.holds(seats[:2], CPS, rung=0)                           # one that pins full: 0.4 more, 0.89
    assert not lad.holds(seats[:2] + [Seat("d", CPS, 1.0, pinned=0)], CPS)   # beside one at full: 1.29
    pinned = [Seat("a", CPS, 1.0, pinned=0), Seat("b", CPS, 1.0)]
    assert not lad.holds(pinned, CPS) and lad.holds(pinned[:1], CPS)   # 0.4 + 0.244 + 0.4; 0.4 + 0.4
    # how many sessions of 16 fps hold at real time: 2 at full (0.9 / 0.4), 3 at the floor (0.9 / 0.244)
    assert (lad.capacity(CPS, 0, cap=6), lad.capacity(CPS, 2, cap=6)) == (2, 3)
    assert lad.capacity(CPS, 2, cap=2) == 2 and lad.capacity(CPS * 10, 0, cap=6) == 1       # within [1, cap]


def test_sessions_in_their_sink_count_a_sink_chunks_cost_learned_per_decoder_and_a_newcomer_waits_for_them():
    """A sink chunk runs every denoising step on its rung's decoder: with the decoder rung as the floor, a session
    in its sink counts the tiny decoder's sink cost (seeded from full by the sink ratio, then learned), not the
    floor's; a newcomer counts its own sink, and waits while another session's sink runs; decide() steps a loaded
    sink down onto the decoder rung at once."""
    rungs = (FULL, RUNGS[2], RUNGS[4])                                      # full, steps2, tiny_steps2
    lad = Ladder(rungs, (1.0, 0.72, 0.2), sink_ratios=(1.0, 1.0, 0.4))
    lad.observe(0, 0.5)                                                     # full: 0.67 a session
    assert (lad.sink_cost(0), lad.sink_cost(1), lad.sink_cost(2)) == (0.5, 0.5, 0.2)    # the seed on tiny: 0.4
    lad.observe_sink(2, 0.3)                                                # learned: the tiny decoder's sink
    assert lad.sink_cost(2) == 0.3 and lad.sink_cost(0) == 0.5
    lad.observe(2, 0.1)                                                     # the floor measured: 0.133 a session
    steady, sinking = Seat("a", CPS, 1.0, rung=2, chunks=9), Seat("b", CPS, 1.0, rung=2, in_sink=True)
    assert lad.load([steady]) == pytest.approx(0.1 * CPS) and lad.load([sinking]) == pytest.approx(0.3 * CPS)
    # a newcomer's sink on the floor's decoder, 0.4: beside one past its sink 0.53, beside two 0.67; never beside
    # one in its sink (its player holds one chunk): it waits until that sink passes
    assert lad.holds([steady], CPS) and lad.holds([steady, Seat("c", CPS, 1.0, rung=2, chunks=9)], CPS)
    assert not lad.holds([sinking], CPS) and not lad.holds([steady, sinking], CPS)
    assert lad.holds([steady] * 3, CPS) and not lad.holds([steady] * 4, CPS)     # 0.8; 0.93
    new = Seat("n", CPS, 1.0, in_sink=True)                     # a sink at full beside a steady one: 0.8, it stays
    assert lad.decide([steady, new]) == {"a": 2, "n": 0}
    two = [steady, new, Seat("m", CPS, 1.0, in_sink=True)]      # two: 1.47, both go down onto the tiny decoder
    assert lad.decide(two) == {"a": 2, "n": 2, "m": 2}


def test_ratios_are_checked():
    with pytest.raises(ValueError, match="ratios"):
        Ladder(STEPS, (1.0, 0.61, 0.81))
    with pytest.raises(ValueError, match="ratios"):
        Ladder(STEPS, (0.9, 0.8, 0.7))


# ---- the decoder rungs, as the chunk loop asks the ladder -------------------------------------------------------
def _facts(decoders):
    return ModelFacts.of(get_preset("tiny"), random_weights=True, decoders=decoders)


def _session(sid, decoder=None, quality="auto"):
    s = scheduled(sid, chunks=40)
    s.start.decoder, s.start.quality = decoder, quality
    s.clock.first_delivery = time.monotonic() + 100.0      # well ahead of its viewer: the load alone decides
    return s


def _settings(**kw):
    return ServeSettings(quality_ladder="auto", **kw)


def test_the_decoder_rung_is_the_ladders_floor_where_both_decoders_are_loaded_seeded_below_the_step_rungs():
    both = QualityLadder.of(_settings(quality_floor="tiny_steps2", decoder="wan,tae"), _facts(("wan", "tae")))
    assert [r.name for r in both.ladder.rungs] == ["full", "steps3", "steps2", "tiny_steps2"]
    # the Wan decode 0.3 of a chunk, the tiny one 1.63 / 40.7 of it: steps3 0.86, steps2 0.72, tiny_steps2 0.432
    assert [round(r, 3) for r in both.ladder.ratios] == [1.0, 0.86, 0.72, 0.432]
    steps = QualityLadder.of(_settings(decoder="wan,tae"), _facts(("wan", "tae")))     # the default floor: steps2
    assert [r.name for r in steps.ladder.rungs] == ["full", "steps3", "steps2"] and steps.ladder.ratios == (1, .8, .6)
    with pytest.raises(ConfigError, match=r"quality_floor 'tiny_steps2' is a decoder rung: it needs both decoders "
                                          r"loaded \(decoder: wan,tae\), not wan"):
        ServeSettings(quality_floor="tiny_steps2", decoder="wan")


def test_a_step_down_onto_the_tiny_decoder_is_at_once_and_a_climb_back_waits_for_the_wan_decoder_to_be_warm():
    """The climb from tiny_steps2 to steps2 (the same steps, the decoder changes) stays on tiny_steps2 warming the
    Wan decoder (prewarm) until a chunk's reply says it is warm; those chunks' times are steps2's cost (a climb the
    group cannot afford shows at once), not tiny_steps2's."""
    q = QualityLadder.of(_settings(quality_floor="tiny_steps2", decoder="wan,tae"), _facts(("wan", "tae")))
    a = _session("a", decoder="wan")
    sessions = [a]
    q.ladder.observe(0, 5.0)                       # full: 5 s a chunk, far past real time: down a rung a chunk
    q.ladder.hold_chunks = 0
    seen = []
    for index in range(3, 6):
        a.next_chunk = index                       # (past its sink)
        plan = chunk_rung(q, a, sessions, index, model_sink=3, loaded=q.loaded)
        seen.append((plan.rung.name, plan.decoder, plan.prewarm))
        q.ran(a, index, plan, 5.0 * q.ladder.ratios[q.ladder.rungs.index(plan.rung)])
    assert seen == [("steps3", None, None), ("steps2", None, None), ("tiny_steps2", "tae", None)]
    q.ladder.measured = {}
    q.ladder.observe(0, 0.01)                      # idle now: it climbs, a rung a chunk
    q.ladder.observe(3, 0.004)
    climbed = []
    for index, warm in zip(range(6, 10), (False, False, True, None)):
        a.next_chunk = index
        plan = chunk_rung(q, a, sessions, index, model_sink=3, loaded=q.loaded)
        climbed.append((plan.rung.name, plan.decoder, plan.prewarm))
        q.ran(a, index, plan, 0.009, warm=warm)
    assert climbed == [("tiny_steps2", "tae", "wan"),                # steps2 chosen: held, the Wan decoder warms
                       ("tiny_steps2", "tae", "wan"),                # ... not ready yet (warm False)
                       ("tiny_steps2", "tae", "wan"),                # ready now (warm True) ...
                       ("steps2", None, None)]                       # ... so switched
    # the warming chunks' 9 ms are steps2's (the rung it climbs to), not tiny_steps2's
    assert q.ladder.measured[3] == 0.004 and q.ladder.measured[2] == 0.009


def test_a_tiny_decoder_session_runs_the_decoder_rung_on_its_own_decoder_and_a_pinned_rung_holds_in_the_sink():
    q = QualityLadder.of(_settings(quality_floor="tiny_steps2", decoder="wan,tae"), _facts(("wan", "tae")))
    t = _session("t", decoder="tae")
    q.ladder.observe(0, 5.0)
    q.ladder.hold_chunks = 0
    names = []
    for index in range(3, 7):
        t.next_chunk = index
        plan = chunk_rung(q, t, [t], index, model_sink=3, loaded=q.loaded)
        names.append((plan.rung.name, plan.decoder, plan.prewarm))
        q.ran(t, index, plan, 5.0 * q.ladder.ratios[q.ladder.rungs.index(plan.rung)])
    assert names == [("steps3", None, None), ("steps2", None, None),                 # its own (tiny) decoder
                     ("tiny_steps2", None, None), ("tiny_steps2", None, None)]       # throughout
    pinned = _session("p", decoder="wan", quality="tiny_steps2")                     # the sink: every step
    assert [(r.rung.name, r.decoder) for r in (chunk_rung(None, pinned, [pinned], i, 3, ("wan", "tae"))
                                               for i in (0, 5))] == [("tiny", "tae"), ("tiny_steps2", "tae")]
    assert chunk_rung(None, _session("f", quality="steps2"), [], 0, 3, ("wan", "tae")).rung.name == "full"  # sink


def test_a_newcomer_starts_where_the_groups_most_degraded_session_is_its_sink_on_that_rungs_decoder():
    """A session joining a group whose sessions the ladder has taken down to tiny_steps2 starts there (it is the one
    making the group crowded), its sink at every step but on the tiny decoder (`tiny`: the decoder does not touch
    the K/V); a pinned newcomer keeps its own rung."""
    q = QualityLadder.of(_settings(quality_floor="tiny_steps2", decoder="wan,tae"), _facts(("wan", "tae")))
    old = _session("old", decoder="wan")
    q.ladder.observe(0, 1.0)                                          # loaded: two at the floor are 1.15
    chunk_rung(q, old, [old], 3, model_sink=3, loaded=q.loaded)
    q.seats["old"].rung = 3                                           # the ladder took it to tiny_steps2
    new, pinned = _session("new", decoder="wan"), _session("pin", decoder="wan", quality="steps3")
    first = chunk_rung(q, new, [old, new], 0, model_sink=3, loaded=q.loaded)
    assert (first.rung.name, first.rung.steps, first.decoder, first.prewarm) == ("tiny", None, "tae", None)
    assert q.seats["new"].rung == 3
    assert chunk_rung(q, pinned, [old, new, pinned], 0, model_sink=3, loaded=q.loaded).rung.name == "full"
    assert chunk_rung(q, pinned, [old, new, pinned], 3, model_sink=3, loaded=q.loaded).rung.name == "steps3"
    assert q.seats["pin"].rung == 1


def test_the_seeds_follow_the_wan_decodes_share_of_the_groups_full_chunks():
    """Seeded with the forward counts' ratios (no decoder rung) until a full chunk of a Wan session reports its
    stage times; a decode of 0.8 of the chunk (the tiny preset on a CPU) makes steps2 cost 0.92 of full, not 0.6,
    so a loaded group no longer expects a step rung to make room it cannot. A tiny-decoder session's chunks, a
    cheaper rung's and a warming chunk's do not count."""
    q = QualityLadder.of(_settings(decoder="wan,tae"), _facts(("wan", "tae")))
    wan, tae = _session("w", decoder="wan"), _session("t", decoder="tae")
    assert q.ladder.ratios == (1, .8, .6) and q.decode_share is None
    full = chunk_rung(q, wan, [wan], 0, model_sink=3, loaded=q.loaded)
    q.ran(tae, 0, full, 0.3, timings={"probe_0": 0.1, "decode": 0.02})           # its own decoder is the tiny one
    q.ran(wan, 1, ChunkRung(RUNGS[2]), 0.3, timings={"probe_0": 0.1, "decode": 0.9})   # a cheaper rung's chunk
    q.ran(wan, 2, ChunkRung(FULL, prewarm="wan"), 0.3, timings={"decode": 0.9})          # a warming chunk
    assert q.decode_share is None and q.ladder.ratios == (1, .8, .6)
    q.ran(wan, 3, full, 0.5, timings={"probe_0": 0.1, "decode": 0.4})
    assert q.decode_share == pytest.approx(0.8)
    assert [round(r, 3) for r in q.ladder.ratios] == [1.0, 0.96, 0.92]
    assert q.ladder.cost(1) == pytest.approx(q.ladder.measured[0] * 0.96)      # steps3: not measured, seeded


def test_the_costs_the_ranks_measured_at_the_start_seed_the_ladder_and_one_switched_on_later():
    """A sink chunk on the tiny decoder (`tiny`), full and the floor, as the ranks measured them before any session:
    the ladder admits from them at once (not the seeds), whether it runs from the start or is switched on."""
    from deployments.group.group_ladder import GroupLadder
    facts, costs = _facts(("wan", "tae")), {"full": 0.75, "tiny": 0.31, "tiny_steps2": 0.24}
    on = GroupLadder(_settings(quality_floor="tiny_steps2", decoder="wan,tae"), facts)
    on.measured_at_start(costs)
    assert on.active.ladder.measured == {0: 0.75, 3: 0.24} and on.active.ladder.sink_measured == {"tae": 0.31}
    off = GroupLadder(ServeSettings(quality_floor="tiny_steps2", decoder="wan,tae"), facts)
    off.measured_at_start(costs)
    assert off.active is None
    off.set_mode("auto")
    assert off.active.ladder.measured == {0: 0.75, 3: 0.24} and off.active.ladder.sink_measured == {"tae": 0.31}
