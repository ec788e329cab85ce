"""WorldGroup: one Serve replica = one sequence-parallel group (docs/architecture.md, "The layers").

The replica owns a placement group [replica] + one bundle per rank + [muxer] (STRICT_PACK, bundles from
ServeSettings.placement_bundles), starts the rank actors pinned to their bundles, joins them in one
process group (their join replies say what they run: ModelFacts), and starts the muxer (H.264) and the
control mailbox (client controls). Each session is one long-lived streaming call (`session`): the lease
that Serve counts for routing and autoscaling (lease.py). What runs the sessions is the chunk loop (chunk_loop.py); the
group's own life (serving, stopping, draining, failed) is its GroupState (state.py), moved by the liveness
watcher here and the stop watcher in drain.py.
"""
from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
import uuid
from typing import Optional

import ray
from ray.util.placement_group import get_current_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from ..detach import fresh_task
from ..memory import held_refs
from ..metrics import Metrics
from ..session.codes import ErrorCode
from ..session.events import (
    ModelFacts,
    SessionFailed,
    SessionRequest,
)
from ..settings import ServeSettings, live_settings
from .chunk_loop import ChunkLoop
from .drain import DrainTimes, StopWatcher, drain
from .executor import RankExecutor
from .lease import Leases
from .mailbox import ControlMailbox
from .messages import DeviceStats, RankInfo
from .muxer import Muxer
from .rank import RankWorker
from .scaling import TOP_CAPACITY
from .snapshots import SnapshotSeats
from .state import GroupPhase, GroupState

log = logging.getLogger("ray.serve")

WATCH_S = 1.0              # how often the group checks that its ranks, muxer and mailbox are alive
EXIT_DELAY_S = 1.0         # a failed group exits this soon after telling its sessions (Serve replaces it)
DEVICE_STATS_TIMEOUT_S = 5.0
CENSUS_TIMEOUT_S = 30.0


def device_metric_tags(group: str, stats: list[Optional[DeviceStats]]) -> list[tuple[DeviceStats, dict]]:
    """(stats, tags) of every rank that reported its device, tagged with the rank that measured it."""
    return [(st, {"group": group, "rank": str(rank)}) for rank, st in enumerate(stats) if st is not None]


def replica_unique_id() -> str:
    """The Serve replica's id (as the dashboard and the replica's actor name show it), or a fresh one when
    the group runs outside Serve. Sessions, metrics and logs name the group by it."""
    try:
        from ray import serve
        return serve.get_replica_context().replica_id.unique_id
    except Exception:
        return uuid.uuid4().hex[:8]


def agreed_facts(infos: list[RankInfo]) -> ModelFacts:
    """The model every rank runs (they load the same settings: a rank that disagrees is a broken deployment)."""
    facts = infos[0].facts
    others = [i for i, info in enumerate(infos) if info.facts != facts]
    if others:
        raise RuntimeError(f"ranks {others} run another model than rank 0 ({facts})")
    return facts


