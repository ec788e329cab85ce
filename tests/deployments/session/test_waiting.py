"""Whether a waiting session waits on (`may_wait`), as a pure function of what Serve says about the groups: it
is refused only when every running group is full and none can be added, and the moment the last allowed group
comes up is not such a moment (its free places are still being routed to)."""
from deployments.ingress.census import GroupCensus
from deployments.session.waiting import ROUTING_SETTLE_S, Growth, may_wait


def test_below_max_groups_or_with_a_group_starting_a_session_waits():
    assert may_wait(Growth(1, 0, 2), 100.0, None, 0.0) == (True, None)
    assert may_wait(Growth(2, 1, 2), 100.0, None, 0.0) == (True, None)
    assert may_wait(Growth(1, 1, 2), 100.0, 90.0, 0.0) == (True, None)       # a group on its way: not stuck


def test_the_moment_the_last_allowed_group_comes_up_is_not_a_refusal():
    """Serve reports the second (last) group RUNNING at t=100; the lease queued for it is routed a moment later.
    Until ROUTING_SETTLE_S after that, the session waits (admission_wait_s 0); then it is refused at once."""
    up = Growth(running=2, starting=0, max_groups=2, grew_at=100.0)
    assert not up.can_grow
    for now in (100.0, 101.0, 100.0 + ROUTING_SETTLE_S - 0.01):
        assert may_wait(up, now, None, 0.0) == (True, None), now
    assert may_wait(up, 100.0 + ROUTING_SETTLE_S, None, 0.0) == (False, 100.0 + ROUTING_SETTLE_S)


def test_every_group_full_and_none_to_add_refuses_after_admission_wait_s():
    full = Growth(running=2, starting=0, max_groups=2, grew_at=10.0)         # up long ago
    assert may_wait(full, 100.0, None, 0.0) == (False, 100.0)                 # the default: at once
    assert may_wait(full, 100.0, None, 3.0) == (True, 100.0)                  # stuck since now, 3 s more
    assert may_wait(full, 102.9, 100.0, 3.0) == (True, 100.0)
    assert may_wait(full, 103.0, 100.0, 3.0) == (False, 100.0)
    assert may_wait(Growth(2, 0, 2), 100.0, None, 0.0) == (False, 100.0)      # never seen growing: the same


def test_the_census_says_when_the_running_count_last_rose():
    census = GroupCensus(max_groups=2, counts=lambda: (0, 0))
    census.observe(1, 0, now=50.0)
    assert census.last.grew_at == 50.0
    census.observe(1, 1, now=60.0)
    census.observe(2, 0, now=75.0)                                            # the last allowed group is up
    assert census.last == Growth(2, 0, 2, 15.0, 75.0)
    assert may_wait(census.last, 76.0, None, 0.0) == (True, None)
    census.observe(1, 0, now=200.0)                                           # one went: not a rise
    assert census.last.grew_at == 75.0
