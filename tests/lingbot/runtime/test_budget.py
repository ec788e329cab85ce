"""Capacity counts what is held: per session what a session holds between chunks, once per rank what the
rank holds whatever its sessions (shared caches, the running chunk's camera modulation, the CUDA graphs'
static input buffers), each against a real chunk. (tests/lingbot/runtime/test_pipeline.py checks the
per-session part against what a real session owns; tests/lingbot/parallel/test_group_once.py the
per-rank part at SP-2.)"""
from lingbot.config import get_preset
from lingbot.lifecycle import MemoryReport, measured_capacity
from lingbot.runtime.budget import (
    chunk_camera_modulation_bytes,
    graph_static_bytes,
    rank_footprint,
    session_footprint,
    sessions_that_fit,
)
from tests.conftest import random_image
from tests.lingbot.runtime.recorders import ChunkTransient, GraphInputs

GIB = 2 ** 30


def test_what_a_rank_holds_once_is_not_counted_per_session(tiny):
    session, once = session_footprint(tiny), rank_footprint(tiny)
    assert once.graph_static == 0 and once.chunk_camera_modulation == chunk_camera_modulation_bytes(tiny)
    budget = once.total + 3 * session.total
    assert sessions_that_fit(tiny, 1, budget, max_sessions=10) == 3
    assert sessions_that_fit(tiny, 1, budget - 1, max_sessions=10) == 2
    with_graphs = rank_footprint(tiny, cuda_graphs=True)
    assert with_graphs.graph_static == graph_static_bytes(tiny) > 0
    assert sessions_that_fit(tiny, 1, budget, 10, cuda_graphs=True) == \
        (budget - with_graphs.total) // session.total
    # at 14B dims (480x832, bf16), one device: the figures
    big = get_preset("lingbot-world-v2-14b")
    assert round(chunk_camera_modulation_bytes(big) / GIB, 2) == 3.57
    assert round(graph_static_bytes(big) / GIB, 2) == 6.02
    assert chunk_camera_modulation_bytes(big, 8) == chunk_camera_modulation_bytes(big) // 8   # 4680 / 8 even


def test_the_rank_footprint_is_what_a_real_chunk_makes(tiny):
    """Every chunk prepares exactly the counted camera modulation, and one forward's region inputs that are
    not outputs of an earlier region (what CUDA graph trees copy into static buffers) are exactly the
    counted graph static bytes."""
    from lingbot.builder import build_pipeline
    pipeline = build_pipeline(tiny)                              # its own model: the recorders wrap its blocks
    model = pipeline.runner.model
    graph, transient = GraphInputs(model), ChunkTransient(model)
    session = pipeline.new_session(random_image(tiny, seed=21), "a lighthouse", seed=2)
    for chunk in range(tiny.transformer.window_chunks + 1):
        graph.armed = chunk == tiny.transformer.window_chunks        # the first forward of the steady chunk
        session.step()
    assert transient.bytes == [chunk_camera_modulation_bytes(tiny)] * (tiny.transformer.window_chunks + 1)
    assert graph.calls == 2 * tiny.transformer.num_layers
    assert graph.bytes == graph_static_bytes(tiny)


def test_measured_capacity_counts_what_the_rank_holds_once():
    """Graphs (and what the caches kept) are still allocated after warm-up, so already out of the free
    memory: only the peak beyond them and one session is the chunk's transient memory."""
    session = 3 * GIB
    memory = MemoryReport(total=100 * GIB, free=50 * GIB, allocated=46 * GIB, peak=58 * GIB, loaded=40 * GIB)
    # transient = 58 - 46 - 3 = 9; usable = 50 - 9 - 1 (shared caches) - 5 (margin) = 35 GiB -> 11 sessions
    # (counting from what was loaded, the graphs' 6 GiB would come off twice: 29 GiB -> 9)
    assert measured_capacity(memory, session, shared_caches=GIB, max_sessions=100) == 11
