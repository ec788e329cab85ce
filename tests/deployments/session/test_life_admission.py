"""A session's admission without Ray or Starlette: while every group is full it waits in the queue, told its
place and an estimate, as long as a group may still come (else admission_wait_s), bounded in time and in
number, and a client that leaves or stops while it waits is seen at once (the stand-ins: standins.py)."""
import asyncio
import dataclasses
import time

from deployments.session.codes import CLOSE_TRY_AGAIN, ErrorCode
from deployments.session.events import SessionDone, SessionFailed
from deployments.session.life import Phase, SessionLife
from deployments.session.waiting import Growth, WaitingRoom
from tests.deployments.session.standins import SETTINGS, Groups, Lease, Limits, Metrics, Wire, admitted, chunk, live


def test_full_groups_refuse_after_the_admission_wait_and_the_client_is_told_meanwhile():
    wire = Wire([{"type": "start"}])
    life, phases, limits = live(wire, Groups())
    assert phases == [Phase.ADMITTING, Phase.ENDED]
    # told its place once (it did not change), then refused
    assert wire.log == [("send", {"waiting": 1, "eta_s": None}),
                        ("close", ErrorCode.CAPACITY_EXHAUSTED, CLOSE_TRY_AGAIN)] and limits.active == 0
    assert life.room.waiting == {}
    assert life.metrics.refusals == [ErrorCode.CAPACITY_EXHAUSTED]


def test_a_waiting_session_learns_its_place_and_an_estimate_as_the_queue_moves():
    room = WaitingRoom()
    for sid, at in (("a", 0.0), ("b", 1.0), ("c", 2.0)):
        room.join(sid, now=at)
    assert [room.position(s) for s in "abcx"] == [1, 2, 3, 0] and room.eta_s(1, now=3.0) is None
    room.leave("a", admitted=True, now=10.0)
    room.leave("b", admitted=True, now=14.0)              # one admission every 4 s
    assert room.position("c") == 1 and room.eta_s(1, now=15.0) == 4.0 and room.eta_s(3, now=15.0) == 12.0
    room.leave("c", admitted=False, now=16.0)              # refused or gone: not a measure of the pace
    assert len(room.admissions) == 2 and room.eta_s(1, now=10.0 + 301.0) is None    # old news is forgotten


def test_a_session_admitted_after_waiting_was_told_and_counts_for_the_estimate():
    wire = Wire([{"type": "start", "chunks": 1}])
    full = Lease([SessionFailed(ErrorCode.CAPACITY_EXHAUSTED, "full")])
    groups = Groups(full, Lease([admitted("g1"), chunk(0), SessionDone(1)]))
    life, _, _ = live(wire, groups)
    assert wire.log[0] == ("send", {"waiting": 1, "eta_s": None}) and wire.log[-1] == ("done", False, 1)
    assert len(life.room.admissions) == 1


def test_while_a_group_may_still_come_a_session_waits_past_the_admission_wait_told_the_start_estimate():
    """Below max_groups (or a group starting) the session waits in the queue (up to max_queue_wait_s), not
    admission_wait_s; its client hears its place and what is left of a measured group start."""
    wire = Wire([{"type": "start", "chunks": 1}])
    growing = Growth(running=1, starting=1, max_groups=2, start_s=30.0)
    groups = Groups(Lease([1.6, admitted("g2"), chunk(0), SessionDone(1)]), growth=growing)
    t0 = time.monotonic()
    life, phases, _ = live(wire, groups)                       # SETTINGS.admission_wait_s is 0.5
    assert time.monotonic() - t0 >= 1.6 and phases == [Phase.ADMITTING, Phase.STREAMING, Phase.ENDED]
    told = [data for kind, data, *_ in wire.log if kind == "send" and "waiting" in data]
    assert told and all(t["waiting"] == 1 for t in told)
    assert told[0]["eta_s"] in (29.0, 30.0) and told[-1]["eta_s"] in (28.0, 29.0)   # whole seconds, counting down
    assert wire.log[-1] == ("done", False, 1) and life.metrics.refusals == []


