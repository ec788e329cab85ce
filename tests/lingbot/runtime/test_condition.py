"""The causal condition encoder: chunked equals whole-clip, the fixed-point skip, pending/commit."""
import pytest
import torch

from lingbot.models.vae import CausalCache
from lingbot.runtime.condition import CausalConditionEncoder, ConditionCache
from tests.conftest import random_image
from tests.lingbot.runtime.states import assert_same_state, host

FIXED_POINT_CHUNK_TINY = 10     # measured: the tiny VAE's encoder state stops changing at chunk 10


def _run(encoder, chunks):
    out = []
    for k in range(chunks):
        out.append(encoder.chunk_condition(k))
        encoder.commit()
    return torch.cat(out, dim=1)


def test_chunked_condition_equals_whole_clip_encode(tiny, tiny_vae):
    image = random_image(tiny)
    chunks = 5
    encoder = CausalConditionEncoder(tiny_vae, image, skip_fixed_point=False)
    chunked = _run(encoder, chunks)                                       # [20, 15, h, w]
    video = torch.zeros(1, 3, 12 * chunks - 3, tiny.height, tiny.width)
    video[0, :, 0] = image
    with torch.no_grad():
        whole = tiny_vae.encode(video, CausalCache())[0]                  # [16, 15, h, w]
    assert chunked.shape == (20, 15, *tiny.latent_hw)
    assert (chunked[4:] - whole).abs().max() <= 1e-6
    assert torch.equal(chunked[:4, 0], torch.ones_like(chunked[:4, 0]))   # mask: latent frame 0 only
    assert torch.count_nonzero(chunked[:4, 1:]) == 0


# one first frame, prompt and seed for the pipeline tests below, on a pipeline of their own (an empty cache)
IMAGE_SEED, PROMPT, SEED = 8, "a harbour", 3
CHUNKS = FIXED_POINT_CHUNK_TINY + 3        # the fixed point, then chunks that skip the encoder


@pytest.fixture(scope="module")
def cold(tiny, tiny_runner, tiny_vae):
    """A pipeline of its own (skip_fixed_point on, an empty condition cache) and the first session on it:
    its first frame encoded up to the fixed point (and cached), its frames chunk by chunk over CHUNKS chunks.
    The session with the skip off and the session replaying the cache are each compared with it."""
    from lingbot.runtime.pipeline import WorldPipeline
    pipeline = WorldPipeline(tiny_runner, tiny_vae, skip_fixed_point=True)
    session = pipeline.new_session(random_image(tiny, seed=IMAGE_SEED), PROMPT, seed=SEED)
    frames = [session.step().frames for _ in range(CHUNKS)]
    assert len(pipeline.condition_cache.entries) == 1                   # its first frame, cached
    return pipeline, session, frames


def test_fixed_point_is_detected_and_changes_nothing(tiny, cold):
    pipeline, on, on_frames = cold
    pipeline.skip_fixed_point = False                                   # the same session with the skip off
    try:
        off = pipeline.new_session(random_image(tiny, seed=IMAGE_SEED), PROMPT, seed=SEED)
        off_frames = [off.step().frames for _ in range(CHUNKS)]
    finally:
        pipeline.skip_fixed_point = True
    on, off = (torch.cat(on_frames), on.condition), (torch.cat(off_frames), off.condition)
    assert on[1].fixed_point_chunk == FIXED_POINT_CHUNK_TINY
    assert on[1].encoded_chunks == FIXED_POINT_CHUNK_TINY + 1          # no encoder runs after the fixed point
    assert off[1].fixed_point_chunk is None and off[1].encoded_chunks == CHUNKS
    assert on[0].shape == (CHUNKS * 12 - 3, tiny.height, tiny.width, 3)
    assert torch.equal(on[0], off[0])                                   # bit-identical, after the fixed point too


def test_a_first_frame_seen_before_replays_its_conditions_bitwise(tiny, tiny_runner, tiny_vae, cold):
    """The second session from the same image runs no encoder and gives the same frames, bit for bit; a
    different image misses the cache; the cache stays within its bounds."""
    from lingbot.runtime.pipeline import WorldPipeline
    pipeline, cold, cold_frames = cold                     # the first session from the image, on an empty cache
    image = random_image(tiny, seed=IMAGE_SEED)
    assert cold.condition.fixed_point_chunk is not None and cold.condition.encoded_chunks > 0
    warm = pipeline.new_session(image.clone(), PROMPT, seed=SEED)
    assert warm.condition.replay is None                     # the cache is read in the first chunk, not before
    warm_frames = [warm.step().frames for _ in range(FIXED_POINT_CHUNK_TINY + 2)]
    assert warm.condition.replay is not None and warm.condition.encoded_chunks == 0   # the encoder never ran
    assert all(torch.equal(a, b) for a, b in zip(cold_frames[:len(warm_frames)], warm_frames, strict=True))
    other = pipeline.new_session(random_image(tiny, seed=9), PROMPT, seed=SEED)
    other.step()
    assert other.condition.replay is None
    replayed = len(pipeline.condition_cache.get(warm.condition.key))
    assert replayed == cold.condition.fixed_point_chunk + 1 <= pipeline.condition_cache.max_chunks
    off = WorldPipeline(tiny_runner, tiny_vae, skip_fixed_point=True, condition_cache=False)
    uncached = off.new_session(image, PROMPT, seed=SEED)
    uncached.step()
    assert uncached.condition.replay is None and uncached.condition.encoded_chunks == 1


