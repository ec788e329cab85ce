"""The group's one way to talk to its ranks (vLLM's collective_rpc wrapped in typed methods, for Ray actors): each
kind of call is a method here with its own message (messages.py) and time limit, and all of them fan out to
every rank and fail the same way. No other module names a rank method (a test reads the sources to keep it so).

Time limits: a chunk's is `chunk_timeout_s` (the executor's default); opening and resetting a session are
unbounded (a session opens while a compile or a restore may take long; its lease is cancelled if the client
goes); a snapshot flush, device stats and the census take the limit their caller gives; join and the rendezvous address
take the group's start timeout. Stop, close and abort are told, not awaited: each rank acts on its own."""
from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any, Optional

from ..session.events import ChunkControls, RankRestore, SnapshotRef
from ..session.requests import StartRequest
from .messages import ChunkReply, DeviceStats, OpenSession, RankInfo, RunChunk, SnapshotSchedule


class GroupFailure(RuntimeError):
    """A rank did not answer in time, or failed: the group is gone with it (its sessions resume elsewhere)."""


class RankExecutor:
    def __init__(self, ranks: list, timeout_s: float):
        self.ranks = ranks                       # Ray actor handles of RankWorker, in rank order
        self.timeout_s = timeout_s               # a chunk's (chunk_timeout_s)

    def __len__(self) -> int:
        return len(self.ranks)

    # ---- the one fan-out and its one failure path ----------------------------------------------
    def _calls(self, method: str, per_rank: Sequence[tuple]) -> list:
        return [getattr(rank, method).remote(*args) for rank, args in zip(self.ranks, per_rank)]

    def _same(self, *args) -> list[tuple]:
        return [args] * len(self.ranks)

    async def _gather(self, method: str, per_rank: Sequence[tuple], timeout_s: Optional[float], what: str) -> list:
        """Every rank's answer, in rank order. A rank that raises fails the call with its error; one that does not
        answer within `timeout_s` (None or <= 0: no limit) with GroupFailure naming `what`."""
        gathered = asyncio.gather(*self._calls(method, per_rank))
        if timeout_s is None or timeout_s <= 0:
            return await gathered
        try:
            return await asyncio.wait_for(gathered, timeout_s)
        except asyncio.TimeoutError:
            raise GroupFailure(f"{what} did not come back from every rank within {timeout_s:g} s") from None

    def _blocking(self, method: str, per_rank: Sequence[tuple], timeout_s: float) -> list:
        """For the replica's start-up, before it serves: every call first, then wait (ranks that rendezvous need
        all of theirs in flight)."""
        import ray
        return ray.get(self._calls(method, per_rank), timeout=timeout_s)

    def _tell(self, method: str, *args) -> None:
        self._calls(method, self._same(*args))

    # ---- start-up and health ----------------------------------------------------------------------
    def address(self, timeout_s: float) -> str:
        """The rendezvous address rank 0 picks (its node's IP and a free port)."""
        import ray
        return ray.get(self.ranks[0].address.remote(), timeout=timeout_s)

    def join(self, init_method: str, timeout_s: float) -> list[RankInfo]:
        """Every rank connects, loads, warms up and measures (concurrently); what each runs."""
        return self._blocking("join", self._same(init_method), timeout_s)

    def alive(self) -> list:
        """One liveness probe per rank (object references for the group's watcher: a busy rank still answers)."""
        return self._calls("alive", self._same())

    async def device_stats(self, timeout_s: float) -> list[Optional[DeviceStats]]:
        return await self._gather("device_stats", self._same(), timeout_s, "device stats")

    async def census(self, timeout_s: float) -> list[dict[str, int]]:
        """What each rank holds for its sessions, and its object references (RankWorker.holdings)."""
        return await self._gather("holdings", self._same(), timeout_s, "the census")

    # ---- sessions ---------------------------------------------------------------------------------
    async def open(self, session_id: str, start: StartRequest, snapshots: Optional[SnapshotSchedule],
                   restore: Sequence[Optional[RankRestore]]) -> list[Optional[int]]:
        """Build the session on every rank (rank i restores from restore[i]); the chunk each continues from, None
        where it was stopped meanwhile. Unbounded."""
        calls = [(OpenSession(session_id, start, snapshots, share),) for share in restore]
        return await self._gather("open_session", calls, None, f"opening session {session_id}")

    async def reset(self, session_id: str) -> None:
        """Every rank back to before the session's first chunk. Unbounded."""
        await self._gather("reset_session", self._same(session_id), None, f"resetting session {session_id}")

    async def run_chunk(self, session_id: str, index: int, controls: ChunkControls, muxer: Any = None,
                        replay: bool = False) -> list[ChunkReply]:
        """Chunk `index` of the session on every rank; rank 0 hands its frames to `muxer` (None: nothing is
        delivered, as in a replay). Bounded by chunk_timeout_s."""
        calls = [(RunChunk(session_id, index, controls, muxer if rank == 0 else None),) for rank in range(len(self))]
        what = f"{'replay of ' if replay else ''}chunk {index} of session {session_id}"
        return await self._gather("run_chunk", calls, self.timeout_s, what)

    async def flush_snapshots(self, session_id: str, timeout_s: float) -> list[tuple[SnapshotRef, ...]]:
        """Every rank's snapshots of the session not reported yet, once stored."""
        return await self._gather("flush_snapshots", self._same(session_id), timeout_s,
                                  f"the last snapshots of session {session_id}")

    def stop(self, session_id: str) -> None:
        """A running chunk of the session ends at its next step, on every rank."""
        self._tell("stop", session_id)

    def close(self, session_id: str) -> None:
        """Every rank forgets the session (it can never be opened again there)."""
        self._tell("close_session", session_id)

    def abort(self, session_id: str, index: int) -> None:
        """Give up chunk `index` of the session at its next step before the commit (it is run again)."""
        self._tell("abort_chunk", session_id, index)
