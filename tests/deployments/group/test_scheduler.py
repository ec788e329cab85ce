"""The session scheduler without a server: pacing, stalls, interaction lifecycle, flow control."""
import math

import pytest

from deployments.group.pacer import Pacer
from deployments.group.scheduler import ScheduledSession, Scheduler
from deployments.group.tombstones import Tombstones
from deployments.session.events import ChunkControls
from deployments.session.requests import Interaction
from lingbot.camera import CameraEvent
from tests.deployments.group.standins import scheduled
from tests.deployments.ingress.inputs import start


def test_edf_and_pacing():
    sched = Scheduler(pacing_lead_s=0.5)
    a, b = scheduled("a", now=0.0), scheduled("b", now=0.5)
    sched.add(a), sched.add(b)
    assert sched.pick(now=1.0)[0] is a                    # both due at once: the earlier created first
    a.next_chunk += 1
    a.clock.generated(9)
    a.clock.delivered(9, now=1.0)                               # a's player: 9 frames = 0.5625 s from t=1.0
    assert sched.pick(now=1.1)[0] is b                    # b is due (since 0.5), a not until 1.5625
    b.next_chunk += 1
    b.clock.generated(9)
    b.clock.delivered(9, now=1.2)
    # both ahead; a is due at 1.5625, b at 1.7625: a is next, and may run up to 0.5 s (the lead) early
    assert sched.pick(now=1.2)[0] is a
    a.next_chunk += 1
    a.clock.generated(12)
    a.clock.delivered(12, now=1.3)                              # a now buffered until 2.3125
    who, wait = sched.pick(now=1.3)
    assert who is b                                       # b (1.7625) is earlier: never a while b is behind it
    b.next_chunk += 1
    b.clock.generated(12)
    b.clock.delivered(12, now=1.4)                              # b until 2.5125
    who, wait = sched.pick(now=1.4)
    assert who is None and wait == pytest.approx(2.3125 - 1.4 - 0.5)   # both over 0.5 s ahead: idle


def test_an_unpaced_session_runs_whenever_no_paced_one_is_due():
    """realtime_output_pacing false: the session's chunks are always eligible (an unbounded lead), while a paced
    session whose chunk is due first still goes first, and one ahead of its lead idles."""
    import dataclasses
    sched = Scheduler(pacing_lead_s=0.5)
    paced, unpaced = scheduled("p", now=0.0), scheduled("u", now=0.0)
    unpaced.start = dataclasses.replace(unpaced.start, paced=False)
    sched.add(paced), sched.add(unpaced)
    assert unpaced.clock.pacer.lead_s == math.inf and paced.clock.pacer.lead_s == 0.5
    for s, at in ((paced, 1.0), (unpaced, 1.0)):
        s.next_chunk += 1
        s.clock.generated(9)
        s.clock.delivered(9, now=at)
    for n in range(10):                                   # paced: due at 1.5625, eligible from 1.0625
        assert sched.pick(now=1.01)[0] is unpaced, n      # 10 chunks (7.6 s of video) ahead of its playback
        unpaced.next_chunk += 1
        unpaced.clock.generated(12)
        unpaced.clock.delivered(12, now=1.01)
    assert sched.pick(now=1.1)[0] is paced                # within its lead now, and due before the unpaced one
    assert unpaced.planner.queue(Interaction("e1", keys=["w", "w", "w"]))
    assert sched.pick(now=1.1)[0] is paced                # even while the unpaced one has a control queued
    sched.remove("u")
    assert sched.pick(now=1.01) == (None, pytest.approx(1.5625 - 1.01 - 0.5))    # the paced one alone idles


def test_stall_accounting():
    s = scheduled("a", now=0.0)
    s.clock.generated(9)
    s.clock.delivered(9, now=1.0)              # plays until 1.5625
    s.clock.generated(12)
    s.clock.delivered(12, now=2.0)             # 0.4375 s late
    assert s.clock.stalls == 1 and s.clock.stall_seconds == pytest.approx(0.4375)
    assert s.clock.deadline() == pytest.approx(2.0 + 12 / 16)


