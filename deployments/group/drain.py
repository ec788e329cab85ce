"""Draining: a group that Serve stops (scale-down, redeploy) hands its sessions on instead of cutting them
(docs/architecture.md, "Draining: a group that Serve stops").

Serve tells a replica nothing while it waits for the replica's requests (here: the sessions) to end before
stopping it, so a group asks: `StopWatcher` polls the controller's replica states on a thread of its own,
and once this group is STOPPING and `drain_due` says so, the event loop runs `drain`: the sessions run
ahead of their playback, the chunk in flight and the deliveries finish, each session gets Moving with the
snapshots of its last chunk, and its ingress resumes it on another group.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Optional

from ..session.events import Moving
from ..session.waiting import STARTING_STATES
from .chunk_loop import ChunkLoop
from .executor import RankExecutor
from .state import GroupPhase, GroupState

log = logging.getLogger("ray.serve")


@dataclass(frozen=True)
class DrainTimes:
    """The drain's clock, from the settings (ServeSettings' drain group)."""
    grace_s: float             # Serve's graceful_shutdown_timeout_s: then it kills the group
    margin_s: float            # move at the latest this long before the grace ends
    wait_new_s: float          # wait this long for a new group before going to the old ones
    new_group_slack_s: float   # a group started this long before the first stop was seen still counts as new
    fill_max_s: float          # run the sessions ahead for at most this long
    flush_timeout_s: float     # wait this long for the snapshots of a session's last chunk

    @classmethod
    def of(cls, s) -> DrainTimes:
        return cls(s.graceful_shutdown_timeout_s, s.drain_margin_s, s.drain_wait_new_s, s.drain_new_group_slack_s,
                   s.drain_fill_max_s, s.drain_flush_timeout_s)


def serve_replica_states() -> dict[str, tuple[str, float]]:
    """(state: RUNNING, STOPPING, ...; start time, wall clock) of every replica of this replica's deployment
    by replica id, as the Serve controller reports them (the details `serve status` and the dashboard show;
    a private API of Serve's: there is no public one for a replica's own state)."""
    from ray import serve
    from ray.serve.context import _get_global_client
    context = serve.get_replica_context()
    details = _get_global_client().get_serve_details()
    deployment = details["applications"][context.app_name]["deployments"][context.deployment]
    return {r["replica_id"]: (r["state"], r.get("start_time_s") or 0.0) for r in deployment.get("replicas", ())}


def drain_due(me: str, states: dict[str, tuple[str, float]], rollout: float, stopping_since: float, now: float,
              times: DrainTimes) -> Optional[str]:
    """Whether (and why) a group Serve is stopping moves its sessions now; None: not yet, they go on here.
    `states`: serve_replica_states(); `rollout`: when (wall clock) a stopping group of the deployment was
    first seen (this one, or an earlier one of the same redeploy); `stopping_since`, `now`: monotonic.
    - "new group": a group started since the rollout began runs (a redeploy's, or a scale-up's: it has
      room; the old ones still running may be full);
    - "scale-down": other groups run and none is starting (Serve is only removing this one; the load fell);
    - "no new group": other groups run, and the new one has not come up for wait_new_s (most likely it
      waits for the devices this one holds): the old ones take the sessions if they have room (else the
      sessions wait for the new group in resume_wait_s);
    - "deadline": margin_s before Serve's grace runs out, with or without a group to go to (a cluster with
      no room for a new group while this one holds its devices)."""
    running = {rid: start for rid, (state, start) in states.items() if rid != me and state == "RUNNING"}
    if any(start >= rollout - times.new_group_slack_s for start in running.values()):
        return "new group"
    if running and not any(state in STARTING_STATES for state, _ in states.values()):
        return "scale-down"
    if running and now >= stopping_since + times.wait_new_s:
        return "no new group"
    if now >= stopping_since + times.grace_s - times.margin_s:
        return "deadline"
    return None


class StopWatcher:
    """A thread of its own (a slow controller never delays noticing a dead rank): every poll_s, is Serve
    stopping this group? Once it is, the group goes STOPPING (no new session); once the drain is due,
    `start_drain(why)` is called on the group's event loop (`loop()` gives it; None before the first session,
    when there is nothing to move)."""

    def __init__(self, group_id: str, state: GroupState, poll_s: float, times: DrainTimes,
                 loop: Callable[[], Optional[asyncio.AbstractEventLoop]], start_drain: Callable[[str], None],
                 replica_states: Callable[[], dict] = serve_replica_states):
        self.group_id = group_id
        self.state = state
        self.poll_s = poll_s
        self.times = times
        self.loop = loop
        self.start_drain = start_drain
        self.replica_states = replica_states
        self.stopping_since: Optional[float] = None   # when Serve was seen stopping this group (monotonic)
        self.rollout: Optional[float] = None          # when a stopping group of the deployment was first seen

    def start(self) -> None:
        threading.Thread(target=self.run, name=f"group-{self.group_id}-stopping", daemon=True).start()

    def run(self) -> None:
        while self.state.phase in (GroupPhase.SERVING, GroupPhase.STOPPING):
            time.sleep(self.poll_s)
            try:
                states = self.replica_states()
            except Exception as e:                    # outside Serve, or the controller busy: ask again later
                log.debug("group %s: replica states unavailable: %s", self.group_id, e)
                continue
            self.observe(states, time.monotonic(), time.time())

    def observe(self, states: dict[str, tuple[str, float]], now: float, wall: float) -> Optional[str]:
        """One poll's worth: the reason the drain starts now, or None."""
        stopping = [rid for rid, (state, _) in states.items() if state == "STOPPING"]
        if not stopping:
            self.rollout = None
        elif self.rollout is None:                    # a redeploy (or scale-down) began: groups since are new
            self.rollout = wall
        if self.group_id not in stopping:
            return None
        if self.stopping_since is None:
            self.stopping_since = now
            self.state.move(GroupPhase.STOPPING)
            log.info("group %s: Serve is stopping it; its sessions will move to another group", self.group_id)
        why = drain_due(self.group_id, states, self.rollout, self.stopping_since, now, self.times)
        loop = self.loop()
        if why is None or loop is None or loop.is_closed() or not self.state.move(GroupPhase.FILLING):
            return None
        loop.call_soon_threadsafe(self.start_drain, why)
        return why