def test_reset_re_encodes(tiny, tiny_vae):
    encoder = CausalConditionEncoder(tiny_vae, random_image(tiny), skip_fixed_point=True)
    first = _run(encoder, 12)
    assert encoder.fixed_point_chunk == FIXED_POINT_CHUNK_TINY
    encoder.reset()
    assert encoder.fixed_point_chunk is None and encoder.fixed_latents is None and not encoder.cache.started
    again = _run(encoder, 3)
    assert encoder.encoded_chunks == 3
    assert torch.equal(again, first[:, :9])


def test_error_mid_chunk_leaves_committed_state(tiny, tiny_vae):
    encoder = CausalConditionEncoder(tiny_vae, random_image(tiny), skip_fixed_point=False)
    _run(encoder, 2)
    snapshot = encoder.cache.copy()
    snapshot_tensors = {k: v.clone() for k, v in snapshot.entries.items()}
    calls = []

    def fail_on_third_call(module, inputs, output):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("injected failure")
    handle = tiny_vae.encoder.mid_block.resnets[1].conv2.register_forward_hook(fail_on_third_call)
    try:
        with pytest.raises(RuntimeError, match="injected failure"):
            encoder.chunk_condition(2)
    finally:
        handle.remove()
    assert encoder.committed_chunks == 2
    assert encoder.cache.entries.keys() == snapshot_tensors.keys()
    assert all(torch.equal(encoder.cache.entries[k], v) for k, v in snapshot_tensors.items())
    # the retried chunk equals the one an uninterrupted encoder produces
    clean = CausalConditionEncoder(tiny_vae, encoder.image, skip_fixed_point=False)
    assert torch.equal(encoder.chunk_condition(2), _run(clean, 3)[:, 6:9])


def test_uncommitted_chunk_is_not_kept(tiny, tiny_vae):
    encoder = CausalConditionEncoder(tiny_vae, random_image(tiny), skip_fixed_point=False)
    a = encoder.chunk_condition(0)               # the chunk failed later: no commit
    b = encoder.chunk_condition(0)
    assert torch.equal(a, b)
    with pytest.raises(ValueError, match="condition for chunk 1 asked; the encoder is at chunk 0"):
        encoder.chunk_condition(1)


def _round_trip(encoder, new, chunks_after=2):
    """`encoder`'s state into `new` (same image and settings): the same state, and the same next conditions."""
    state = encoder.state_dict(copy=host)
    new.load_state(state)
    assert_same_state(new.state_dict(copy=host), state)
    k = encoder.committed_chunks
    for chunk in range(k, k + chunks_after):
        assert torch.equal(encoder.chunk_condition(chunk), new.chunk_condition(chunk)), chunk
        encoder.commit()
        new.commit()
    return state


def test_encoder_state_round_trip_while_encoding(tiny, tiny_vae):
    image = random_image(tiny)
    encoder = CausalConditionEncoder(tiny_vae, image, skip_fixed_point=True)
    _run(encoder, 3)
    state = _round_trip(encoder, CausalConditionEncoder(tiny_vae, image, skip_fixed_point=True))
    assert state["committed"] == 3 and state["fixed_latents"] is None and state["cache"]     # the causal state


def test_encoder_state_round_trip_at_the_fixed_point_and_in_a_replay(tiny, tiny_vae):
    image, shared = random_image(tiny, seed=3), ConditionCache()

    def new():
        return CausalConditionEncoder(tiny_vae, image, skip_fixed_point=True, shared=shared)
    encoder = new()
    _run(encoder, FIXED_POINT_CHUNK_TINY + 1)
    state = _round_trip(encoder, new())
    assert state["fixed_point_chunk"] == FIXED_POINT_CHUNK_TINY and not state["cache"]   # the cache was freed
    replaying = new()                                   # the first frame's latents are in `shared` now
    _run(replaying, 2)
    state = _round_trip(replaying, new(), chunks_after=FIXED_POINT_CHUNK_TINY)
    assert len(state["replay"]) == FIXED_POINT_CHUNK_TINY + 1 and replaying.encoded_chunks == 0
