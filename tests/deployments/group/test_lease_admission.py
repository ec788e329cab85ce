"""A group's admission with the quality ladder on, without Ray (the chunk loop's stand-in ranks, muxer and
mailbox): below its cap, a group takes a session only while the floor rung holds for every session, and its
census reports the configured, top-rung and floor capacities."""
import asyncio
import dataclasses

from deployments.group.chunk_loop import ChunkLoop
from deployments.group.executor import RankExecutor
from deployments.group.lease import Leases
from deployments.group.state import GroupState
from deployments.session.codes import ErrorCode
from deployments.session.events import ModelFacts
from lingbot.config import get_preset
from tests.deployments.group.standins import SETTINGS, Mailbox, Metrics, Muxer, Rank, Remote, session, start

FACTS = ModelFacts.of(get_preset("tiny"))


def leases(settings, capacity=6) -> Leases:
    ranks = RankExecutor([Rank(0, [], engine_s=0.3)], settings.chunk_timeout_s)
    loop = ChunkLoop("g", settings, GroupState(), ranks, Muxer(), Mailbox(), Metrics(), lambda e: None, model=FACTS)
    return Leases("g", settings, loop.state, capacity, FACTS, ranks, Muxer(), Mailbox(), loop, Metrics())


def test_with_the_ladder_a_group_below_its_cap_admits_while_the_floor_holds():
    """Chunks of 0.3 s at full (a 16 fps session: 0.4 of the group at full, 0.24 at the floor): a group of cap 6
    holds 2 at full and 3 at the floor. Three running: a fourth is refused (capacity_exhausted, which the ingress
    retries elsewhere or waits on); a newcomer counts its sink (every step), beside one whose sink runs it is told
    to wait (seat_held); an unpaced one is taken, and so is any one
    while nothing is measured. With the ladder off, the cap alone decides."""
    async def scenario():
        on = leases(dataclasses.replace(SETTINGS, quality_ladder="auto"))
        assert on.capacities() == {"configured": 6, "top": 6, "floor": 6}          # nothing measured yet
        for sid in "abc":
            on.chunks.scheduler.add(session(sid, 50))             # scheduled, the loop not started,
            on.chunks.scheduler.sessions[sid].next_chunk = FACTS.sink_chunks    # past their sinks
        on.reserved = 3
        assert on._refusal(start(10)) is None                                      # not measured: the cap
        on.chunks.ladder.active.ladder.observe(0, 0.3)
        assert on.capacities() == {"configured": 6, "top": 2, "floor": 3}
        refused = on._refusal(start(10))
        assert refused.code == ErrorCode.CAPACITY_EXHAUSTED and "quality floor" in refused.message
        assert on._refusal(start(10, paced=False)) is None                         # no real-time demand
        # a newcomer counts its sink: every step, 0.3 s a chunk (0.4)
        on.chunks.remove("c")
        on.reserved = 2
        assert on._refusal(start(10)) is None                                      # two: 0.49 + 0.4
        on.chunks.remove("b")
        on.reserved = 2                                                            # one running, one opening:
        refused = on._refusal(start(10))                                           # its sink runs: wait
        assert refused.code == ErrorCode.CAPACITY_EXHAUSTED and refused.seat_held and "sink" in refused.message
        off = leases(SETTINGS)
        for sid in "abcde":
            off.chunks.scheduler.add(session(sid, 50))
        off.reserved = 5
        assert off._refusal(start(10)) is None and off.capacities()["floor"] == 6
        off.reserved = 6
        assert off._refusal(start(10)).message == "group is full"

    asyncio.run(scenario())


def test_a_muxer_that_never_opens_the_session_fails_it_within_the_chunk_timeout():
    """Opening a session's encoder takes milliseconds; a muxer that does not answer is a broken group: the lease
    answers group_unavailable within chunk_timeout_s (the ingress tries another group), never waits forever, and
    holds no seat afterwards."""
    from deployments.session.events import SessionFailed, SessionRequest

    async def hang(*args):
        await asyncio.sleep(3600)

    async def noop(*args):
        pass

    settings = dataclasses.replace(SETTINGS, chunk_timeout_s=0.2)
    group = leases(settings)
    group.muxer.open, group.muxer.close, group.mailbox.close = Remote(hang), Remote(noop), Remote(noop)
    for rank in group.ranks.ranks:                       # told to forget the session when the lease ends
        rank.stop = rank.close_session = Remote(noop)

    async def scenario():
        events = [e async for e in group.run(SessionRequest("s", start(3)))]
        return events, group.reserved

    events, reserved = asyncio.run(asyncio.wait_for(scenario(), 10))
    assert events == [SessionFailed(ErrorCode.GROUP_UNAVAILABLE,
                                    "the group's muxer did not open the session within 0.2 s")] and reserved == 0
