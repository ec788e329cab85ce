"""A pipeline with both frame decoders: sessions pick one at creation, a tiny-decoder session streams 9 then 12
uint8 frames, resumes bitwise from its snapshots (and only with the same decoder), and the budget counts its
cache as a real session holds it. The builder's decoder setting and its refusals."""
import pytest
import torch

from lingbot.builder import build_pipeline, decoder_names
from lingbot.config import ConfigError
from lingbot.io.weights import build_random_tae
from lingbot.models.tae import TinyFrameDecoder
from lingbot.models.vae import FrameDecoder
from lingbot.runtime.budget import session_footprint
from lingbot.runtime.decoding import DecoderNotLoaded
from lingbot.runtime.pipeline import WorldPipeline
from lingbot.runtime.snapshot import chunks_to_restore, restore_snapshots, take_snapshot
from lingbot.runtime.snapshot_budget import snapshot_footprint
from tests.conftest import random_image


@pytest.fixture(scope="module")
def both(tiny, tiny_runner, tiny_vae):
    """The tiny model with the tiny decoder first (the sessions' default) and the Wan decoder."""
    tae = TinyFrameDecoder(build_random_tae(tiny.tae, tiny.weights_seed))
    return WorldPipeline(tiny_runner, tiny_vae, decoders={"tae": tae, "wan": FrameDecoder(tiny_vae)})


def test_a_session_picks_a_loaded_decoder(tiny, both):
    image = random_image(tiny, seed=31)
    tae, wan = both.new_session(image, "a mill", seed=2), both.new_session(image, "a mill", seed=2, decoder="wan")
    assert (tae.decoder_name, wan.decoder_name) == ("tae", "wan") and both.default_decoder == "tae"
    assert both.decoder is both.decoders["tae"] and tae.decoder is both.decoders["tae"]
    with pytest.raises(DecoderNotLoaded, match=r"decoder 'taesd' is not loaded here; loaded: \['tae', 'wan'\]"):
        both.new_session(image, "a mill", seed=2, decoder="taesd")
    counts = []
    for _ in range(2):
        a, b = tae.step(keep_latents=True), wan.step(keep_latents=True)
        assert a.frames.dtype == torch.uint8 and a.frames.shape[1:] == (tiny.height, tiny.width, 3)
        assert a.frames.shape == b.frames.shape and not torch.equal(a.frames, b.frames)
        assert torch.equal(a.latents, b.latents)                  # the decoder does not feed back into the DiT
        counts.append(a.frames.shape[0])
    assert counts == [9, 12]
    assert both.new_session(image, "a mill", seed=2).step().latents is None        # kept only when asked


def test_a_tiny_decoder_session_resumes_bitwise(tiny, both):
    """Snapshots after chunk 1 put into a fresh session give chunks 2 and 3 bitwise; a session with the other
    decoder refuses the state."""
    image = random_image(tiny, seed=32)
    whole = both.new_session(image, "a mill", seed=5)
    frames, snapshots = [], {}
    for k in range(4):
        frames.append(whole.step().frames.clone())
        snapshots[k] = take_snapshot(whole)
    kv = whole.dit.kv
    needed = chunks_to_restore(1, kv.sink_chunks, kv.window_chunks)
    state = snapshots[1][1]
    assert state.state["decoder_name"] == "tae" and len(state.state["decoder"]) == 9      # one per memory block
    fresh = both.new_session(image, "a mill", seed=5)
    slots = {slot.index: slot for k in range(2) for slot in snapshots[k][0]}     # each chunk's slot, once
    restore_snapshots(fresh, [slots[c] for c in needed], state)
    for k in (2, 3):
        assert torch.equal(fresh.step().frames, frames[k]), k
    other = both.new_session(image, "a mill", seed=5, decoder="wan")
    with pytest.raises(ValueError, match="with the 'tae' decoder cannot continue a session with the 'wan' one"):
        restore_snapshots(other, [slots[c] for c in needed], state)


def test_the_budget_counts_the_tiny_decoders_cache(tiny, both):
    """The per-session decoder cache of the budget is the bytes a real tiny-decoder session holds after each
    chunk; with both decoders loaded the larger is counted (a session may pick either); on an accelerator
    the tiny decoder runs in bf16 (half the bytes)."""
    session = both.new_session(random_image(tiny, seed=33), "a mill", seed=1)
    tae = session_footprint(tiny, decoders=("tae",))
    for _ in range(2):
        session.step()
        assert session.decoder_cache.nbytes() == tae.decoder_cache
    wan = session_footprint(tiny)
    assert session_footprint(tiny, decoders=("tae", "wan")).decoder_cache == max(tae.decoder_cache, wan.decoder_cache)
    assert session_footprint(tiny, decoders=("tae",), device="cuda").decoder_cache == tae.decoder_cache // 2
    assert tae.total - tae.decoder_cache == wan.total - wan.decoder_cache
    assert snapshot_footprint(tiny, decoder="tae").state - snapshot_footprint(tiny).state == \
        tae.decoder_cache - wan.decoder_cache


def test_the_decoder_setting():
    assert decoder_names("tae") == ("tae",) and decoder_names(["tae", "wan"]) == ("tae", "wan")
    for bad in ("taesd", (), ("wan", "wan")):
        with pytest.raises(ConfigError, match="give one or more distinct names of"):
            decoder_names(bad)
    # a real model needs the tiny decoder's file: refused before any weights are read
    with pytest.raises(ConfigError, match="tiny decoder needs its weights with a real model: give tae_path"):
        build_pipeline("lingbot-world-v2-14b", "/nonexistent/folder", decoder="tae")
    with pytest.raises(FileNotFoundError, match=r"tiny decoder weights /nonexistent\.pth do not exist"):
        build_pipeline("tiny", decoder=("wan", "tae"), tae_path="/nonexistent.pth")
    pipeline = build_pipeline("tiny", decoder=("wan", "tae"))
    assert list(pipeline.decoders) == ["wan", "tae"] and pipeline.default_decoder == "wan"
    assert isinstance(pipeline.decoders["tae"], TinyFrameDecoder)
    assert pipeline.decoders["tae"].tae.dtype == torch.float32                # config.tae_dtype on the CPU