def test_with_no_group_to_come_the_refusal_is_immediate_by_default():
    wire = Wire([{"type": "start"}])
    t0 = time.monotonic()
    _, phases, _ = live(wire, Groups(Lease([30.0, admitted("g1")]),
                                     growth=Growth(running=2, starting=0, max_groups=2)),
                        dataclasses.replace(SETTINGS, admission_wait_s=0.0))
    assert time.monotonic() - t0 < 2.0                         # the first tick (0.5 s) saw no group could come
    assert phases == [Phase.ADMITTING, Phase.ENDED] and wire.log[-1] == ("close", ErrorCode.CAPACITY_EXHAUSTED,
                                                                         CLOSE_TRY_AGAIN)


def test_a_seat_a_groups_ladder_holds_back_is_waited_for_though_no_group_can_come():
    """At max_groups with admission_wait_s 0, a group that refuses because its quality ladder holds a free seat back
    (SessionFailed.seat_held: a sink passing, the load too high for one more) keeps the session waiting, told its
    place, until the group takes it; a plain full answer still refuses at once."""
    held = SessionFailed(ErrorCode.CAPACITY_EXHAUSTED, "group is full: ... while a session's sink runs", seat_held=True)
    wire = Wire([{"type": "start", "chunks": 1}])
    groups = Groups(*(Lease([held]) for _ in range(4)), Lease([admitted("g1"), chunk(0), SessionDone(1)]))
    life, phases, _ = live(wire, groups, dataclasses.replace(SETTINGS, admission_wait_s=0.0))
    assert phases == [Phase.ADMITTING, Phase.STREAMING, Phase.ENDED] and len(groups.requests) == 5
    assert wire.log[0] == ("send", {"waiting": 1, "eta_s": None}) and wire.log[-1] == ("done", False, 1)
    assert life.metrics.refusals == []


def test_a_session_queued_when_the_last_allowed_group_comes_up_is_admitted_there():
    """The race of a burst at start: a session waits while the second (last allowed) group starts; Serve then
    reports it running (running == max_groups, none starting) a moment before the session's queued lease is
    routed to it. With admission_wait_s 0 that moment used to refuse the session; it is admitted."""
    wire = Wire([{"type": "start", "chunks": 1}])
    up = time.monotonic() + 0.6
    groups = Groups(Lease([1.6, admitted("g2"), chunk(0), SessionDone(1)]),     # routed 1 s after it is up
                    growth=lambda now: Growth(1, 1, 2, 20.0) if now < up else Growth(2, 0, 2, 20.0, grew_at=up))
    life, phases, _ = live(wire, groups, dataclasses.replace(SETTINGS, admission_wait_s=0.0))
    assert phases == [Phase.ADMITTING, Phase.STREAMING, Phase.ENDED] and wire.log[-1] == ("done", False, 1)
    assert life.metrics.refusals == []


def test_the_queue_wait_is_bounded_and_a_deployment_that_stops_growing_refuses():
    wire = Wire([{"type": "start"}])
    settings = dataclasses.replace(SETTINGS, max_queue_wait_s=1.0)
    t0 = time.monotonic()
    live(wire, Groups(Lease([30.0, admitted("g1")]), growth=Growth(1, 1, 2, 20.0)), settings)
    assert 1.0 <= time.monotonic() - t0 < 3.0 and wire.log[-1][1] == ErrorCode.CAPACITY_EXHAUSTED
    # a group was starting, then its start failed at max_groups: refused admission_wait_s (0.5 s) after that
    wire = Wire([{"type": "start"}])
    flip = time.monotonic() + 1.0
    groups = Groups(Lease([30.0, admitted("g1")]),
                    growth=lambda now: Growth(1, 1, 2, 20.0) if now < flip else Growth(2, 0, 2, 20.0))
    live(wire, groups)
    assert flip + 0.5 <= time.monotonic() < flip + 2.0 and wire.log[-1][1] == ErrorCode.CAPACITY_EXHAUSTED


