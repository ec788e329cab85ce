"""Reading a session's client (deployments/session/reading.py): the rate counted before a message is decoded, and
a session waiting for a group keeping only its parsed interactions, bounded, with every other message refused at
once (issue: one client must never deny service to all)."""
import dataclasses
import sys

from deployments.session.codes import ErrorCode
from deployments.session.events import SessionDone, SessionFailed
from deployments.session.reading import EVENT_BYTES, EarlyControls
from deployments.session.requests import Interaction
from deployments.session.waiting import Growth
from tests.deployments.session.standins import SETTINGS, Groups, Lease, Wire, admitted, chunk, live


def test_early_controls_keep_in_order_within_their_count_and_bytes():
    early = EarlyControls(max_count=3, max_bytes=3 * EVENT_BYTES + 10)
    assert early.keep(Interaction("a", keys=["w"])) is None and early.keep(Interaction("b", prompt="hi")) is None
    assert early.bytes == 2 * EVENT_BYTES + 3
    over = early.keep(Interaction("c", prompt="x" * 8))                 # the bytes would pass 202
    assert (over.code, over.extra, over.close) == (ErrorCode.TOO_MANY_CONTROLS, {"event_id": "c"}, None)
    assert "more than 3 interactions (or 202 bytes of them)" in over.message
    assert early.keep(Interaction("d", prompt="é")) is None               # 2 bytes of UTF-8: 197, kept
    assert early.keep(Interaction("e")).code == ErrorCode.TOO_MANY_CONTROLS          # the count: 3 already
    assert [early.take().event_id for _ in range(3)] == ["a", "b", "d"] and early.bytes == 0 and len(early) == 0


def test_a_dropped_message_is_never_decoded():
    """max_messages_per_s 10 (a burst of 20): of 60 messages at once, only what the bucket lets through is decoded;
    before the rate came first, every one was (60 + the start)."""
    settings = dataclasses.replace(SETTINGS, max_messages_per_s=10.0)
    wire = Wire([{"type": "start", "chunks": 1}, *[{"type": "ping"}] * 60])
    groups = Groups(Lease([admitted("g1"), 0.8, chunk(0), SessionDone(1)]))
    life, _, _ = live(wire, groups, settings)
    assert len(wire.decodes) == 61 - life.reader.rate.dropped and 40 <= life.reader.rate.dropped <= 41
    assert wire.decodes[0] is True and not any(wire.decodes[1:])         # the start's bounds, then a control's


def test_a_waiting_session_keeps_only_its_interactions_bounded_and_refuses_the_rest_at_once():
    """Every group full for a while: the client floods its waiting session with 100 interactions and 20 bad
    messages. The bad ones are refused at once with their code (not kept for later), the interactions past
    max_queued_controls (64) with too_many_controls; what is kept is parsed, in order, and reaches the group
    once the session is admitted; the session plays on."""
    flood = []
    for i in range(100):
        flood.append({"type": "interaction", "id": f"e{i}"})
        if i % 5 == 0:
            flood.append({"type": "bad", "junk": [[]] * 1000})
    wire = Wire([{"type": "start", "chunks": 1}, *flood])
    full = Lease([SessionFailed(ErrorCode.CAPACITY_EXHAUSTED, "full")])
    starting = Growth(running=1, starting=1, max_groups=2)          # a group is starting: the session waits for it
    groups = Groups(full, Lease([admitted("g1"), 0.3, chunk(0), SessionDone(1)]), growth=starting)
    settings = dataclasses.replace(SETTINGS, max_messages_per_s=1000.0)
    life, _, _ = live(wire, groups, settings)
    refused = [e for e in wire.log if e[0] == "error"]
    admitted_at = wire.log.index(("admitted", "g1"))
    assert refused.count(("error", ErrorCode.UNKNOWN_TYPE)) == 20
    assert refused.count(("error", ErrorCode.TOO_MANY_CONTROLS)) == 36
    assert all(wire.log.index(e) < admitted_at for e in refused)          # answered while it waited
    assert [eid for _, _, eid in groups.posted] == [f"e{i}" for i in range(64)]
    assert wire.log[-1] == ("done", False, 1) and len(life.early) == 0


def test_what_a_waiting_session_keeps_is_small_whatever_the_client_sends():
    """The kept interactions are parsed objects: 64 of them weigh a few KiB, where the 64 messages they came in
    could each have been 128 KiB of containers."""
    early = EarlyControls(SETTINGS.max_queued_controls, SETTINGS.max_control_bytes)
    for i in range(100):
        early.keep(Interaction(f"e{i}", keys=["w", "a", "d"]))
    assert len(early) == 64 and early.bytes < 8 * 2 ** 10
    assert sum(sys.getsizeof(i) for i in early.kept) < 64 * 2 ** 10


def test_an_ended_session_is_freed_without_the_cyclic_collector():
    """Nothing a session's life builds points back at it (its reader holds no bound method of it): once it ended,
    reference counting frees it, and with it the references its lease held, without waiting for the cyclic
    garbage collector (a served test saw the ingress hold 8 object references more for 20 s and more)."""
    import asyncio
    import gc
    import weakref

    from deployments.session.life import SessionLife
    from tests.deployments.session.standins import Limits, Metrics

    async def scenario():
        life = SessionLife(Wire([{"type": "start", "chunks": 1}, {"type": "ping"}]),
                           Groups(Lease([admitted("g1"), chunk(0), SessionDone(1)])), SETTINGS, Metrics())
        await asyncio.wait_for(life.run("t", Limits()), 30)
        return weakref.ref(life)

    gc.collect()
    gc.disable()
    try:
        ended = asyncio.run(scenario())
        assert ended() is None
    finally:
        gc.enable()
