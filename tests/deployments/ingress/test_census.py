"""The census of groups the admission loop reads: counts from Serve's status (here a list the test steps
through), asked at most once per ttl, and a group start measured from the counts."""
import asyncio

from deployments.ingress.census import GroupCensus


def test_a_start_is_measured_from_first_seen_starting_to_running():
    census = GroupCensus(max_groups=2, counts=lambda: (0, 0))
    census.observe(0, 1, now=100.0)                 # the first group starting
    census.observe(0, 1, now=110.0)
    census.observe(1, 0, now=125.0)                 # running: 25 s
    assert census.last.start_s == 25.0 and census.last.can_grow
    census.observe(1, 1, now=200.0)                 # a burst: two more at once
    census.observe(2, 1, now=220.0)
    census.observe(3, 0, now=240.0)
    assert list(census.starts) == [25.0, 20.0, 40.0] and census.last.start_s == 25.0     # the median
    assert not census.last.can_grow or census.max_groups > 3
    census.observe(2, 0, now=300.0)                 # one scaled down: no start measured
    assert len(census.starts) == 3


def test_growth_is_asked_once_per_ttl_and_a_status_failure_means_it_may_still_grow():
    calls = []

    def counts():
        calls.append(1)
        if len(calls) == 2:
            raise ConnectionError("controller restarting")
        return (2, 0)

    async def scenario():
        census = GroupCensus(max_groups=2, counts=counts, ttl_s=0.2)
        first = [await census.growth() for _ in range(5)]
        await asyncio.sleep(0.25)
        second = await census.growth()
        return first, second

    first, second = asyncio.run(scenario())
    assert len(calls) == 2 and all(g == first[0] for g in first) and not first[0].can_grow
    assert second.can_grow and second.starting == 1                         # unknown: assume one may come
