"""What an SP-2 rank runs once per group, or checks where it runs, on real gloo process groups against one
device: the condition encoder on rank 0 only (every rank's conditions bitwise those of one device, the
fixed point found at the same chunk, snapshots of the encoder state restoring bitwise); the attention
kernel probed in the layout a real chunk passes; and the budget's per-rank bytes (the chunk's camera
modulation, the CUDA graphs' static inputs, a snapshot's parts) equal to what a real chunk makes on each
rank."""
import pytest
import torch

from lingbot.camera import Controls
from lingbot.config import get_preset
from lingbot.parallel import Comm
from lingbot.parallel.launch import run_local
from tests.conftest import random_image
from tests.lingbot.runtime.recorders import ChunkTransient, GraphInputs, KernelLayouts, layout
from tests.lingbot.runtime.states import assert_same_state, host

TINY = get_preset("tiny")
CHUNKS = 12                      # past the tiny VAE's fixed point (chunk 10 for these images)
STEADY = TINY.transformer.window_chunks          # the first chunk at the steady-state shape


def _controls(k):
    return Controls(keys=(("w", "wa", "l"), ("", "i", "j"), ("s", "d", ""))[k % 3])


def _encoder_round_trip(pipeline, image):
    """A condition encoder's state after 4 chunks and at its fixed point, into a new encoder: the same state
    and the same next conditions (every rank runs this in the same order: the conditions are broadcast)."""
    from lingbot.runtime.condition import CausalConditionEncoder

    made = []

    def new():
        made.append(CausalConditionEncoder(pipeline.vae, image, encoder=pipeline.condition_encoder))
        return made[-1]
    ok = []
    encoder = new()
    for after in (4, CHUNKS):
        while encoder.committed_chunks < after:
            encoder.chunk_condition(encoder.committed_chunks)
            encoder.commit()
        state = encoder.state_dict(copy=host)
        restored = new()
        restored.load_state(state)
        assert_same_state(restored.state_dict(copy=host), state)
        for chunk in range(after, after + 2):
            ok.append(torch.equal(encoder.chunk_condition(chunk), restored.chunk_condition(chunk)))
            encoder.commit()
            restored.commit()
    return ok, encoder.fixed_point_chunk, sum(e.encoded_chunks for e in made)


def _group_run(comm):
    """One session of CHUNKS chunks: the conditions it got, who ran the encoder, the kernel's layout at the
    steady state and the probe's, and the per-rank bytes of a steady chunk."""
    from lingbot.builder import build_pipeline
    from lingbot.runtime.attention import kernel_inputs, window_attentions
    torch.manual_seed(0)
    pipeline = build_pipeline(TINY, comm=comm)
    model = pipeline.runner.model
    encoder_runs = []
    pipeline.vae.encoder.register_forward_pre_hook(lambda module, args: encoder_runs.append(1))
    layouts, graph, transient = KernelLayouts(window_attentions(model)[0]), GraphInputs(model), ChunkTransient(model)
    session = pipeline.new_session(random_image(TINY, seed=31), "a castle", seed=3)
    conditions = []
    ask = session.condition.chunk_condition
    session.condition.chunk_condition = lambda chunk: conditions.append(ask(chunk)) or conditions[-1]
    steady_calls = None
    snapshots = []
    for k in range(CHUNKS):
        graph.armed = k == STEADY
        if k == STEADY:
            steady_calls = len(layouts.calls)
        session.step(_controls(k))
        snapshots.append(_snapshot_bytes(session, comm))
    chunk_tokens = TINY.transformer.num_frames_per_block * TINY.tokens_per_frame
    probe = layout(*kernel_inputs(model, chunk_tokens, TINY.transformer.window_chunks * chunk_tokens, "cpu"))
    condition = session.condition
    broadcasts = comm.counts["condition"]
    again = pipeline.new_session(random_image(TINY, seed=31), "a castle", seed=4)     # replayed from the cache
    for k in range(2):
        again.step(_controls(k))
    replayed = again.condition.replay is not None and again.condition.encoded_chunks == 0 \
        and comm.counts["condition"] == broadcasts
    snapshots.append(_snapshot_bytes(again, comm))
    round_trip = _encoder_round_trip(pipeline, random_image(TINY, seed=32))
    return {"conditions": conditions, "fixed_point": condition.fixed_point_chunk, "encoded": condition.encoded_chunks,
            "encoder_runs": len(encoder_runs), "broadcasts": comm.counts["condition"], "replayed": replayed,
            "kernel_layout": layouts.calls[steady_calls], "probe_layout": probe,
            "graph_bytes": graph.bytes, "camera_bytes": transient.bytes, "round_trip": round_trip,
            "snapshots": snapshots}


def _snapshot_bytes(session, comm) -> dict:
    """The bytes of a snapshot of the session after its last chunk, by part."""
    from lingbot.runtime.snapshot import take_snapshot
    [slot], state = take_snapshot(session, comm.rank, comm.world_size)
    condition = state.state["condition"]
    latents = {id(t): t.nbytes for t in [condition["fixed_latents"], *(condition["replay"] or ())] if t is not None}
    return {"slot": slot.nbytes(), "state": state.nbytes(),
            "decoder": tuple(t.nbytes for t in state.state["decoder"].values()),
            "encoder": sum(t.nbytes for t in condition["cache"].values()), "latents": sum(latents.values())}