async def drain(group_id: str, why: str, state: GroupState, chunks: ChunkLoop, ranks: RankExecutor, lead_s: float,
                times: DrainTimes) -> None:
    """Move every session to another group. First (unless the deadline is near) each runs ahead of its
    playback by `lead_s` (for at most times.fill_max_s: a full group has little throughput to spare), so that
    its viewer plays the move out of the buffer. Then the chunk the ranks are on and the deliveries in flight
    finish (so nothing computed is lost), each session gets Moving with the snapshots of its last chunk, and
    its ingress resumes it elsewhere (restoring that chunk: nothing to replay)."""
    t0 = time.monotonic()
    log.info("group %s: moving its %d sessions (%s)", group_id, len(chunks.sessions), why)
    if lead_s > 0 and chunks.wake is not None and why != "deadline":     # at the deadline there is no time
        for session in chunks.sessions.values():
            session.clock.pacer.hold_lead(lead_s)
        chunks.poke()

        def filling() -> bool:
            now = time.monotonic()
            return any(not s.finished and s.clock.deadline() - now < lead_s for s in chunks.sessions.values())
        while filling() and time.monotonic() - t0 < times.fill_max_s and not state.failed:
            await asyncio.sleep(0.05)
    filled = time.monotonic() - t0
    if not state.move(GroupPhase.HANDING_ON):
        return                                        # it failed meanwhile: its sessions were told
    await chunks.settle()                             # the chunk loop ends after its chunk
    sessions = [s for s in chunks.sessions.values() if not s.stopped]

    async def hand_on(session) -> None:
        try:
            flushed = await ranks.flush_snapshots(session.id, times.flush_timeout_s)
        except Exception as e:                        # the next group replays a chunk or two more
            log.warning("group %s: session %s moves without its last snapshots (%s)", group_id, session.id,
                        type(e).__name__)
            flushed = []
        session.snapshots.take(flushed)
        chunks.post(session.id, Moving("group_stopping", session.snapshots.give()))
    await asyncio.gather(*[hand_on(s) for s in sessions])
    log.info("group %s: %d sessions handed on in %.2f s (%.2f s of it running them ahead)", group_id,
             len(sessions), time.monotonic() - t0, filled)
