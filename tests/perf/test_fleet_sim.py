"""The fleet simulation drives the serving code's decisions: sessions are conserved, a fleet that may still grow
refuses nobody, one held at max_groups refuses at once, and a spare group costs group-hours and shortens waits."""
from perf.fleet_sim import simulate

BASE = dict(mean_length_s=300.0, hours=1.0, capacity=2, min_groups=1, start_s=180.0, max_queue_wait_s=600.0,
            admission_wait_s=0.0, seed=3)


def test_room_to_grow_refuses_nobody_and_a_spare_trades_group_hours_for_waits():
    plain = simulate(6.0, max_groups=64, spare_groups=0, **BASE)
    spare = simulate(6.0, max_groups=64, spare_groups=2, **BASE)
    for r in (plain, spare):
        assert r["refused"] == 0 and r["arrived"] == r["served"] + r["waiting_at_end"]
    assert spare["group_hours"] > plain["group_hours"] and spare["wait_p99_s"] < plain["wait_p99_s"]


def test_a_fleet_at_max_groups_refuses_the_overflow():
    r = simulate(12.0, max_groups=4, spare_groups=0, **BASE)          # 60 sessions' demand on 8 slots
    assert r["refused"] > r["served"] > 0 and r["group_hours"] <= 4.0


def test_with_the_ladder_groups_take_sessions_to_the_floor_and_the_tail_wait_shortens():
    """Capacity 2 at the top rung, 3 at the floor: the sessions that would wait for a group start are taken on
    cheaper rungs by a running group (p99 wait down), the autoscaler still adds groups at the top rung's count,
    and the share of session time below the top rung is what that costs; without the ladder none is below."""
    plain = simulate(6.0, max_groups=64, spare_groups=0, **BASE)
    laddered = simulate(6.0, max_groups=64, spare_groups=0, floor_capacity=3, **BASE)
    assert plain["below_top_share"] == 0 and 0 < laddered["below_top_share"] < 0.5
    assert laddered["wait_p99_s"] < plain["wait_p99_s"] and laddered["refused"] == 0
    assert laddered["arrived"] == laddered["served"] + laddered["waiting_at_end"]
    assert simulate(12.0, max_groups=4, spare_groups=0, floor_capacity=3, **BASE)["served"] > \
        simulate(12.0, max_groups=4, spare_groups=0, **BASE)["served"]             # at max_groups: 12 slots, not 8
