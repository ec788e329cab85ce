"""The drain's decisions (deployments/group/drain.py), without Serve: when a stopping group moves its sessions,
and the stop watcher's reading of the controller's replica states."""
from dataclasses import replace

from deployments.group.drain import DrainTimes, StopWatcher, drain_due
from deployments.group.state import GroupPhase, GroupState
from deployments.settings import ServeSettings


def test_a_stopping_group_moves_its_sessions_to_a_group_with_room_or_before_its_grace_ends():
    times = DrainTimes.of(ServeSettings())
    grace, t, rollout = times.grace_s, 100.0, 5000.0          # monotonic now; wall clock of the first stop seen
    old = ("RUNNING", rollout - 3600.0)                  # started an hour before the redeploy (maybe full)
    new = ("RUNNING", rollout - times.new_group_slack_s + 1)   # started with the redeploy (seen a poll late)
    stopping = ("STOPPING", rollout - 3600.0)
    # a redeploy: b is old, c new; move once c runs, not to b
    assert drain_due("a", {"a": stopping, "b": old, "c": ("STARTING", 0.0)}, rollout, t, t + 29, times) is None
    assert drain_due("a", {"a": stopping, "b": old, "c": new}, rollout, t, t, times) == "new group"
    # the new one never comes up (it waits for the devices this one holds): after a while, to the old ones
    assert drain_due("a", {"a": stopping, "b": old, "c": ("STARTING", 0.0)}, rollout, t, t + 30, times) == \
        "no new group"
    # a scale-down: only this one goes, nothing starts: the others take the sessions
    assert drain_due("a", {"a": stopping, "b": old}, rollout, t, t, times) == "scale-down"
    # no other group at all: the sessions stay until the margin before the kill
    alone = {"a": stopping, "c": ("STARTING", 0.0)}
    assert drain_due("a", alone, rollout, t, t + grace - times.margin_s - 0.1, times) is None
    assert drain_due("a", alone, rollout, t, t + grace - times.margin_s, times) == "deadline"
    short = replace(times, grace_s=5.0)                   # grace < margin: at once
    assert drain_due("a", {"a": stopping, "b": stopping}, rollout, t, t, short) == "deadline"


class _Loop:
    """Stands for the group's event loop: records what the watcher schedules on it."""

    def __init__(self):
        self.called = []

    def is_closed(self) -> bool:
        return False

    def call_soon_threadsafe(self, fn, *args):
        self.called.append((fn, args))


def test_the_stop_watcher_stops_admission_first_and_drains_once_when_due():
    state, loop, started = GroupState(), _Loop(), []
    watcher = StopWatcher("a", state, 1.0, DrainTimes.of(ServeSettings()), lambda: loop, started.append)
    old = ("RUNNING", 1000.0)
    assert watcher.observe({"a": ("RUNNING", 1000.0), "b": old}, now=10.0, wall=5000.0) is None
    assert state.phase is GroupPhase.SERVING and watcher.rollout is None
    # Serve stops this group while another starts: no new session, its sessions go on for now
    states = {"a": ("STOPPING", 1000.0), "b": old, "c": ("STARTING", 0.0)}
    assert watcher.observe(states, now=11.0, wall=5001.0) is None
    assert state.phase is GroupPhase.STOPPING and not state.takes_sessions and state.runs_chunks
    assert (watcher.rollout, watcher.stopping_since) == (5001.0, 11.0)
    # the new group runs: the drain starts, once, on the loop
    states["c"] = ("RUNNING", 5002.0)
    assert watcher.observe(states, now=12.0, wall=5003.0) == "new group"
    assert state.phase is GroupPhase.FILLING and loop.called == [(started.append, ("new group",))]
    assert watcher.observe(states, now=13.0, wall=5004.0) is None and len(loop.called) == 1


def test_without_a_session_loop_the_watcher_waits_and_a_failed_group_never_drains():
    state = GroupState()
    watcher = StopWatcher("a", state, 1.0, DrainTimes.of(ServeSettings()), lambda: None, lambda why: None)
    states = {"a": ("STOPPING", 1000.0), "b": ("RUNNING", 1000.0)}
    assert watcher.observe(states, now=1.0, wall=2000.0) is None        # a scale-down, but nothing to move yet
    assert state.phase is GroupPhase.STOPPING
    assert state.move(GroupPhase.FAILED, "rank 1 died") and state.failure == "rank 1 died"
    assert not state.move(GroupPhase.FILLING) and not state.move(GroupPhase.SERVING)
    assert state.phase is GroupPhase.FAILED and not state.runs_chunks
