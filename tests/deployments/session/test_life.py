"""A session's life without Ray or Starlette: its phases through start, streaming, a fault, a drain and the end,
the client's stop, departure and bad messages, and its message rate, driven by a wire and a group link of the
test's own (tests/deployments/session/standins.py; the served tests in tests/deployments/ run the same life over
real WebSockets and groups). Its admission and waiting: test_life_admission.py."""
import dataclasses

import pytest

from deployments.session.codes import ErrorCode
from deployments.session.events import Moving, Resumed, SessionDone, SessionFailed, SnapshotOwner, SnapshotRef
from deployments.session.life import Phase, SessionLife
from deployments.session.phases import PhaseError
from tests.deployments.session.standins import SETTINGS, Groups, Lease, Metrics, Wire, admitted, chunk, live


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


def test_a_flood_of_messages_is_dropped_past_the_rate_and_the_client_told_once_a_second():
    """max_messages_per_s 10 (a burst of 20): of 60 pings at once about 20 are answered, one rate_limited; after a
    pause the bucket has refilled and the session goes on to its end."""
    settings = dataclasses.replace(SETTINGS, max_messages_per_s=10.0)
    wire = Wire([{"type": "start", "chunks": 1}, *[{"type": "ping"}] * 60, 0.5, {"type": "ping"}])
    groups = Groups(Lease([admitted("g1"), 0.8, chunk(0), SessionDone(1)]))
    life, _, _ = live(wire, groups, settings)
    pongs = [e for e in wire.log if e == ("send", {"pong": True})]
    # the start took one token, the flood 19 (20 if the bucket refilled one while it was read), the late ping one
    assert 40 <= life.reader.rate.dropped <= 41 and len(pongs) == 61 - life.reader.rate.dropped
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