def test_event_lifecycle():
    s = scheduled("a", chunks=6, script=[("w", "w", "w")] * 6)
    s.planner.queue(Interaction("k1", keys=["l"] * 5))
    s.planner.queue(Interaction("c1", camera=CameraEvent("target", (0, 0, 1), (0, 0, 0, 1), 2)))
    plan = s.plan_next_chunk()
    assert plan.controls.keys == ("l", "l", "l") and plan.controls.camera.mode == "target"
    assert plan.started == ["k1", "c1"] and plan.active == ["k1", "c1"] and plan.completed == []
    s.commit_plan(plan)
    s.planner.queue(Interaction("p1", prompt="night", transition_chunks=0))
    plan = s.plan_next_chunk()
    assert plan.controls.keys == ("l", "l", "") and plan.controls.prompt == "night"
    assert plan.controls.camera is None                  # the target transition continues in the rig
    assert plan.started == ["p1"] and sorted(plan.completed) == ["c1", "k1", "p1"]
    s.commit_plan(plan)
    s.planner.queue(Interaction("v1", camera=CameraEvent("velocity", (0, 0, 0.05), (0, 0, 0, 1))))
    plan = s.plan_next_chunk()
    assert plan.controls.keys == ("w", "w", "w")         # the start script again
    s.commit_plan(plan)
    plan = s.plan_next_chunk()
    assert plan.active == ["v1"] and plan.completed == []  # velocity holds until replaced
    s.commit_plan(plan)
    s.planner.queue(Interaction("v2", camera=CameraEvent("velocity", (0, 0, 0), (0, 0, 0, 1))))
    plan = s.plan_next_chunk()
    assert plan.completed == ["v1"] and plan.active == ["v2"]
    # a plan that is not committed (the chunk failed) leaves everything as it was
    assert s.next_chunk == 4 and len(s.planner.pending) == 1


def test_control_queue_is_bounded():
    s = scheduled("a")
    s.planner.max_queued = 2
    assert s.planner.queue(Interaction("1", keys=["w"])) and s.planner.queue(Interaction("2", keys=["w"]))
    assert not s.planner.queue(Interaction("3", keys=["w"]))


def test_tombstones_keep_the_newest():
    t = Tombstones(capacity=2)
    for sid in ("a", "b", "c"):
        t.add(sid)
    assert "a" not in t and "b" in t and "c" in t


def test_in_flight_chunks_pace_and_bound_a_session():
    """A chunk counts for pacing when the ranks return it, not when its fragment arrives; at most
    max_in_flight chunks of a session are generated but undelivered."""
    sched = Scheduler(pacing_lead_s=10.0)
    s = ScheduledSession("a", start(num_frames=None), now=0.0, max_in_flight=2)
    sched.add(s)
    plan = s.plan_next_chunk()
    s.commit_plan(plan)                                   # chunk 0 generated (9 frames), in flight
    assert (s.clock.in_flight, s.clock.frames_generated, s.clock.frames_delivered) == (1, 9, 0)
    assert sched.pick(now=0.1)[0] is s                    # chunk 1 may start while chunk 0 is encoded
    s.commit_plan(s.plan_next_chunk())
    assert s.clock.in_flight == 2 and not s.ready
    assert sched.pick(now=0.2) == (None, math.inf)        # the bound: no third chunk in flight
    s.clock.delivered(9, now=0.3)                               # chunk 0's fragment reached the stream
    assert s.ready and s.clock.deadline() == pytest.approx(0.3 + 21 / 16)   # 9 + 12 frames generated
    s.clock.undelivered()                                       # chunk 1 will not be delivered (e.g. stopped)
    assert s.clock.in_flight == 0


def test_a_fractional_prompt_transition_is_truncated():
    s = scheduled("a", chunks=4)
    s.planner.queue(Interaction("p", prompt="night", transition_chunks=2.7))
    assert s.plan_next_chunk().controls.prompt_transition_chunks == 2


def test_fixed_pacer_keeps_its_lead():
    p = Pacer(1.5)
    for need, slack in ((0.3, 1.0), (0.4, 0.9), (0.9, -0.2), (0.2, 1.2)):
        p.observe(need, slack)
    assert p.lead_s == 1.5 and list(p.needs) == [0.3, 0.4, 0.9, 0.2]


