"""Switching a session's frame decoder mid-stream (the quality ladder's decoder rungs): each decoder's reach
into the past, warming it from the ring of recent latents bitwise and no further back than the ring, spread
warm-ups, snapshots of a switched session, and the refusals."""
import pytest
import torch

from lingbot.config import TAEConfig, VAEConfig
from lingbot.io.weights import build_random_tae
from lingbot.models.tae import TinyDecoder, TinyFrameDecoder
from lingbot.models.vae import CausalCache, FrameDecoder, WanVAE
from lingbot.runtime.decoding import DecoderNotLoaded, DecoderStream
from lingbot.runtime.pipeline import WorldPipeline, decode_latents
from lingbot.runtime.snapshot import restore_snapshots, take_snapshot
from tests.conftest import random_image

CHUNKS = 18          # more than the Wan decoder's 13 chunks of history: its warm-up starts past chunk 0


@pytest.fixture(scope="module")
def decoders(tiny, tiny_vae):
    return {"wan": FrameDecoder(tiny_vae), "tae": TinyFrameDecoder(build_random_tae(tiny.tae, tiny.weights_seed))}


@pytest.fixture(scope="module")
def latents(tiny):
    lh, lw = tiny.latent_hw
    return torch.randn(16, 3 * CHUNKS, lh, lw, generator=torch.Generator().manual_seed(5))


@pytest.fixture(scope="module")
def streams(decoders, latents):
    """Each decoder's frames of every chunk, and its cache after each, decoding the whole stream from chunk 0."""
    out = {}
    for name, decoder in decoders.items():
        cache, frames, caches = CausalCache(), [], []
        for c in range(CHUNKS):
            frames.append(decoder.to_frames(decoder.decode(latents[:, 3 * c:3 * c + 3], cache)))
            caches.append(cache.copy())
        out[name] = frames, caches
    return out


def test_each_decoders_history_is_its_reach_and_no_less_will_do(decoders, latents, streams):
    """A fresh cache that decodes the stream's last `history_frames` latent frames is the stream's bitwise; one
    frame fewer is not (so the warm-up is not passing by decoding everything)."""
    with torch.device("meta"):
        assert WanVAE(VAEConfig()).history_frames() == 38                # the real dims' (Wan 2.1, taew2_1)
        assert TinyDecoder(TAEConfig()).history_frames() == 8
    assert (decoders["wan"].history_frames, decoders["tae"].history_frames) == (38, 8)
    end = 3 * CHUNKS
    for name, decoder in decoders.items():
        reach = decoder.history_frames
        for frames, same in ((reach, True), (reach - 1, False)):
            cache = CausalCache()
            for t in range(end - frames, end):
                decoder.decode(latents[:, t:t + 1], cache)
            assert cache.bitwise_equal(streams[name][1][-1]) is same, (name, frames)


@pytest.mark.parametrize("plan", ["wan-tae-wan", "tae-wan-tae"])
def test_switched_chunks_are_that_decoders_stream_bitwise_with_a_warm_up_bounded_by_the_ring(
        decoders, latents, streams, plan):
    own, other = plan.split("-")[:2]
    stream = DecoderStream(decoders, own, [other])
    assert stream.ring_chunks == 13                                     # the Wan decoder's 38 frames, in chunks
    schedule = [own] * 15 + [other] * 2 + [own]                         # down at 15, back at 17
    warmed = []
    for c, name in enumerate(schedule):
        before = stream.warm_decodes
        frames = stream.decoder(name).to_frames(stream.decode(c, latents[:, 3 * c:3 * c + 3], name))
        assert torch.equal(frames, streams[name][0][c]), (c, name)
        assert len(stream.ring) == min(c + 1, 13) and stream.active == name
        warmed.append(stream.warm_decodes - before)
    # the warm-ups decode the switched-to decoder's history and no more (never the 15 chunks from 0)
    assert warmed == [0] * 15 + [stream.warm_chunks(other), 0, stream.warm_chunks(own)]
    assert {stream.warm_chunks("wan"), stream.warm_chunks("tae")} == {13, 3}


def test_a_spread_warm_up_catches_up_and_the_switch_then_decodes_nothing_more(decoders, latents, streams):
    stream = DecoderStream(decoders, "tae", ["wan"])
    calls = []
    for c in range(CHUNKS):
        if c < 8:
            stream.decode(c, latents[:, 3 * c:3 * c + 3])
            continue
        if stream.active == "tae":
            ready = stream.prewarm("wan", c, max_decodes=3)             # 3 a chunk: the lag shrinks 2 a chunk
            calls.append((c, stream.warm_decodes, ready))
            if not ready:
                stream.decode(c, latents[:, 3 * c:3 * c + 3])
                continue
        before = stream.warm_decodes
        frames = stream.decoder("wan").to_frames(stream.decode(c, latents[:, 3 * c:3 * c + 3], "wan"))
        assert stream.warm_decodes == before and torch.equal(frames, streams["wan"][0][c]), c
    # 3 a chunk, from 13 + 1 - ceil(13 / 3) = 9 chunks back: chunk 0, so the stream's as soon as it caught up
    assert calls == [(8, 3, False), (9, 6, False), (10, 9, False), (11, 11, True)]


