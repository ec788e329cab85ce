"""A session's life without Ray or Starlette: its phases through start, admission, streaming, a fault, a drain and
the end, driven by a wire and a group link of the test's own (the served tests in tests/deployments/ run the
same life over real WebSockets and groups)."""
import asyncio
import collections
import dataclasses
import time

import numpy as np
import pytest

from deployments.session.codes import CLOSE_TRY_AGAIN, ErrorCode, ProtocolError
from deployments.session.events import (
    Admitted,
    ChunkControls,
    ChunkReady,
    InteractionState,
    ModelFacts,
    Moving,
    Resumed,
    SessionDone,
    SessionFailed,
    SnapshotOwner,
    SnapshotRef,
)
from deployments.session.life import Phase, SessionLife
from deployments.session.phases import PhaseError
from deployments.session.ports import ACTIVITY, STOP, ClientGone
from deployments.session.requests import Interaction, StartRequest
from deployments.session.waiting import Growth, WaitingRoom
from deployments.settings import ServeSettings
from lingbot.config import get_preset

FACTS = ModelFacts.of(get_preset("tiny"))
SETTINGS = ServeSettings(admission_wait_s=0.5, resume_wait_s=0.5, start_timeout_s=2.0)


class Wire:
    """A client: messages it will send (a dict, or a float: wait that long first), and what it received."""

    def __init__(self, messages=()):
        self.incoming = collections.deque(messages)
        self.wait_until = None                   # the end of the wait at the front (from when it was first read)
        self.log: list = []

    async def receive(self, timeout, limit):
        """The next message, as a socket gives it: a read that is cancelled loses nothing (a wait at the front
        goes on counting from when it was first read)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            now = loop.time()
            if not self.incoming or isinstance(self.incoming[0], float):
                if self.incoming and self.wait_until is None:
                    self.wait_until = now + self.incoming[0]
                if self.incoming and now >= self.wait_until:
                    self.incoming.popleft()
                    self.wait_until = None
                    continue
                if now >= deadline:
                    raise asyncio.TimeoutError
                until = min(deadline, self.wait_until if self.incoming else deadline)
                await asyncio.sleep(max(0.0, min(until - now, 0.05)))
                continue
            msg = self.incoming.popleft()
            break
        if msg == "gone":
            raise ClientGone()
        if isinstance(msg, ProtocolError):
            raise msg
        return msg

    async def send(self, data):
        self.log.append(("send", data))

    def keepalive_reply(self, msg):
        return {"pong": True} if msg["type"] == "ping" else None

    async def parse_start(self, msg, facts):
        if msg["type"] != "start":
            raise ProtocolError(ErrorCode.NOT_STARTED, "start first")
        return StartRequest("p", np.zeros((3, facts.height, facts.width), np.float32), facts.width, facts.height,
                            msg.get("chunks"), None, 16.0, 1, None, [], unknown_fields=msg.get("unknown", ()))

    def control(self, msg, seq):
        if msg["type"] == "stop":
            return STOP
        if msg["type"] == "beat":
            return ACTIVITY
        return Interaction(msg["id"], keys=["w"])

    def queued(self, interaction):
        return {"queued": interaction.event_id}

    def queued_message(self, position, eta_s):
        return {"waiting": position, "eta_s": eta_s}

    def limit_error(self, code, text):
        return ProtocolError(code, text, close=1000)

    async def send_error(self, error):
        self.log.append(("error", error.code))

    async def close_with(self, error):
        self.log.append(("close", error.code, error.close))

    async def send_admitted(self, admitted, start, session_id):
        self.log.append(("admitted", admitted.group))

    async def send_chunk(self, event, transport_index, send):
        self.log.append(("chunk", event.index, transport_index))
        return True

    async def send_resumed(self, event, chunk_index, transport_index, gap_s, reason, send):
        self.log.append(("resumed", chunk_index, event.restored, reason))
        return True

    async def finish(self, stopped, chunks):
        self.log.append(("done", stopped, chunks))


class Lease:
    """One streaming call: yields its events; a float is a pause; it waits forever after the last one."""

    def __init__(self, events):
        self.events = list(events)
        self.cancelled = False

    def __aiter__(self):
        return self

    async def __anext__(self):
        while self.events:
            event = self.events.pop(0)
            if isinstance(event, float):
                await asyncio.sleep(event)
                continue
            return event
        await asyncio.Event().wait()

    def cancel(self):
        self.cancelled = True


AT_MAX = Growth(running=1, starting=0, max_groups=1)


class Groups:
    """Serve's routing stood in for by a list of leases, one per call; the requests are kept. `growth` is what
    Serve's status says about the groups (by default: at max_groups, none starting: no group can come)."""

    def __init__(self, *leases, growth=AT_MAX):
        self.leases = list(leases)
        self.requests, self.posted, self.released = [], [], []
        self.released_by = []                                  # how many releases each lease came after
        self.census = growth

    async def facts(self):
        return FACTS

    def lease(self, request):
        self.requests.append(request)
        self.released_by.append(len(self.released))
        return self.leases.pop(0) if self.leases else Lease([SessionFailed(ErrorCode.CAPACITY_EXHAUSTED, "full")])

    def post(self, mailbox, session_id, interaction):
        self.posted.append((mailbox, session_id, interaction.event_id))

    async def keeper(self):
        return "keeper"

    def let_go(self, session_id, keys=None):
        self.released.append((session_id, keys))

    async def growth(self):
        return self.census(time.monotonic()) if callable(self.census) else self.census


