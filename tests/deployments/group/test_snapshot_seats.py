"""Snapshots counted against the host at admission, without Ray: the host memory a group's snapshots may use
(set, or a share of its node's by its part of the node's accelerators), the sessions it holds, and the seats
that decide which sessions keep snapshots (the others run without, and a warning says so)."""
import logging

import psutil

from deployments.group.rank import RankWorker
from deployments.group.snapshots import (
    SnapshotSeats,
    group_share,
    snapshot_host_budget,
    snapshot_sessions,
)
from deployments.settings import ServeSettings
from lingbot.config import get_preset
from lingbot.runtime.snapshot_budget import GIB, SNAPSHOT_HOST_SHARE, snapshot_host

BIG = get_preset("lingbot-world-v2-14b")
CUDA = dict(preset="lingbot-world-v2-14b", model_path="/models/x", device="cuda", rank_devices=1)


def test_the_host_budget_is_the_setting_or_the_groups_share_of_its_node():
    sp4 = ServeSettings(**CUDA, sp=4)
    node = {"GPU": 8.0, "CPU": 192.0}
    assert group_share(sp4, node) == 0.5 and group_share(sp4, {}) == 1.0           # unknown: the whole node
    assert snapshot_host_budget(sp4, 2048 * GIB, node) == int(SNAPSHOT_HOST_SHARE * 1024 * GIB)
    assert snapshot_host_budget(ServeSettings(**CUDA, sp=4, snapshot_host_budget_gib=100), 2048 * GIB, node) \
        == 100 * GIB
    cpu = ServeSettings(sp=2, rank_cpus=0.5)                                       # CPUs stand for devices
    assert group_share(cpu, {"CPU": 4.0}) == 0.25


def test_a_group_counts_its_snapshots_sessions_against_the_budget():
    """At 14B SP-4 a 2 TiB node with two groups gives each 307 GiB: 6 sessions with snapshots each. Every 3
    chunks copies less per chunk but holds no less, and a snapshot may carry 3 slots while the window fills
    (the bound on those on their way counts it): 4 fit."""
    node = {"GPU": 8.0}
    host = snapshot_host(BIG, 4, 1, cuda=True)
    sessions, budget = snapshot_sessions(ServeSettings(**CUDA, sp=4), host, 2048 * GIB, node)
    assert budget == int(0.3 * 1024 * GIB)
    assert sessions == (budget - host.once) // host.per_session == 6
    every_3 = snapshot_host(BIG, 4, 3, cuda=True)
    assert snapshot_sessions(ServeSettings(**CUDA, sp=4, snapshot_interval_chunks=3), every_3, 2048 * GIB, node)[0] == 4
    # one H200 on a 128 GiB host: none (the issue: two sessions would spill)
    one = snapshot_host(BIG, 1, 1, cuda=True)
    assert snapshot_sessions(ServeSettings(**CUDA, sp=1), one, 128 * GIB, {"GPU": 1.0})[0] == 0
    exact = ServeSettings(**CUDA, sp=4, snapshot_host_budget_gib=host.for_sessions(2) / GIB)
    assert snapshot_sessions(exact, host, 0, {})[0] == 2


def test_sessions_beyond_the_seats_run_without_snapshots_and_say_so(caplog):
    seats = SnapshotSeats("g1", 1)
    assert SnapshotSeats.of("g1", ServeSettings(), None) is None        # snapshots off: rank 0 reported no cost
    keeper = object()
    with caplog.at_level(logging.WARNING, logger="deployments.group.snapshots"):
        assert seats.take("a", keeper) is keeper and seats.take("a", keeper) is keeper   # a resume of "a": its seat
        assert seats.take("b", keeper) is None
        assert seats.take("c", None) is None                  # no keeper (snapshots off at the ingress): no seat
    [warning] = caplog.records
    assert "session b runs without snapshots" in warning.getMessage() and "holds 1 sessions" in warning.getMessage()
    seats.give("a")
    seats.give("b")                                           # held none: nothing happens
    assert seats.take("d", keeper) is keeper and seats.holders == {"d"}


def test_rank_0_reports_what_snapshots_cost_and_the_group_counts_its_seats_once():
    """Rank 0 reports one session's snapshot cost at the served interval; the
    group counts the seats from it once. Without Ray the node is the whole share: SNAPSHOT_HOST_SHARE of this
    machine's memory (tiny, CPU)."""
    settings = ServeSettings(sp=1, snapshot_interval_chunks=2)
    info = RankWorker(settings.to_dict(), rank=0, world_size=1).join(None)
    host = snapshot_host(get_preset("tiny"), 1, 2, cuda=False, decoders=("tae", "wan"))   # with the ring it keeps
    assert info.snapshot_host == host and len(host.ranks[0].ring) == 13
    seats = SnapshotSeats.of("g1", settings, info.snapshot_host)
    assert seats.seats == host.sessions_within(int(SNAPSHOT_HOST_SHARE * psutil.virtual_memory().total)) > 0
    assert RankWorker(ServeSettings(sp=1, snapshots=False).to_dict(), 0, 1).join(None).snapshot_host is None