def test_one_decode_a_chunk_warms_from_the_current_chunk_and_an_early_switch_warms_from_the_ring(
        decoders, latents, streams):
    stream = DecoderStream(decoders, "tae", ["wan"])
    ready = []
    for c in range(CHUNKS):
        if c >= 2:
            ready.append(stream.prewarm("wan", c))
        stream.decode(c, latents[:, 3 * c:3 * c + 3])
    # from chunk 2 on, one decode a chunk, from the chunk before: chunks 1..13 (13) decoded by chunk 14, ready
    # there and not before; the last call, at chunk 17, decoded chunk 16
    assert stream.warming.start == 1 and ready.index(True) == 14 - 2 and stream.warm_decodes == 16
    again = DecoderStream(decoders, "tae", ["wan"])
    for c in range(CHUNKS - 1):
        if c >= 10:
            assert again.prewarm("wan", c) is False                     # from chunk 9: not exact yet at 17
        again.decode(c, latents[:, 3 * c:3 * c + 3])
    before = again.warm_decodes
    frames = again.decoder("wan").to_frames(again.decode(CHUNKS - 1, latents[:, -3:], "wan"))
    assert torch.equal(frames, streams["wan"][0][-1]) and again.warm_decodes - before == 13   # warmed anew


def test_a_warm_up_that_falls_out_of_the_ring_starts_again(decoders, latents):
    stream = DecoderStream(decoders, "tae", ["wan"])
    for c in range(CHUNKS - 1):
        if c == 1:
            assert stream.prewarm("wan", c, max_decodes=13) is True     # chunk 0 decoded: the stream's at chunk 1
        stream.decode(c, latents[:, 3 * c:3 * c + 3])                    # ... and left behind from then on
    assert stream.warming.start == 0 and stream.ring[0][0] > stream.warming.next_chunk
    assert stream.prewarm("wan", CHUNKS - 1, max_decodes=13) is True     # a new one from chunk 17 - 13, at once
    assert stream.warming.start == CHUNKS - 1 - 13 and stream.warming.next_chunk == CHUNKS - 1


def test_refusals(decoders, latents):
    with pytest.raises(DecoderNotLoaded, match=r"decoder 'taesd' is not loaded here; loaded: \['wan', 'tae'\]"):
        DecoderStream(decoders, "wan", ["taesd"])
    fixed = DecoderStream(decoders, "wan")
    assert fixed.ring_chunks == 0
    with pytest.raises(ValueError, match=r"this session decodes with \['wan'\], not 'tae'"):
        fixed.decode(0, latents[:, :3], "tae")
    fixed.decode(0, latents[:, :3])
    assert len(fixed.ring) == 0                                          # a session that never switches keeps none
    with pytest.raises(ValueError, match="a state of a session with the 'tae' decoder cannot continue"):
        fixed.load_state(DecoderStream(decoders, "tae").state_dict())


def test_a_session_switched_to_the_tiny_decoder_resumes_from_its_snapshot_bitwise(tiny, tiny_runner, tiny_vae,
                                                                                 decoders):
    """Through the pipeline: a Wan session whose chunks 1-2 (the sink: a decoder rung may apply there) and 4-5 ran
    on the tiny decoder gives that decoder's frames of its latents; restored from its snapshot after chunk 4 it
    continues bitwise (the ring and the active decoder travel in the state)."""
    pipeline = WorldPipeline(tiny_runner, tiny_vae, decoders=decoders)
    image = random_image(tiny, seed=41)
    schedule = ["wan", "tae", "tae", "wan", "tae", "tae", "wan"]

    def run(session, start=0, stop=None):
        return [session.step(keep_latents=True, decoder=name) for name in schedule[start:stop]]

    session = pipeline.new_session(image, "a quarry", seed=3, switch_to=["tae"])
    chunks = run(session)
    latents = torch.cat([c.latents for c in chunks], dim=1)
    for name in ("wan", "tae"):
        reference = list(decode_latents(decoders[name], latents, 3))
        for c, chunk in enumerate(chunks):
            if schedule[c] == name:
                assert torch.equal(chunk.frames, reference[c]), (name, c)
    again = pipeline.new_session(image, "a quarry", seed=3, switch_to=["tae"])
    run(again, 0, 5)
    slots, state = take_snapshot(again, since=-1)
    assert state.state["active_decoder"] == "tae" and state.state["ring"]["chunks"] == [0, 1, 2, 3, 4]
    resumed = pipeline.new_session(image, "a quarry", seed=3, switch_to=["tae"])
    restore_snapshots(resumed, slots, state)
    for c, chunk in enumerate(run(resumed, 5), start=5):
        assert torch.equal(chunk.frames, chunks[c].frames), c
    with pytest.raises(ValueError, match=r"a state decoding with 'tae' cannot continue a session that decodes with"):
        pipeline.new_session(image, "a quarry", seed=3).load_state(state.state)