class Metrics:
    def __init__(self):
        self.refusals, self.resumes, self.unknown = [], [], 0

    def unknown_fields(self, count):
        self.unknown += count

    def refused(self, code):
        self.refusals.append(code)

    def admitted(self):
        pass

    def chunk_interval(self, seconds):
        pass

    def resumed(self, outcome, reason):
        self.resumes.append((outcome, reason))


class Limits:
    def __init__(self):
        self.active = 0

    def admit(self, tenant, now):
        self.active += 1

    def release(self, tenant):
        self.active -= 1


def admitted(group: str) -> Admitted:
    return Admitted(group, f"mailbox-{group}", "video/mp4", 2, FACTS)


def chunk(index: int, started=()) -> ChunkReady:
    snapshots = tuple(SnapshotRef(index, r, f"slot{index}.{r}", f"state{index}.{r}") for r in range(2))
    return ChunkReady(index, b"x", FACTS.geometry.pixel_frames(index), list(started), [], [], {}, 0.1,
                      controls=ChunkControls(keys=("w",) * 3), interactions=InteractionState({}, None),
                      snapshots=snapshots)


def live(wire: Wire, groups: Groups, settings=SETTINGS, metrics=None):
    """Run one session's life to its end; (the life, the phases it went through, the limits)."""
    async def scenario():
        life = SessionLife(wire, groups, settings, metrics or Metrics())
        phases = []
        enter = life.enter

        def recording(phase):
            enter(phase)
            phases.append(phase)
        life.enter = recording
        limits = Limits()
        await asyncio.wait_for(life.run("t", limits), 30)
        return life, phases, limits
    return asyncio.run(scenario())


def test_a_session_runs_from_start_to_done():
    wire = Wire([{"type": "ping"}, {"type": "start", "chunks": 2}])
    groups = Groups(Lease([admitted("g1"), chunk(0), chunk(1), SessionDone(2)]))
    life, phases, limits = live(wire, groups)
    assert phases == [Phase.ADMITTING, Phase.STREAMING, Phase.ENDED] and life.phase is Phase.ENDED
    assert wire.log == [("send", {"pong": True}), ("admitted", "g1"), ("chunk", 0, 0), ("chunk", 1, 1),
                        ("done", False, 2)]
    assert life.ledger.chunks == 2 and limits.active == 0
    assert groups.requests[0].keeper == SnapshotOwner("keeper", life.session_id)
    assert groups.released[-1] == (life.session_id, None)          # its end frees every snapshot it had


def test_start_fields_not_known_here_are_ignored_counted_and_logged_once(caplog):
    import logging
    names = tuple(f"f{i}" for i in range(20))
    wire, metrics = Wire([{"type": "start", "chunks": 1, "unknown": names}]), Metrics()
    with caplog.at_level(logging.INFO, logger="ray.serve"):
        life, _, _ = live(wire, Groups(Lease([admitted("g1"), chunk(0), SessionDone(1)])), metrics=metrics)
    assert wire.log[-1] == ("done", False, 1) and metrics.unknown == 20
    (line,) = [r.getMessage() for r in caplog.records if "not known here" in r.getMessage()]
    assert line == (f"session {life.session_id}: start fields not known here, ignored: "
                    f"{', '.join(names[:16])} (+4 more)")