def test_adaptive_pacer_learns_the_lead_it_needs():
    p = Pacer(1.5, adaptive=True, margin_s=0.1, q=0.5, window=4, min_samples=4)
    for need in (0.3, 0.5, 0.4, 0.2):                 # eligible -> delivered, all on time
        p.observe(need, slack_s=0.5)
        if len(p.needs) < 4:
            assert p.lead_s == 1.5                    # too few samples: the configured lead
    assert p.lead_s == pytest.approx(0.35 + 0.1)      # median of the needs + the margin
    p.observe(0.2, slack_s=0.1)                       # window 0.5, 0.4, 0.2, 0.2 -> median 0.3
    assert p.lead_s == pytest.approx(0.3 + 0.1)
    p.observe(0.9, slack_s=-0.5)                      # a stall of 0.5 s: the lead grows by it at once
    assert p.lead_s == pytest.approx(0.4 + 0.5)       # (the median, 0.3 + 0.1, would not cover it)
    p.observe(0.2, slack_s=0.3)                       # window 0.2, 0.2, 0.9, 0.2 -> median 0.2
    assert p.lead_s == pytest.approx(0.2 + 0.1)
    q = Pacer(1.5, adaptive=True, margin_s=0.1, q=0.9, window=4, min_samples=4)
    for _ in range(4):
        q.observe(0.0, slack_s=1.0)
    assert q.lead_s == pytest.approx(0.1)             # never below the margin
    q.observe(5.0, slack_s=-3.0)
    assert q.lead_s == 1.5                            # never above pacing_lead_s


def test_a_chunks_need_runs_from_eligible_to_delivered():
    """Eligible = max(due - lead, when the in-flight bound last allowed a chunk); need = delivered - that."""
    sched = Scheduler(pacing_lead_s=0.5, adaptive=True, margin_s=0.1, q=0.5)
    s = ScheduledSession("a", start(num_frames=None), now=0.0, max_in_flight=1)
    sched.add(s)
    assert sched.pick(now=0.0)[0] is s                # chunk 0: eligible at creation (0.0)
    s.commit_plan(s.plan_next_chunk())
    s.clock.delivered(9, now=0.4)                           # first delivery: the player starts at 0.4
    assert s.clock.ready_since == 0.4 and s.clock.deadline() == pytest.approx(0.4 + 9 / 16)
    assert sched.pick(now=0.45)[0] is None            # due 0.9625, lead 0.5: eligible from 0.4625
    assert sched.pick(now=0.47)[0] is s
    s.commit_plan(s.plan_next_chunk())
    s.clock.delivered(12, now=0.8)                          # 0.1625 s early; need 0.8 - 0.4625
    assert s.clock.pacer.needs[-1] == pytest.approx(0.8 - 0.4625) and s.clock.last_slack == pytest.approx(0.1625)


def test_scheduler_uses_each_sessions_lead():
    sched = Scheduler(pacing_lead_s=1.0)
    a, b = scheduled("a", now=0.0), scheduled("b", now=0.0)
    sched.add(a), sched.add(b)
    for s in (a, b):
        s.next_chunk += 1
        s.clock.generated(9)
        s.clock.delivered(9, now=0.0)                       # both due next at 0.5625
    a.clock.pacer.lead_s, b.clock.pacer.lead_s = 0.2, 0.5
    assert sched.pick(now=0.1)[0] is b                # b within its 0.5 s lead; a's 0.2 s not yet
    who, wait = sched.pick(now=0.0)
    assert who is None and wait == pytest.approx(0.5625 - 0.5)
    assert sched.pick(now=0.4)[0] in (a, b)           # both eligible: the earliest deadline (a tie)


def test_a_queued_control_goes_before_earlier_deadlines_but_not_before_a_late_session():
    sched = Scheduler(pacing_lead_s=2.0)
    a, b, c = (scheduled(sid, now=0.0) for sid in "abc")
    for s, delivered_at in ((a, 0.0), (b, 0.1), (c, 0.2)):
        sched.add(s)
        s.next_chunk += 1
        s.clock.generated(9)
        s.clock.delivered(9, now=delivered_at)              # due next at 0.5625, 0.6625, 0.7625
    assert sched.pick(now=0.3)[0] is a                # all within the lead: earliest deadline
    c.planner.queue(Interaction("turn", keys=["l", "l", "l"]))
    assert sched.pick(now=0.3)[0] is c                # c's control shows a chunk sooner
    assert sched.pick(now=0.6)[0] is a                # ... unless a's player would wait (due 0.5625)
    c.commit_plan(c.plan_next_chunk())                # c's chunk ran with the control: nothing queued
    assert sched.pick(now=0.3)[0] is a


def _keys(s):
    plan = s.plan_next_chunk()
    s.commit_plan(plan)
    return plan.controls.keys