# CPU kernels split their reductions by thread (the VAE encoder's convolutions give other bits on 1 thread than on
# 2): the run on one device and each rank use the same number of threads, so the conditions compare bitwise
THREADS = 1


@pytest.fixture(scope="module")
def runs():
    """The run on one device and the SP-2 group's, side by side: the group's two ranks run in their own
    processes while this one runs the one device (each at THREADS threads: the machine's 2 cores busy, not
    one after the other)."""
    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(1) as pool:
        group = pool.submit(run_local, _group_run, 2, timeout_s=300, threads_per_rank=THREADS)
        threads = torch.get_num_threads()
        torch.set_num_threads(THREADS)
        try:
            one = _group_run(Comm())
        finally:
            torch.set_num_threads(threads)
        return one, group.result()


@pytest.fixture(scope="module")
def one_device(runs):
    return runs[0]


@pytest.fixture(scope="module")
def two_ranks(runs):
    return runs[1]


def test_the_condition_encoder_runs_on_rank_0_and_every_rank_gets_its_conditions_bitwise(one_device, two_ranks):
    assert one_device["fixed_point"] == 10 and len(one_device["conditions"]) == CHUNKS
    encoded = one_device["encoded"]
    assert encoded == 11 and one_device["encoder_runs"] > 0
    for rank, run in enumerate(two_ranks):
        assert len(run["conditions"]) == CHUNKS
        for k, (got, want) in enumerate(zip(run["conditions"], one_device["conditions"])):
            assert got.dtype == want.dtype and torch.equal(got, want), f"rank {rank}, chunk {k}"
        assert run["fixed_point"] == one_device["fixed_point"] and run["encoded"] == encoded, rank
        assert run["broadcasts"] == encoded + run["round_trip"][2], rank      # one per chunk encoded
        assert run["replayed"], rank                       # a first frame seen before: no encoder, no broadcast
    # the VAE encoder ran on rank 0 as on one device (the round trip's chunks included), never on rank 1
    assert two_ranks[0]["encoder_runs"] == one_device["encoder_runs"] and two_ranks[1]["encoder_runs"] == 0


def test_condition_snapshots_restore_bitwise_on_every_rank(one_device, two_ranks):
    for run in (one_device, *two_ranks):
        ok, fixed_point, _ = run["round_trip"]
        assert ok == [True] * 4 and fixed_point == 10


def test_the_kernel_is_probed_in_the_layout_a_chunk_passes(one_device, two_ranks):
    """At the steady state, the q, k, v layer 0's kernel gets equal the probe's in shape, strides and dtype:
    on one device and on both ranks of SP-2 (where q is a view into the all-to-all's buffer)."""
    assert one_device["kernel_layout"] == one_device["probe_layout"]
    for rank, run in enumerate(two_ranks):
        assert run["kernel_layout"] == run["probe_layout"], rank
    assert two_ranks[0]["probe_layout"][0][1] != one_device["probe_layout"][0][1]     # other strides at SP-2


def test_per_rank_bytes_are_what_a_real_chunk_makes(one_device, two_ranks):
    from lingbot.runtime.budget import chunk_camera_modulation_bytes, graph_static_bytes
    for world_size, runs in ((1, [one_device]), (2, two_ranks)):
        for rank, run in enumerate(runs):
            assert run["graph_bytes"] == graph_static_bytes(TINY, world_size), (world_size, rank)
            assert run["camera_bytes"] == [chunk_camera_modulation_bytes(TINY, world_size)] * (CHUNKS + 2), rank


def test_snapshot_bytes_are_what_the_budget_counts_on_every_rank(one_device, two_ranks):
    """snapshot_budget's per-rank bytes against every chunk's snapshot on one device and on both ranks of SP-2:
    the K/V slot (this rank's heads), the decoder cache (this rank's columns, with their halo under SP), the
    encoder's cache (rank 0 only, until the fixed point at chunk 10) and the state they make, one prompt (the
    budget's largest counts a transition's two more text embeddings); a first frame replayed from the cache
    holds its latents up to the fixed point (11 chunks, at most the budget's 16)."""
    from lingbot.runtime.budget import condition_chunk_bytes
    from lingbot.runtime.snapshot_budget import snapshot_footprint
    for world_size, runs in ((1, [one_device]), (2, two_ranks)):
        for rank, run in enumerate(runs):
            budget, where = snapshot_footprint(TINY, world_size, rank), (world_size, rank)
            *chunks, replayed = run["snapshots"]
            assert [c["slot"] for c in chunks] == [budget.slot] * CHUNKS, where
            assert all(c["decoder"] == budget.decoder_cache for c in chunks), where
            encoder = sum(budget.condition) if rank == 0 else 0
            assert [c["encoder"] for c in chunks] == [encoder] * 10 + [0] * (CHUNKS - 10), where
            state = budget.state - 2 * budget.text[0] - (0 if rank == 0 else sum(budget.condition))
            assert [c["state"] for c in chunks[:10]] == [state] * 10, where      # with a continuation's 5 slots:
            assert 5 * chunks[4]["slot"] + chunks[4]["state"] == budget.held - (budget.state - state)
            assert replayed["latents"] == 11 * condition_chunk_bytes(TINY) <= 16 * condition_chunk_bytes(TINY)
    # a group's slots are one device's, split by heads
    assert sum(r["snapshots"][0]["slot"] for r in two_ranks) == one_device["snapshots"][0]["slot"]