def test_a_start_beyond_the_waiting_bound_is_refused_at_once_and_the_queue_keeps_its_order():
    """max_waiting_sessions 1: with one session waiting, a second start is refused at once (capacity_exhausted,
    1013, retry_after_s), not queued behind it."""
    settings = dataclasses.replace(SETTINGS, max_waiting_sessions=1)
    room = WaitingRoom()
    room.join("someone-waiting", now=time.monotonic())
    wire = Wire([{"type": "start"}])
    t0 = time.monotonic()

    groups = Groups(Lease([30.0, admitted("g1")]), growth=Growth(1, 1, 2, 20.0))

    async def scenario():
        life = SessionLife(wire, groups, settings, Metrics(), room)
        await asyncio.wait_for(life.run("t", Limits()), 30)
        return life
    life = asyncio.run(scenario())
    assert groups.released == []                     # it never asked a keeper for anything: nothing to let go
    assert time.monotonic() - t0 < 1.0 and life.phase is Phase.ENDED
    assert wire.log[-1] == ("close", ErrorCode.CAPACITY_EXHAUSTED, CLOSE_TRY_AGAIN)
    assert life.metrics.refusals == [ErrorCode.CAPACITY_EXHAUSTED] and list(room.waiting) == ["someone-waiting"]


def test_a_client_that_leaves_or_stops_while_it_waits_is_seen_at_once_and_sent_nothing_more():
    """While a group may still come (the session waits, up to max_queue_wait_s) the ingress reads the client: one
    that leaves frees its place at once and is sent nothing more (Serve's proxy logs a send to a closed
    connection as an error); one that stops gets its done (0 chunks); a ping meanwhile is answered, and an
    interaction sent meanwhile is kept for the stream."""
    growing = Growth(running=1, starting=1, max_groups=2, start_s=30.0)
    for ending, last in (("gone", None), ({"type": "stop"}, ("done", True, 0))):
        wire = Wire([{"type": "start"}, 0.3, {"type": "ping"}, 0.3, ending])
        room = WaitingRoom()
        groups = Groups(Lease([30.0, admitted("g1")]), growth=growing)
        t0 = time.monotonic()

        async def scenario(wire=wire, groups=groups, room=room):
            life = SessionLife(wire, groups, SETTINGS, Metrics(), room)
            await asyncio.wait_for(life.run("t", Limits()), 30)
            return life
        life = asyncio.run(scenario())
        assert time.monotonic() - t0 < 3.0 and life.phase is Phase.ENDED and not room.waiting
        assert ("send", {"pong": True}) in wire.log and groups.requests[0].session_id == life.session_id
        ends = [e for e in wire.log if e[0] in ("close", "error", "done")]
        assert ends == ([] if last is None else [last]), wire.log          # gone: nothing sent after it
    # an interaction sent while it waits goes to the group once it streams
    wire = Wire([{"type": "start", "chunks": 1}, 0.1, {"type": "act", "id": "early"}])
    groups = Groups(Lease([0.5, admitted("g1"), 0.3, chunk(0, started=["early"]), SessionDone(1)]), growth=growing)
    life, _, _ = live(wire, groups)
    assert wire.log[-1] == ("done", False, 1) and [eid for _, _, eid in groups.posted] == ["early"]


def test_a_burst_of_starts_never_waits_beyond_the_waiting_bound():
    """Three starts at once with max_waiting_sessions 2 and every group full: two wait, the third is refused at
    once (capacity_exhausted); the bound is taken before the start awaits anything, so a burst cannot pass it
    together."""
    settings = dataclasses.replace(SETTINGS, max_waiting_sessions=2)
    room = WaitingRoom()
    groups = Groups(*(Lease([30.0, admitted("g1")]) for _ in range(3)), growth=Growth(1, 1, 2, 20.0))
    lives = []

    async def scenario():
        lives.extend(SessionLife(Wire([{"type": "start"}]), groups, settings, Metrics(), room) for _ in range(3))
        runs = [asyncio.create_task(life.run(f"t{i}", Limits())) for i, life in enumerate(lives)]
        await asyncio.sleep(0.5)
        waiting = len(room.waiting)
        for run in runs:
            run.cancel()
        await asyncio.gather(*runs, return_exceptions=True)
        return waiting
    assert asyncio.run(scenario()) == 2 and not room.waiting
    assert sorted(len(life.metrics.refusals) for life in lives) == [0, 0, 1]
    assert [life.metrics.refusals for life in lives if life.metrics.refusals] == [[ErrorCode.CAPACITY_EXHAUSTED]]