def test_held_keys_hold_across_chunks_and_a_short_press_shows_for_one_latent_frame():
    s = scheduled("a", chunks=10, script=[("i", "i", "i")] * 10)
    assert _keys(s) == ("i", "i", "i")                        # the start script until key state arrives
    s.planner.queue(Interaction("1", hold=["w"]))
    assert _keys(s) == ("w", "w", "w")
    assert _keys(s) == ("w", "w", "w")                        # the level holds, with no new event
    s.planner.queue(Interaction("2", hold=["wj", "w"]))               # j tapped while w held
    assert _keys(s) == ("wj", "w", "w")
    s.planner.queue(Interaction("3", hold=[""]))
    assert _keys(s) == ("", "", "")                           # released: no keys (the script stays replaced)
    s.planner.queue(Interaction("4", hold=["d", ""]))                 # pressed and released between two chunks
    assert _keys(s) == ("d", "", "")
    s.planner.queue(Interaction("5", hold=["a"]))
    s.planner.queue(Interaction("6", hold=["", "s", ""]))             # two events before one chunk: both taps show
    assert _keys(s) == ("as", "", "")
    s.planner.queue(Interaction("7", hold=["w"]))
    assert _keys(s) == ("w", "w", "w")
    s.planner.queue(Interaction("8", hold=["s"]))                     # w (held before) let go for s: no tap of w
    assert _keys(s) == ("s", "s", "s")


def test_a_key_script_replaces_held_keys_and_the_other_way_round():
    s = scheduled("a", chunks=10)
    s.planner.queue(Interaction("1", hold=["w"]))
    assert _keys(s) == ("w", "w", "w")
    s.planner.queue(Interaction("2", keys=["l", "l", "l", "l"]))
    assert _keys(s) == ("l", "l", "l")
    assert _keys(s) == ("l", "", "")                          # the script runs out: nothing is held any more
    assert _keys(s) is None
    s.planner.queue(Interaction("3", keys=["k"] * 6))
    assert _keys(s) == ("k", "k", "k")
    s.planner.queue(Interaction("4", hold=["a"]))                     # key state cuts the rest of the script
    assert _keys(s) == ("a", "a", "a")
    s.planner.queue(Interaction("5", hold=["d"]))
    s.planner.queue(Interaction("6", keys=["i"]))                     # the later of the two wins within one chunk
    assert _keys(s) == ("i", "", "")
    plan = s.plan_next_chunk()
    assert plan.controls.keys is None and s.planner.held is None


def test_a_resumed_session_plans_the_chunks_it_would_have_planned():
    """Chunks 0-2 delivered, then the group fails: a new ScheduledSession given the journal (controls of the
    delivered chunks) and the interaction state after chunk 2 replays 3 chunks and then plans chunks 3-5 exactly
    as the session that never failed (a keys event and a target move running across the fault, held keys,
    an interaction that arrives after it)."""
    from deployments.session.events import Resume

    def feed(s, k):
        if k == 1:
            s.planner.queue(Interaction("k", keys=["w", "a", "s", "d", "i", "j", "k"]))      # 7 frames: chunks 1-3
            s.planner.queue(Interaction("c", camera=CameraEvent("target", (0, 0, 1), (0, 0, 0, 1), 3)))
        if k == 4:
            s.planner.queue(Interaction("h", hold=["l", ""]))

    whole = scheduled("a", chunks=6)
    controls, plans = [], []
    for k in range(6):
        feed(whole, k)
        plan = whole.plan_next_chunk()
        whole.commit_plan(plan)
        controls.append(plan.controls)
        plans.append(plan)
    resumed = scheduled("a", chunks=6)
    resumed.resume_from(Resume(tuple(controls[:3]), plans[2].interactions, 9 + 12 * 2))
    assert [p for p in resumed.planner.events] == ["k", "c"] and resumed.planner.events["k"].keys == ["k"]
    for k in range(3):
        assert resumed.replay.chunks[0] == controls[k]
        resumed.replayed()
    assert resumed.next_chunk == 3 and not resumed.replay
    for k in range(3, 6):
        feed(resumed, k)
        plan = resumed.plan_next_chunk()
        resumed.commit_plan(plan)
        assert plan.controls == controls[k] and (plan.started, plan.active, plan.completed) == \
            (plans[k].started, plans[k].active, plans[k].completed), k
    assert controls[3].keys == ("k", "", "") and controls[4].keys == ("l", "", "")


