"""WorldGroup: one Serve replica = one sequence-parallel group (shared/DESIGN.md §1, §3).

The replica owns a placement group [replica] + one bundle per rank + [muxer] (STRICT_PACK, bundles from
ServeSettings.placement_bundles), starts the rank actors pinned to their bundles, joins them in one
process group, and starts the muxer. Each session is one long-lived streaming call (`session`): the
lease that Serve counts for routing and autoscaling. A background loop runs the sessions' chunks one
at a time, earliest playback deadline first, within the pacing lead; every chunk is one call to every
rank. Controls arrive through the muxer's mailbox, not through Serve's routing.
"""
from __future__ import annotations

import asyncio
import contextvars
import logging
import math
import time
import uuid
from typing import Optional

import ray
from ray.util.placement_group import get_current_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from .metrics import Metrics, gpu_stats
from .muxer import Muxer
from .protocol import Interaction, StartRequest
from .rank import RankWorker
from .sessions import Scheduler, SessionState
from .settings import ServeSettings

log = logging.getLogger("ray.serve")

IDLE_POLL_S = 0.05


class SessionFailure(Exception):
    """A failure that concerns one session only (the group and its other sessions carry on)."""

    def __init__(self, session_id: str, message: str):
        super().__init__(message)
        self.session_id = session_id


