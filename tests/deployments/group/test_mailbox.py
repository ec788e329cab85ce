"""The control mailbox without Ray: order, wake-up on arrival, closed sessions."""
import asyncio

from deployments.group.mailbox import ControlMailbox
from deployments.session.requests import Interaction


def _interaction(event_id: str, seq: int) -> Interaction:
    return Interaction(event_id, keys=["w"], seq=seq)


def test_take_returns_every_session_in_client_order():
    async def scenario():
        box = ControlMailbox()
        await box.post("a", _interaction("a2", 2))             # posts may land out of order
        await box.post("a", _interaction("a1", 1))
        await box.post("b", _interaction("b1", 3))
        first = await box.take(timeout_s=5)
        second = await box.take(timeout_s=0.05)                 # nothing left: answers after the timeout
        return first, second

    first, second = asyncio.run(scenario())
    assert {sid: [i.event_id for i in items] for sid, items in first.items()} == {"a": ["a1", "a2"], "b": ["b1"]}
    assert second == {}


def test_a_waiting_take_wakes_when_a_control_arrives():
    async def scenario():
        box = ControlMailbox()
        waiter = asyncio.create_task(box.take(timeout_s=3600))  # its own timeout would answer in an hour
        await asyncio.sleep(0.1)
        assert not waiter.done()
        await box.post("a", _interaction("e", 1))
        return await asyncio.wait_for(waiter, 60)               # woken by the post (else TimeoutError)

    got = asyncio.run(scenario())
    assert [i.event_id for i in got["a"]] == ["e"]


def test_posts_after_close_are_dropped():
    async def scenario():
        box = ControlMailbox()
        await box.post("a", _interaction("before", 1))
        await box.close("a")                                     # drops what is pending
        await box.post("a", _interaction("after", 2))            # a post that was in flight when it closed
        await box.post("b", _interaction("other", 1))
        return await box.take(timeout_s=0.05)

    got = asyncio.run(scenario())
    assert list(got) == ["b"]