def test_a_fault_resumes_on_another_group_from_the_ledger():
    wire = Wire([{"type": "start", "chunks": 3}])
    failed = Lease([admitted("g1"), chunk(0), chunk(1), SessionFailed(ErrorCode.INTERNAL_ERROR, "rank died")])
    rebuilt = Lease([admitted("g2"), Resumed(0, 0.0, 2), chunk(2), SessionDone(3)])
    groups = Groups(failed, rebuilt)
    life, phases, _ = live(wire, groups)
    assert phases == [Phase.ADMITTING, Phase.STREAMING, Phase.RESUMING, Phase.STREAMING, Phase.ENDED]
    assert failed.cancelled and (life.faults, life.resumes) == (1, 1)
    request = groups.requests[1]
    assert request.session_id == f"{life.session_id}.1"             # its own id at the group
    assert request.resume.next_index == 2 and request.resume.snapshot_index == 1
    assert [r.state for r in request.resume.restore] == ["state1.0", "state1.1"]
    owner = SnapshotOwner("keeper", life.session_id)                # the keeper that holds them, the same id
    assert request.keeper == owner and {r.owner for r in request.resume.restore} == {owner}
    # what a restore from chunk 1 does not need went back while it streamed (chunk 0's state); nothing it needs
    assert groups.released[:groups.released_by[1]] == [(life.session_id, ["state0.0", "state0.1"])]
    assert groups.released[-1] == (life.session_id, None)
    assert ("resumed", 2, 2, "fault") in wire.log and wire.log[-1] == ("done", False, 3)
    assert life.metrics.resumes == [("resumed", "fault")]


def test_a_drain_moves_the_session_with_its_last_snapshots_and_is_no_fault():
    wire = Wire([{"type": "start", "chunks": 2}, 0.05, {"type": "act", "id": "e1"}])
    last = tuple(SnapshotRef(0, r, f"late-slot0.{r}", f"late-state0.{r}") for r in range(2))
    stopping = Lease([admitted("g1"), chunk(0), 0.3, Moving("group_stopping", last)])
    new = Lease([admitted("g2"), Resumed(0, 0.0, 1), chunk(1, started=["e1"]), SessionDone(2)])
    settings = dataclasses.replace(SETTINGS, max_resumes=0)         # a drain does not count against it
    groups = Groups(stopping, new)
    life, phases, _ = live(wire, groups, settings)
    assert Phase.RESUMING in phases and life.faults == 0 and life.resume_reason == "drain"
    assert [r.state for r in groups.requests[1].resume.restore] == ["late-state0.0", "late-state0.1"]
    # the interaction went to the first group; it had not started it, so it goes to the second one too
    assert [(mailbox, eid) for mailbox, _, eid in groups.posted] == [("mailbox-g1", "e1"), ("mailbox-g2", "e1")]
    assert ("send", {"queued": "e1"}) in wire.log and wire.log[-1] == ("done", False, 2)


def test_full_groups_refuse_after_the_admission_wait_and_the_client_is_told_meanwhile():
    wire = Wire([{"type": "start"}])
    life, phases, limits = live(wire, Groups())
    assert phases == [Phase.ADMITTING, Phase.ENDED]
    # told its place once (it did not change), then refused
    assert wire.log == [("send", {"waiting": 1, "eta_s": None}),
                        ("close", ErrorCode.CAPACITY_EXHAUSTED, CLOSE_TRY_AGAIN)] and limits.active == 0
    assert life.room.waiting == {}
    assert life.metrics.refusals == [ErrorCode.CAPACITY_EXHAUSTED]


def test_a_fault_past_max_resumes_ends_the_session_with_its_code():
    wire = Wire([{"type": "start"}])
    groups = Groups(Lease([admitted("g1"), chunk(0), SessionFailed(ErrorCode.INTERNAL_ERROR, "rank died")]))
    _life, phases, _ = live(wire, groups, dataclasses.replace(SETTINGS, max_resumes=0))
    assert phases == [Phase.ADMITTING, Phase.STREAMING, Phase.ENDED] and len(groups.requests) == 1
    assert wire.log[-1] == ("close", ErrorCode.INTERNAL_ERROR, 1011)


