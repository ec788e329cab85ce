"""The group's calls to its ranks (deployments/group/executor.py): typed messages, each call's own time limit, one
failure path; and no other module of the serving layer names a rank method (the sources are read)."""
import ast
import asyncio
import inspect
import pathlib

import pytest

from deployments.group.executor import GroupFailure, RankExecutor
from deployments.group.messages import OpenSession, RunChunk, SnapshotSchedule
from deployments.group.rank import RankWorker
from deployments.session.events import ChunkControls, RankRestore, SnapshotOwner
from tests.deployments.group.rank_calls import opening
from tests.deployments.group.standins import Remote
from tests.waits import async_wait_until

ROOT = pathlib.Path(__file__).resolve().parents[3]
RANK_METHODS = {name for name, _ in inspect.getmembers(RankWorker, inspect.isfunction) if not name.startswith("_")}


def test_only_the_executor_names_a_rank_method():
    """`<handle>.<rank method>.remote(...)` or getattr(handle, "<rank method>") anywhere in deployments/ but the
    executor (and the rank itself) is a call that bypasses the executor's typed methods and failure path."""
    assert {"join", "open_session", "run_chunk", "flush_snapshots", "close_session"} <= RANK_METHODS
    found = []
    for path in (ROOT / "deployments").rglob("*.py"):
        if path.relative_to(ROOT).as_posix() in ("deployments/group/executor.py", "deployments/group/rank.py"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in ("remote", "options") \
                    and isinstance(node.value, ast.Attribute) and node.value.attr in RANK_METHODS:
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} .{node.value.attr}.{node.attr}")
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "getattr" and len(node.args) > 1 \
                    and isinstance(node.args[1], ast.Constant) and node.args[1].value in RANK_METHODS:
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} getattr(..., {node.args[1].value!r})")
    assert found == []


class Rank:
    """A rank actor whose methods record their argument and answer at once, or never (`hang`)."""

    def __init__(self, rank: int, seen: list, hang: bool = False):
        async def answer(*args):
            seen.append((rank, args))
            if hang:
                await asyncio.sleep(3600)
            return rank
        for name in RANK_METHODS:
            setattr(self, name, Remote(answer))


def _run(coro):
    return asyncio.run(coro)


def test_each_call_is_one_typed_message_per_rank():
    seen = []
    ranks = RankExecutor([Rank(0, seen), Rank(1, seen)], timeout_s=5.0)
    muxer, controls = object(), ChunkControls(keys=("w", "", "l"))
    assert _run(ranks.run_chunk("s", 4, controls, muxer)) == [0, 1]
    assert seen == [(0, (RunChunk("s", 4, controls, muxer),)), (1, (RunChunk("s", 4, controls, None),))]
    seen.clear()
    call = opening("s", None, "a harbour", 1)
    restore = [RankRestore(("slot0",), "state0"), RankRestore(("slot1",), "state1")]
    plan = SnapshotSchedule(SnapshotOwner("keeper", "s"), 3)
    _run(ranks.open("s", call.start, plan, restore))
    assert seen == [(r, (OpenSession("s", call.start, plan, restore[r]),)) for r in (0, 1)]


def test_a_chunk_a_flush_and_device_stats_have_their_own_limits_and_opening_has_none():
    async def scenario():
        ranks = RankExecutor([Rank(0, []), Rank(1, [], hang=True)], timeout_s=0.05)
        with pytest.raises(GroupFailure, match=r"^chunk 2 of session s did not come back from every rank within "
                                               r"0.05 s$"):
            await ranks.run_chunk("s", 2, ChunkControls())
        with pytest.raises(GroupFailure, match=r"^replay of chunk 2 of session s did not"):
            await ranks.run_chunk("s", 2, ChunkControls(), replay=True)
        with pytest.raises(GroupFailure, match=r"^the last snapshots of session s did not .* within 0.1 s$"):
            await ranks.flush_snapshots("s", 0.1)
        with pytest.raises(GroupFailure, match=r"^device stats did not come back from every rank within 0.1 s$"):
            await ranks.device_stats(0.1)
        opening_call = asyncio.ensure_future(ranks.open("s", opening("s", None, "p", 1).start, None, [None, None]))
        resetting = asyncio.ensure_future(ranks.reset("s"))
        await asyncio.sleep(0.3)                     # far past the chunk's limit: still waiting (unbounded)
        assert not opening_call.done() and not resetting.done()
        opening_call.cancel()
        resetting.cancel()
    _run(scenario())


def test_a_rank_that_raises_fails_the_call_with_its_error():
    class Broken(Rank):
        def __init__(self):
            super().__init__(0, [])

            async def fail(*args):
                raise RuntimeError("rank 0 lost its device")
            self.run_chunk = Remote(fail)

    with pytest.raises(RuntimeError, match="rank 0 lost its device"):
        _run(RankExecutor([Broken()], 5.0).run_chunk("s", 0, ChunkControls()))


def test_stop_close_and_abort_are_told_to_every_rank():
    async def scenario():
        seen = []
        ranks = RankExecutor([Rank(0, seen), Rank(1, seen)], 5.0)
        ranks.stop("s")
        ranks.abort("s", 3)
        ranks.close("s")
        await async_wait_until(lambda: len(seen) >= 6, 10, "the three calls to reach both ranks")
        return sorted(seen)
    assert _run(scenario()) == [(0, ("s",)), (0, ("s",)), (0, ("s", 3)), (1, ("s",)), (1, ("s",)), (1, ("s", 3))]
