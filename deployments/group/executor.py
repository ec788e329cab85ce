"""The group's one way to talk to its ranks: run a method on every rank, with a timeout, failing the group the
same way whatever the method (vLLM's collective_rpc, for Ray actors). Chunks, replays, restores, snapshot
flushes, aborts and device metrics all go through it."""
from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any, Optional


class GroupFailure(RuntimeError):
    """A rank did not answer in time, or failed: the group is gone with it (its sessions resume elsewhere)."""


class RankExecutor:
    def __init__(self, ranks: list, timeout_s: float):
        self.ranks = ranks                       # Ray actor handles of RankWorker, in rank order
        self.timeout_s = timeout_s               # the default: a chunk's (chunk_timeout_s)

    def __len__(self) -> int:
        return len(self.ranks)

    def _calls(self, method: str, args: tuple, per_rank: Optional[Sequence[tuple]]) -> list:
        return [getattr(rank, method).remote(*(per_rank[i] if per_rank is not None else args))
                for i, rank in enumerate(self.ranks)]

    async def call(self, method: str, *args, per_rank: Optional[Sequence[tuple]] = None,
                   timeout_s: Optional[float] = None, what: Optional[str] = None) -> list[Any]:
        """Every rank's answer to `method(*args)` (or `method(*per_rank[i])` on rank i), in rank order. A rank
        that raises fails the call with its error; one that does not answer within the timeout (None: no
        limit) with GroupFailure naming `what`."""
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        gathered = asyncio.gather(*self._calls(method, args, per_rank))
        if timeout_s is None or timeout_s <= 0:
            return await gathered
        try:
            return await asyncio.wait_for(gathered, timeout_s)
        except asyncio.TimeoutError:
            raise GroupFailure(f"{what or method} did not come back from every rank within {timeout_s:g} s") from None

    def call_blocking(self, method: str, *args, timeout_s: float) -> list[Any]:
        """`call` for the replica's start-up, before it serves (every call first, then wait: ranks that
        rendezvous need all of theirs in flight)."""
        import ray
        return ray.get(self._calls(method, args, None), timeout=timeout_s)

    def tell(self, method: str, *args) -> None:
        """`method(*args)` on every rank, answer unawaited (stop, abort, close: each rank acts on its own)."""
        self._calls(method, args, None)