class WorldGroup:
    def __init__(self, settings: dict):
        s = self.settings = ServeSettings(**settings)
        self.id = uuid.uuid4().hex[:8]
        pg = get_current_placement_group()

        def pinned(bundle: int):
            if pg is None:
                return None
            return PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=bundle)

        t0 = time.monotonic()
        rank_actor = ray.remote(RankWorker)
        self.ranks = [rank_actor.options(num_cpus=s.rank_cpus, num_gpus=s.rank_gpus, max_concurrency=4,
                                         scheduling_strategy=pinned(s.rank_bundle(r))).remote(settings, r, s.sp)
                      for r in range(s.sp)]
        init_method = ray.get(self.ranks[0].address.remote(), timeout=s.group_start_timeout_s)
        joins = [r.join.remote(init_method) for r in self.ranks]       # all first, then wait: they rendezvous
        infos = ray.get(joins, timeout=s.group_start_timeout_s)
        self.capacity = min(i["capacity"] for i in infos)
        if self.capacity < 1:
            raise RuntimeError(f"no session fits: one needs {infos[0]['session_bytes'] / 2 ** 30:.2f} GiB per rank, "
                               f"memory_budget_gib is {s.memory_budget_gib}")
        self.size = (infos[0]["width"], infos[0]["height"])
        self.frames_per_chunk = infos[0]["frames_per_chunk"]
        self.muxer = ray.remote(Muxer).options(num_cpus=s.muxer_cpus, max_concurrency=8,
                                               scheduling_strategy=pinned(s.muxer_bundle)).remote(*self.size)
        ray.get(self.muxer.drain.remote())
        self.scheduler = Scheduler(s.pacing_lead_s)
        self.reserved = 0                              # admitted or being admitted
        self.outboxes: dict[str, asyncio.Queue] = {}
        self.loop_task: Optional[asyncio.Task] = None
        self.wake: Optional[asyncio.Event] = None
        self.broken: Optional[str] = None
        self.metrics = Metrics("group")
        self.last_metrics = 0.0
        log.info("group %s: %d ranks on %s ready in %.1f s, capacity %d sessions", self.id, s.sp, infos[0]["device"],
                 time.monotonic() - t0, self.capacity)

    # ---- Serve hooks ----------------------------------------------------------------------------
    def check_health(self) -> None:
        if self.broken:
            raise RuntimeError(f"group {self.id} is broken: {self.broken}")

    # ---- the session lease --------------------------------------------------------------------
    async def session(self, request: dict):
        """Streaming call held for the whole session: yields 'admitted', then one item per chunk, then
        'done' (or 'error'). Cancelling it (client gone, stop) frees the session within one step."""
        if self.broken:
            yield {"type": "error", "code": "internal_error", "message": "the group is restarting; retry"}
            return
        if self.reserved >= self.capacity:             # checked and taken before any await: no over-admission
            yield {"type": "error", "code": "capacity_exhausted", "message": "group is full"}
            return
        self.reserved += 1
        sid = request["session_id"]
        start: StartRequest = request["start"]
        state = SessionState(sid, start, self.frames_per_chunk, self.settings.max_queued_controls)
        try:
            mime = await self.muxer.open.remote(sid, start.fps)
            opened = await asyncio.gather(*[r.open_session.remote(sid, start.image, start.prompt, start.seed,
                                                                  start.flow_shift) for r in self.ranks])
            if not all(opened):
                return                                 # cancelled while opening: the finally cleans up
            outbox: asyncio.Queue = asyncio.Queue()
            self.outboxes[sid] = outbox
            self.scheduler.add(state)
            self._ensure_loop()
            self.metrics.active_sessions.set(len(self.scheduler.sessions), tags={"group": self.id})
            yield {"type": "admitted", "group": self.id, "mailbox": self.muxer, "mime": mime,
                   "capacity": self.capacity}
            while True:
                item = await outbox.get()
                yield item
                if item["type"] in ("done", "error"):
                    break
        finally:
            self.reserved -= 1
            state.stopped = True
            for r in self.ranks:
                r.stop.remote(sid)                   # a running chunk ends at its next step, on every rank
            self.scheduler.remove(sid)
            self.outboxes.pop(sid, None)
            for r in self.ranks:
                r.close_session.remote(sid)
            self.muxer.close.remote(sid)
            self.metrics.active_sessions.set(len(self.scheduler.sessions), tags={"group": self.id})

    # ---- the chunk loop -----------------------------------------------------------------------
    def _ensure_loop(self) -> None:
        if self.loop_task is None or self.loop_task.done():
            self.wake = asyncio.Event()
            # A fresh context: the loop's rank calls must not count as children of the session request that
            # happened to start it, or cancelling that request (client gone) would cancel every session's chunk.
            self.loop_task = asyncio.get_running_loop().create_task(self._loop(), context=contextvars.Context())
        self.wake.set()

    async def _drain_controls(self) -> None:
        for sid, items in (await self.muxer.drain.remote()).items():
            state = self.scheduler.sessions.get(sid)
            for item in items:
                if state is None:
                    break
                if isinstance(item, Interaction) and not state.queue(item):
                    self._post(sid, {"type": "error", "code": "too_many_controls", "event_id": item.event_id,
                                     "message": f"more than {state.max_queued} interactions queued; slow down"})

    def _post(self, sid: str, item: dict) -> None:
        box = self.outboxes.get(sid)
        if box is not None:
            box.put_nowait(item)

    async def _loop(self) -> None:
        while self.scheduler.sessions:
            try:
                await self._drain_controls()
                state, wait = self.scheduler.pick()
                if state is None:
                    self.wake.clear()
                    try:
                        await asyncio.wait_for(self.wake.wait(), timeout=min(wait, IDLE_POLL_S))
                    except asyncio.TimeoutError:
                        pass
                    continue
                await self._run_chunk(state)
                self._report_gpu()
            except SessionFailure as e:               # one session's chunk could not be delivered
                log.warning("group %s: session %s failed: %s", self.id, e.session_id, e)
                self._post(e.session_id, {"type": "error", "code": "internal_error",
                                          "message": "this session failed; please start a new one"})
                self.scheduler.remove(e.session_id)
            except Exception as e:                    # a rank or the muxer failed: the group is gone with it
                self.broken = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
                log.error("group %s: failing its sessions: %s", self.id, self.broken)
                for sid in list(self.outboxes):
                    self._post(sid, {"type": "error", "code": "internal_error",
                                     "message": "the model group failed while generating; please retry"})
                return

    async def _run_chunk(self, state: SessionState) -> None:
        plan = state.plan_next_chunk()
        t0 = time.monotonic()
        calls = [r.run_chunk.remote(state.id, plan.index, plan.controls, self.muxer if i == 0 else None)
                 for i, r in enumerate(self.ranks)]
        results = await asyncio.gather(*calls)       # a failure here is a rank's: the group breaks
        root = results[0]
        if root["stopped"] or state.stopped:
            return
        try:
            fragment = await root["fragment"]
        except Exception as e:
            raise SessionFailure(state.id, f"encoding failed: {type(e).__name__}") from e
        if fragment is None or state.stopped:        # the session ended while its chunk was being encoded
            return
        done_at = time.monotonic()
        state.commit_plan(plan)
        stalls_before = state.stalls
        state.delivered(fragment["frames"], done_at)
        engine_s = root["engine_s"]
        timings = dict(root["timings"])
        timings.update(encode=fragment["encode_s"], root_to_muxer=fragment["transfer_s"],
                       outside_engine=(done_at - t0) - engine_s)
        for stage, seconds in timings.items():
            self.metrics.stage.observe(seconds, tags={"stage": stage})
        video_s = fragment["frames"] / state.start.fps
        self.metrics.rtf.set((done_at - t0) / video_s, tags={"group": self.id})
        if state.stalls > stalls_before:
            self.metrics.stalls.inc(tags={"group": self.id})
        self._post(state.id, {"type": "chunk", "index": plan.index, "data": fragment["data"],
                              "num_frames": fragment["frames"], "started": plan.started, "active": plan.active,
                              "completed": plan.completed, "timings": timings, "wall_s": done_at - t0})
        if state.finished:
            self._post(state.id, {"type": "done", "chunks": state.next_chunk})

    def _report_gpu(self) -> None:
        now = time.monotonic()
        if now - self.last_metrics < self.settings.metrics_interval_s or self.settings.device != "cuda":
            return
        self.last_metrics = now
        for stat in gpu_stats():
            tags = {"group": self.id, "rank": str(stat["index"])}
            self.metrics.gpu_util.set(stat["utilization"], tags=tags)
            self.metrics.gpu_memory.set(stat["memory_used"], tags=tags)
