"""The rank lifecycle on CPU: connect, load, warm up (one chunk eager on CPU), measure, capacity; and
the capacity rule for measured device memory, against numbers worked by hand."""
import numpy as np

from lingbot.lifecycle import MemoryReport, RankLifecycle, measured_capacity, warm_up_chunks
from lingbot.runtime.budget import CPU_BUDGET_BYTES, session_footprint, sessions_that_fit

GIB = 2 ** 30


def test_lifecycle_in_order_on_cpu(tiny):
    life = RankLifecycle(rank=0, world_size=1, device="cpu")
    comm = life.connect(None, timeout_s=10)
    assert comm.world_size == 1
    pipeline = life.load("tiny")
    report = life.warm_up()
    assert report.chunks == 1 and not life.compiled                         # eager on CPU: one chunk
    assert life.warm_up(chunks=3).chunks == 3
    assert life.measure() is None                                          # CPU: the budget rule
    assert life.capacity(max_sessions=4) == sessions_that_fit(tiny, 1, CPU_BUDGET_BYTES, 4)
    assert life.capacity(max_sessions=4, budget_bytes=1) == 0
    # the warm-up session is gone and the pipeline serves real ones from chunk 0
    session = pipeline.new_session(np.zeros((64, 112, 3), np.uint8), "p", seed=1)
    assert session.step().index == 0


def test_the_warm_up_runs_every_window_length_where_shapes_matter():
    import torch
    assert warm_up_chunks(6, torch.device("cpu"), compiled=False) == 1
    assert warm_up_chunks(6, torch.device("cpu"), compiled=True) == 7          # a graph per window length
    assert warm_up_chunks(6, torch.device("cuda", 0), compiled=False) == 7     # kernel choices, allocator growth


def test_measured_capacity_by_hand(tiny):
    session = 3 * GIB
    memory = MemoryReport(total=100 * GIB, free=60 * GIB, allocated=40 * GIB, peak=48 * GIB, loaded=40 * GIB)
    # activations = 48 - 40 - 3 = 5 GiB; usable = 60 - 5 - 1 (prompt cache) - 5 (5% margin) = 49 GiB -> 16
    assert measured_capacity(memory, session, shared_caches=GIB, max_sessions=100) == 16
    assert measured_capacity(memory, session, shared_caches=GIB, max_sessions=4) == 4     # the config caps it
    tight = MemoryReport(total=100 * GIB, free=8 * GIB, allocated=90 * GIB, peak=95 * GIB, loaded=90 * GIB)
    assert measured_capacity(tight, session, shared_caches=GIB, max_sessions=4) == 0      # never negative
    assert session_footprint(tiny).total > 0


def test_a_rank_measures_the_ladders_rungs_before_any_session():
    """With both decoders loaded and the decoder rung as the floor: a sink chunk on the tiny decoder (every step:
    `tiny`) and a chunk at tiny_steps2, each timed on a throwaway session that is gone after (the pipeline serves a
    real one from chunk 0)."""
    from lingbot.runtime.rungs import rung
    life = RankLifecycle(rank=0, world_size=1, device="cpu")
    life.connect(None, timeout_s=10)
    pipeline = life.load("tiny", decoder=("wan", "tae"))
    times = life.measure_rungs(rung("tiny_steps2"))
    assert sorted(times) == ["tiny", "tiny_steps2"] and all(t > 0 for t in times.values())
    assert pipeline.new_session(np.zeros((64, 112, 3), np.uint8), "p", seed=1).step().index == 0
