"""perf/timing.py, the one loop that times chunks: each chunk's time and stages in order, the steady medians, chunks
of several sessions in turn; and perf/ab.py's report of two sides from it."""
import pytest

from perf.ab import report
from perf.timing import ChunkTimes, time_chunks, time_in_turn


class Chunk:
    def __init__(self, timings: dict):
        self.timings = timings


def test_each_chunk_is_timed_in_order_with_its_stages():
    seen = []

    def run():
        k = len(seen)
        return Chunk({"prepare": 0.001 * k, "probe_0": 0.002, "probe_1": 0.002, "commit": 0.001, "decode": 0.01})
    times = time_chunks(run, 8, each=lambda index, seconds, chunk: seen.append((index, chunk.timings["prepare"])))
    assert seen == [(k, 0.001 * k) for k in range(8)]            # `each` runs after its chunk, in order
    assert len(times.seconds) == 8 and all(s >= 0 for s in times.seconds)
    assert times.stage_names() == ["prepare", "probe_0", "probe_1", "commit", "decode"]
    assert times.stage_names(dit_only=True) == ["prepare", "probe_0", "probe_1", "commit"]
    assert times.stage_median("prepare") == pytest.approx(0.0065)      # steady = chunks 6, 7
    assert times.dit_median() == pytest.approx(0.0065 + 0.005)
    assert times.stage_median("probe_3", start=0) == 0                  # a stage no chunk ran counts 0


def test_steady_medians_and_totals():
    times = ChunkTimes([5.0, 1.0, 1.0, 1.0, 1.0, 1.0, 3.0, 2.0, 4.0], [{}] * 9)
    assert times.first == 5.0 and times.total == 19.0
    assert times.median() == 3.0 and times.median(0) == 1.0 and times.steady(7) == [2.0, 4.0]
    with pytest.raises(ValueError, match="9 chunks timed: none steady from chunk 9"):
        times.median(9)


def test_runs_in_turn_take_one_chunk_each_per_round():
    order = []
    runs = {name: (lambda name=name: order.append(name)) for name in ("a", "b", "c")}
    times = time_in_turn(runs, 2)
    assert order == ["a", "b", "c", "a", "b", "c"]
    assert {name: len(t.seconds) for name, t in times.items()} == {"a": 2, "b": 2, "c": 2}


def test_the_ab_report_gives_off_over_on_per_round():
    def side(seconds, decode):
        return ChunkTimes(seconds, [{"decode": decode}] * len(seconds))
    result = {True: [side([9.0, 1.0, 1.0], 0.5), side([8.0, 2.0, 2.0], 0.5)],
              False: [side([9.0, 3.0, 3.0], 1.5), side([8.0, 4.0, 4.0], 1.5)]}
    lines = report(result, steady_from=1)
    assert lines[0].split()[:4] == ["on", ":", "median", "1500.0"]
    assert lines[2].strip() == "off/on = 2.500 (spread 2.000 .. 3.000)"       # 3 / 1 and 4 / 2
    assert "on 9000, 8000; off 9000, 8000" in lines[3] and "off/on = 1.000" in lines[3]
    assert lines[-1].split() == ["decode", "500.00", "1500.00"]