def test_a_replay_fills_the_gaps_between_the_chunks_others_need():
    """A resumed session replaying its journal is never 'late': a session whose chunk is due goes first, and
    the replay runs while the others are ahead of their playback."""
    from collections import deque
    sched = Scheduler(pacing_lead_s=0.2)
    replaying, live = scheduled("r", chunks=10, now=0.0), scheduled("l", chunks=10, now=0.0)
    replaying.replay.chunks = deque([ChunkControls()] * 3)
    sched.add(replaying)
    sched.add(live)
    assert sched.pick(now=1.0)[0] is live                      # due (its first chunk): before the replay
    live.commit_plan(live.plan_next_chunk())
    live.clock.delivered(9, now=1.2)                                 # 9 frames at 16 fps: the next is due at 1.76 s
    assert sched.pick(now=1.3)[0] is replaying                 # live is further ahead than its 0.2 s lead
    replaying.replayed()
    assert sched.pick(now=1.6)[0] is live                      # within its lead again: before the replay


def test_a_resumed_session_keeps_its_viewers_playback_clock():
    """Resumed with 2 s of video left in the client's player (a wall-clock end), the next chunk is due when it
    has played out: the session waits until its lead before it, then a chunk delivered late counts as a
    stall. Without a playback end the first chunk is due at once."""
    from deployments.session.events import Resume
    sched = Scheduler(pacing_lead_s=0.5)
    moved = scheduled("m", chunks=10, now=100.0)
    moved.resume_from(Resume((ChunkControls(),) * 4, None, 9 + 12 * 3, 3, (), playback_end=1002.0), 4,
                      now=100.0, wall=1000.0)
    sched.add(moved)
    who, wait = sched.pick(now=100.0)
    assert who is None and wait == pytest.approx(2.0 - 0.5)          # due at 102 s, eligible 0.5 s before
    assert sched.pick(now=101.5)[0] is moved
    moved.commit_plan(moved.plan_next_chunk())                       # chunk 4: 12 frames in flight
    moved.clock.delivered(12, now=102.25)                                  # the player waited 0.25 s for it
    assert moved.clock.stalls == 1 and moved.clock.stall_seconds == pytest.approx(0.25)
    assert moved.clock.deadline() == pytest.approx(102.25 + 12 / 16)
    replaying = scheduled("r", chunks=10, now=100.0)                    # a replay catches up at once, whatever
    replaying.resume_from(Resume((ChunkControls(),) * 4, None, 9 + 12 * 3, 1, (), playback_end=1002.0), 2,
                          now=100.0, wall=1000.0)                    # its clock: chunks 2, 3 to replay
    assert len(replaying.replay.chunks) == 2
    sched.add(replaying)
    assert sched.pick(now=100.5) == (replaying, 0.0)                 # 1.5 s before its lead; moved's next: 103 s
    fresh = scheduled("f", chunks=10, now=100.0)
    fresh.resume_from(Resume((ChunkControls(),) * 4, None, 9 + 12 * 3, 3, ()), 4)
    assert fresh.clock.deadline() == 100.0                                 # unknown: at once


def test_a_held_lead_stays_whatever_the_chunks_need():
    pacer = Pacer(1.5, adaptive=True, margin_s=0.1)
    for _ in range(8):
        pacer.observe(0.2, 1.0)
    assert pacer.lead_s == pytest.approx(0.3)
    pacer.hold_lead(3.0)                                             # a group about to hand the session on
    for _ in range(8):
        pacer.observe(0.2, 1.0)
    assert pacer.lead_s == 3.0 and pacer.max_lead_s == 3.0


def test_the_plan_is_whole_its_rung_in_its_controls():
    """The planner returns the whole plan: the rung the ladder chose is in the controls every rank applies (steps,
    decoder, a decoder to warm) and in the plan (what the ladder learns the chunk's cost at); nothing is written
    into a plan after planning. Without a rung, a chunk runs the model's own configuration."""
    from deployments.group.ladder import ChunkRung
    from lingbot.runtime.rungs import rung
    s = scheduled("a", chunks=4)
    warming = ChunkRung(rung("tiny_steps2"), "tae", "wan")
    plan = s.plan_next_chunk(warming, restarted=True)
    c = plan.controls
    assert (c.steps, c.decoder, c.prewarm, c.quality, plan.rung, plan.restarted) == (2, "tae", "wan", "tiny_steps2",
                                                                                    warming, True)
    plan = s.plan_next_chunk()
    assert (plan.controls.quality, plan.controls.prewarm, plan.rung.rung.name, plan.restarted) == ("full", None,
                                                                                                 "full", False)
