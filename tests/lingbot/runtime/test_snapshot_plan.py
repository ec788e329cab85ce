"""What a group does with its sessions' snapshots on a host budget (`plan_snapshots`): on one H200 with a
128 GiB host a 14B SP-1 group keeps none, and says why once; a larger budget keeps the first sessions."""
from lingbot.config import get_preset
from lingbot.runtime.snapshot_budget import (
    GIB,
    default_host_budget,
    plan_snapshots,
    snapshot_host,
)

BIG = snapshot_host(get_preset("lingbot-world-v2-14b"))


def test_a_128_gib_host_keeps_no_14b_session_and_no_budget_there_would():
    plan = plan_snapshots(BIG, default_host_budget(128 * GIB), 128 * GIB)
    assert plan.budget == int(0.3 * 128 * GIB) and plan.sessions == 0 and not plan.enabled
    assert plan.first_session == BIG.once + BIG.per_session and round(plan.first_session / GIB, 2) == 87.88
    assert plan.host_can_hold_one is False                         # 87.9 GiB > half of 128
    assert plan.summary() == ("no snapshots: one session's take 87.88 GiB of host memory and the budget is 38.40 GiB; "
                              "every session resumes by replaying its journal (more than 50% of this host's "
                              "128.00 GiB: no budget here keeps one)")


def test_a_host_that_could_hold_one_says_the_budget_that_would():
    plan = plan_snapshots(BIG, default_host_budget(256 * GIB), 256 * GIB)
    assert plan.sessions == 0 and plan.host_can_hold_one is True
    assert plan.summary().endswith("(snapshot_host_budget_gib >= 87.9, with Ray's object store as large, would "
                                   "keep one)")
    assert plan_snapshots(BIG, 50 * GIB).host_can_hold_one is None             # node unknown: no advice
    assert plan_snapshots(BIG, 50 * GIB).summary().endswith("every session resumes by replaying its journal")


def test_a_budget_that_holds_sessions_keeps_the_first_of_them():
    plan = plan_snapshots(BIG, default_host_budget(2048 * GIB, group_share=0.5))     # two groups on the node
    assert plan.budget == int(0.3 * 1024 * GIB) and plan.sessions == (plan.budget - BIG.once) // BIG.per_session == 6
    assert plan.enabled and plan.summary() == (
        "snapshots for 6 sessions (the budget is 307.20 GiB; the first takes 87.88 GiB, each more 41.85 GiB); "
        "sessions beyond resume by replaying their journal")
    assert plan_snapshots(BIG, plan.first_session).sessions == 1
    assert plan_snapshots(BIG, plan.first_session - 1).sessions == 0