def test_the_client_stops_or_leaves_and_bad_messages_are_refused_in_place():
    wire = Wire([{"type": "act"}, {"type": "start"}, 0.2, {"type": "beat"}, {"type": "stop"}])
    _, phases, _ = live(wire, Groups(Lease([admitted("g1"), chunk(0)])))
    assert ("error", ErrorCode.NOT_STARTED) in wire.log and wire.log[-1] == ("done", True, 1)
    wire = Wire([{"type": "start"}, 0.1, "gone"])
    _life, phases, _ = live(wire, Groups(Lease([admitted("g1")])))
    assert phases[-1] is Phase.ENDED and not any(entry[0] == "done" for entry in wire.log)


def test_phases_only_move_along_the_diagram():
    life = SessionLife(Wire(), Groups(), SETTINGS, Metrics())
    with pytest.raises(PhaseError, match="waiting_for_start -> streaming"):
        life.enter(Phase.STREAMING)
    life.enter(Phase.ADMITTING)
    with pytest.raises(PhaseError, match="admitting -> resuming"):
        life.enter(Phase.RESUMING)
    life.enter(Phase.ENDED)
    with pytest.raises(PhaseError):
        life.enter(Phase.STREAMING)


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


def test_a_flood_of_messages_is_dropped_past_the_rate_and_the_client_told_once_a_second():
    """max_messages_per_s 10 (a burst of 20): of 60 pings at once about 20 are answered, one rate_limited; after a
    pause the bucket has refilled and the session goes on to its end."""
    settings = dataclasses.replace(SETTINGS, max_messages_per_s=10.0)
    wire = Wire([{"type": "start", "chunks": 1}, *[{"type": "ping"}] * 60, 0.5, {"type": "ping"}])
    groups = Groups(Lease([admitted("g1"), 0.8, chunk(0), SessionDone(1)]))
    life, _, _ = live(wire, groups, settings)
    pongs = [e for e in wire.log if e == ("send", {"pong": True})]
    # the start took one token, the flood 19 (20 if the bucket refilled one while it was read), the late ping one
    assert 40 <= life.rate.dropped <= 41 and len(pongs) == 61 - life.rate.dropped
    assert wire.log.count(("error", ErrorCode.RATE_LIMITED)) == 1 and wire.log[-1] == ("done", False, 1)
    assert life.metrics.refusals == [ErrorCode.RATE_LIMITED]


def test_the_rate_refills_and_tells_at_most_once_a_second():
    from deployments.session.rate import MessageRate
    rate = MessageRate(per_s=2.0, now=0.0)
    assert [rate.take(0.0) for _ in range(5)] == [True] * 4 + [False]         # a burst of twice the rate
    first = rate.refusal(0.0)
    assert first.code == ErrorCode.RATE_LIMITED and first.extra["retry_after_s"] == 0.5 and first.close is None
    assert rate.refusal(0.5) is None and rate.refusal(1.0) is not None         # told again a second later
    assert rate.take(1.0) and rate.take(1.0) and not rate.take(1.0)            # 1 s refilled 2
    assert rate.take(100.0) and rate.tokens == 3.0 and rate.dropped == 2       # never more than the burst


def test_while_no_group_holds_the_session_the_interactions_waiting_for_one_are_bounded():
    """A fault, and the next group is slow to come: interactions wait in the ledger, at most
    max_queued_controls of them; the excess is refused with too_many_controls and the rest go to the new group."""
    settings = dataclasses.replace(SETTINGS, max_queued_controls=3, resume_wait_s=5.0)
    acts = [{"type": "act", "id": f"e{i}"} for i in range(5)]
    wire = Wire([{"type": "start", "chunks": 2}, 0.2, *acts])
    failed = Lease([admitted("g1"), chunk(0), 0.1, SessionFailed(ErrorCode.INTERNAL_ERROR, "rank died")])
    late = Lease([0.6, admitted("g2"), Resumed(0, 0.0, 1), chunk(1, started=["e0", "e1", "e2"]), SessionDone(2)])
    life, phases, _ = live(wire, Groups(failed, late), settings)
    assert Phase.RESUMING in phases and wire.log[-1] == ("done", False, 2)
    assert wire.log.count(("error", ErrorCode.TOO_MANY_CONTROLS)) == 2
    assert [eid for _, _, eid in life.groups.posted] == ["e0", "e1", "e2"]      # to the new group only
    assert life.ledger.unstarted == []


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