class WorldGroup:
    def __init__(self, settings: dict, pinned: Optional[dict] = None):
        """`settings`: every setting but the live ones (user_config, reconfigure); `pinned`: the live settings the
        environment set where the app was built, which win over any user_config (app.live_settings)."""
        s = self.settings = ServeSettings(**settings)
        self.pinned = dict(pinned or {})
        self.id = replica_unique_id()
        pg = get_current_placement_group()

        def pinned(bundle: int):
            if pg is None:
                return None
            return PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=bundle)

        t0 = time.monotonic()
        rank_actor = ray.remote(RankWorker)
        self.ranks = RankExecutor([rank_actor.options(**s.rank_actor_options(), max_concurrency=4,
                                                      scheduling_strategy=pinned(s.rank_bundle(r))
                                                      ).remote(settings, r, s.sp) for r in range(s.sp)],
                                  s.chunk_timeout_s)
        infos: list[RankInfo] = self.ranks.join(self.ranks.address(s.group_start_timeout_s), s.group_start_timeout_s)
        self.capacity = min(i.capacity for i in infos)
        if self.capacity < 1:
            raise RuntimeError(f"no session fits: one needs {infos[0].session_bytes / 2 ** 30:.2f} GiB per rank, "
                               f"more than is left after the weights and warm-up (memory_budget_gib: "
                               f"{s.memory_budget_gib})")
        self.model = agreed_facts(infos)
        self.muxer = ray.remote(Muxer).options(num_cpus=s.muxer_cpus, num_gpus=s.muxer_gpus, max_concurrency=8,
                                               scheduling_strategy=pinned(s.muxer_bundle)
                                               ).remote(*self.model.size, s.h264_settings)
        # the mailbox only relays small messages: it takes no CPU of its own and lives in the replica's bundle
        self.mailbox = ray.remote(ControlMailbox).options(num_cpus=0,
                                                          scheduling_strategy=pinned(s.replica_bundle)).remote()
        ray.get([self.muxer.ready.remote(), self.mailbox.ready.remote()], timeout=s.group_start_timeout_s)
        self.state = GroupState()
        self.metrics = Metrics()
        self.chunks = ChunkLoop(self.id, s, self.state, self.ranks, self.muxer, self.mailbox, self.metrics,
                                self._fail_group, self._maybe_report_devices, self.model)
        measured = [i.rung_s for i in infos if i.rung_s]      # the slowest rank's time of each (they run together)
        if measured:
            costs = {k: max(m[k] for m in measured) for k in measured[0]}
            log.info("group %s: a chunk at the start took %s", self.id, ", ".join(f"{k} {v:.3f} s" for k, v in
                                                                             costs.items()))
            self.chunks.ladder.measured_at_start(costs)
        self.leases = Leases(self.id, s, self.state, self.capacity, self.model, self.ranks, self.muxer, self.mailbox,
                             self.chunks, self.metrics, SnapshotSeats.of(self.id, s, infos[0].snapshot_host))
        self.last_metrics = 0.0
        try:                                   # (Serve builds a replica on its loop; a test may not)
            self.event_loop: Optional[asyncio.AbstractEventLoop] = asyncio.get_running_loop()
        except RuntimeError:
            self.event_loop = None
        self.drain_task: Optional[asyncio.Task] = None
        threading.Thread(target=self._watch, name=f"group-{self.id}-watch", daemon=True).start()
        if s.drain_poll_s > 0 and s.resume_sessions:
            StopWatcher(self.id, self.state, s.drain_poll_s, DrainTimes.of(s), lambda: self.event_loop,
                        self._start_drain).start()
        log.info("group %s: %d ranks on %s ready in %.1f s, capacity %d sessions (%s, %dx%d, %s)", self.id, s.sp,
                 infos[0].device, time.monotonic() - t0, self.capacity, self.model.preset, self.model.width,
                 self.model.height, self.model.dtype)

    # ---- Serve hooks and queries --------------------------------------------------------------
    def check_health(self) -> None:
        if self.state.failed:
            raise RuntimeError(f"group {self.id} is broken: {self.state.failure}")

    def reconfigure(self, config: dict) -> None:
        """Serve's user_config of the WorldGroup deployment, applied in place to every running group (Serve calls
        it on a config change that touches only user_config, and on every new replica): `quality_ladder` off or
        auto, from each session's next chunk (docs/architecture.md, "Rungs")."""
        live, overridden = live_settings(config, self.pinned)
        for line in overridden:
            log.warning("group %s: %s", self.id, line)
        mode = live.get("quality_ladder", self.settings.quality_ladder)
        self.chunks.ladder.set_mode(mode)             # checked as the setting is (ConfigError)
        log.info("group %s: quality_ladder %s", self.id, mode)

    def record_autoscaling_stats(self) -> dict:
        """Serve's custom autoscaling metrics of this group (scaling.py): what it holds at the top rung."""
        return {TOP_CAPACITY: float(self.leases.capacities()["top"])}

    def facts(self) -> ModelFacts:
        """What this group's ranks run (the ingress checks starts against it)."""
        return self.model

    async def census(self) -> dict:
        """What the group, its ranks, muxer and mailbox hold for their sessions (every per-session count is 0
        once none is open) and the object references each process holds: what a finished session must not
        leave behind (the tests; `python -m perf.soak` prints it after its run)."""
        ranks = await self.ranks.census(CENSUS_TIMEOUT_S)
        muxer, mailbox = await asyncio.gather(self.muxer.census.remote(), self.mailbox.census.remote())
        own = {"sessions": len(self.chunks.sessions), "outboxes": len(self.chunks.outboxes),
               "deliveries": len(self.chunks.deliveries), "object_refs": held_refs()}
        settings = {"quality_ladder": self.chunks.ladder.mode}
        if self.leases.snapshot_seats is not None:
            own["snapshot_seats_held"] = len(self.leases.snapshot_seats.holders)
        return {"group": own, "ranks": ranks, "muxer": muxer, "mailbox": mailbox, "settings": settings,
                "capacity": self.leases.capacities()}

    # ---- healing ------------------------------------------------------------------------------
    def _watch(self) -> None:
        """A thread: every WATCH_S, is every rank, the muxer and the mailbox still there? A dead one fails the
        group at once, with or without sessions (a busy actor is not a dead one). It also has the devices reported
        while the group is idle (every metrics_interval_s, as after chunks): Ray drops a process's series after
        two minutes without a report, and an idle group's devices belong on the dashboard too."""
        while not self.state.failed:
            time.sleep(WATCH_S)
            if self.event_loop is not None and not self.event_loop.is_closed():
                self.event_loop.call_soon_threadsafe(self._maybe_report_devices)
            calls = self.ranks.alive() + [self.muxer.ready.remote(), self.mailbox.ready.remote()]
            done, _ = ray.wait(calls, num_returns=len(calls), timeout=WATCH_S * 5)
            for ref in done:
                try:
                    ray.get(ref)
                except Exception as e:
                    if self.event_loop is not None and not self.event_loop.is_closed():
                        self.event_loop.call_soon_threadsafe(self._fail_group, e)
                        time.sleep(EXIT_DELAY_S * 2)       # _fail_group exits after telling the sessions
                    self._exit(f"{type(e).__name__}: {str(e).splitlines()[0][:200]}")

    def _fail_group(self, error: Exception) -> None:
        """A rank, the muxer or the mailbox failed: tell every session (their ingresses resume them elsewhere),
        then exit so that Serve replaces the group at once."""
        why = f"{type(error).__name__}: {str(error).splitlines()[0][:300]}"
        if not self.state.move(GroupPhase.FAILED, why):
            return
        log.error("group %s: failing its sessions: %s", self.id, why)
        for sid in list(self.chunks.outboxes):
            self.chunks.post(sid, SessionFailed(ErrorCode.INTERNAL_ERROR, "the model group failed while generating"))
        self.chunks.poke()
        asyncio.get_running_loop().call_later(EXIT_DELAY_S, self._exit, why)

    def _exit(self, why: str) -> None:
        """Leave at once so that Serve replaces this replica now, not at its next health check (the ranks,
        muxer and mailbox go with it: this process owns them)."""
        log.error("group %s exits (%s); Serve starts a new one", self.id, why)
        logging.shutdown()
        os._exit(1)

    def _start_drain(self, why: str) -> None:
        self.drain_task = fresh_task(drain(self.id, why, self.state, self.chunks, self.ranks,
                                           self.settings.drain_lead_s, DrainTimes.of(self.settings)))

    # ---- the session lease --------------------------------------------------------------------
    async def session(self, request: SessionRequest):
        """Streaming call held for the whole session (the lease, lease.py): Admitted, then the session's events.
        Cancelling it (client gone, stop) frees the session within one step."""
        self.event_loop = asyncio.get_running_loop()
        events = self.leases.run(request)
        try:
            async for event in events:
                yield event
        finally:
            await events.aclose()                      # the lease's own clean-up runs now, not when collected

    # ---- device metrics -----------------------------------------------------------------------
    def _maybe_report_devices(self) -> None:
        """Every metrics_interval_s, a task of its own (never in the way of the next chunk's dispatch)."""
        now = time.monotonic()
        if now - self.last_metrics < self.settings.metrics_interval_s:
            return
        self.last_metrics = now
        fresh_task(self._report_devices())

    async def _report_devices(self) -> None:
        """Each rank's own device utilisation and memory, tagged by rank."""
        try:                                          # metrics never stall or fail the chunk loop
            stats = await self.ranks.device_stats(DEVICE_STATS_TIMEOUT_S)
        except Exception as e:
            log.warning("group %s: device stats unavailable: %s", self.id, type(e).__name__)
            return
        for st, tags in device_metric_tags(self.id, stats):
            if st.utilization == st.utilization:          # NaN: no sample yet (or NVML absent)
                self.metrics.device_util.set(st.utilization, tags=tags)
            self.metrics.device_memory.set(st.memory_used, tags=tags)
