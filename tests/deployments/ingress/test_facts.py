"""The ingress asks a group for the model facts once and keeps them; until a group has answered, each caller
waits its own deadline for the one question in flight (a /v1/config call is not held behind a session's longer
wait), and a question that failed is asked again by the next caller."""
import asyncio

import pytest

from deployments.ingress.app import ServeGroups
from deployments.session.codes import ErrorCode, ProtocolError
from deployments.session.events import ModelFacts
from deployments.settings import ServeSettings
from lingbot.config import get_preset

FACTS = ModelFacts.of(get_preset("tiny"))


class Group:
    """A WorldGroup handle's `facts.remote()`: answers when `release` is set (or fails the first `fail` times)."""

    def __init__(self, fail: int = 0):
        self.asked, self.fail, self.release = 0, fail, asyncio.Event()
        self.facts = self

    def remote(self):
        self.asked += 1
        return self._answer(self.asked)

    async def _answer(self, n: int) -> ModelFacts:
        if n <= self.fail:
            raise RuntimeError("no replica yet")
        await self.release.wait()
        return FACTS


def test_a_caller_waits_its_own_deadline_for_the_one_question_and_the_answer_is_kept():
    async def scenario():
        group = Group()
        groups = ServeGroups(group, ServeSettings(snapshots=False))
        session = asyncio.ensure_future(groups.facts())              # a session's first call: max_queue_wait_s
        await asyncio.sleep(0)
        with pytest.raises(ProtocolError) as refused:
            await groups.facts(wait_s=0.05)                          # /v1/config's shorter wait, not held behind it
        assert not group.release.is_set() and not session.done()
        group.release.set()
        assert await session is FACTS and await groups.facts(wait_s=0.0) is FACTS
        return refused.value, group.asked

    refused, asked = asyncio.run(scenario())
    assert refused.code == ErrorCode.GROUP_UNAVAILABLE and "no model group answered within 0.05 s" in refused.message
    assert asked == 1                                                 # one question for both callers, then kept


def test_a_question_that_failed_is_asked_again_by_the_next_caller():
    async def scenario():
        group = Group(fail=1)
        group.release.set()
        groups = ServeGroups(group, ServeSettings(snapshots=False))
        with pytest.raises(ProtocolError):
            await groups.facts(wait_s=1.0)
        return await groups.facts(wait_s=1.0), group.asked

    facts, asked = asyncio.run(scenario())
    assert facts is FACTS and asked == 2
