"""The tiny decoder (TAEHV taew2_1): the published file's layout, streaming decode bitwise equal to the whole
clip, uint8 frames, its cache's state round trip, strict loading of .pth and .safetensors, and bf16 against
float32 (the data-type policy of config.tae_dtype)."""
import pytest
import torch

from lingbot.config import ConfigError, TAEConfig, get_preset
from lingbot.io.weights import WeightsError, build_random_tae, load_tae, read_tae_config
from lingbot.models.tae import TinyDecoder, TinyFrameDecoder
from lingbot.models.vae import CausalCache, frames_to_uint8

TINY_TAE = get_preset("tiny").tae
FILE = TAEConfig()                         # the published file's widths


def _latents(t, h=8, w=14, seed=0):
    return torch.randn(1, 16, t, h, w, generator=torch.Generator().manual_seed(seed))


def test_the_published_layout():
    """Keys, shapes and size of the taew2_1 decoder (madebyollin/taehv): conv in at index 1, memory blocks at
    3-5, 9-11, 15-17 (convs .conv.0/.2/.4, the first over [x, past]), grows at 7, 13, 19 (stride 1, 2, 2;
    1x1, no bias), width convs at 8, 14, 20 (no bias), RGB conv at 22; about 9.8 M parameters."""
    with torch.device("meta"):
        model = TinyDecoder(FILE)
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    assert len(shapes) == 64 and sum(v.numel() for v in model.parameters()) == 9_844_611
    assert shapes["decoder.1.weight"] == (256, 16, 3, 3) and shapes["decoder.1.bias"] == (256,)
    for block, width in ((3, 256), (4, 256), (5, 256), (9, 128), (10, 128), (11, 128), (15, 64), (17, 64)):
        assert shapes[f"decoder.{block}.conv.0.weight"] == (width, 2 * width, 3, 3)
        assert shapes[f"decoder.{block}.conv.4.bias"] == (width,)
    assert shapes["decoder.7.conv.weight"] == (256, 256, 1, 1)
    assert shapes["decoder.13.conv.weight"] == (256, 128, 1, 1)
    assert shapes["decoder.19.conv.weight"] == (128, 64, 1, 1)
    assert shapes["decoder.8.weight"] == (128, 256, 3, 3) and "decoder.8.bias" not in shapes
    assert shapes["decoder.22.weight"] == (3, 64, 3, 3) and shapes["decoder.22.bias"] == (3,)
    assert model.t_upscale == 4 and model.frames_to_trim == 3


def test_the_latent_channels_follow_the_vae():
    import dataclasses
    tiny = get_preset("tiny")
    with pytest.raises(ConfigError, match="tiny decoder's 8 latent channels must be the VAE's z_dim 16"):
        dataclasses.replace(tiny, tae=TAEConfig(latent_channels=8))
    assert TINY_TAE.latent_channels == tiny.vae.z_dim == 16


def test_random_weights_are_seeded_and_leave_the_global_rng():
    before = torch.random.get_rng_state()
    a, b, c = build_random_tae(TINY_TAE, 0), build_random_tae(TINY_TAE, 0), build_random_tae(TINY_TAE, 1)
    assert torch.equal(torch.random.get_rng_state(), before)
    for key, value in a.state_dict().items():
        assert torch.equal(value, b.state_dict()[key]), key
    assert not torch.equal(a.state_dict()["decoder.1.weight"], c.state_dict()["decoder.1.weight"])


@pytest.mark.parametrize("cfg,hw", [(TINY_TAE, (8, 14)), (FILE, (2, 3))], ids=["tiny", "file-widths"])
def test_streaming_decode_is_bitwise_the_whole_clip(cfg, hw):
    """8 chunks of 3 latent frames one after another with one cache equal the 24 frames decoded at once;
    chunk 0 gives 9 frames (the stream's first 3 dropped), every later chunk 12."""
    tae = build_random_tae(cfg, 0)
    latents = _latents(24, *hw)
    with torch.no_grad():
        whole = tae.decode(latents, CausalCache())
        cache, parts = CausalCache(), []
        for k in range(8):
            parts.append(tae.decode(latents[:, :, 3 * k:3 * k + 3], cache))
    assert [p.shape[2] for p in parts] == [9] + [12] * 7
    assert whole.shape == (1, 3, 4 * 24 - 3, 8 * hw[0], 8 * hw[1]) and whole.dtype == torch.float32
    assert torch.equal(torch.cat(parts, dim=2), whole)
    assert -1 <= whole.min() < whole.max() <= 1 and whole.std() > 0.1           # frames with texture


def test_frames_are_uint8_by_the_wan_decoders_conversion():
    """The tiny decoder's pixels in [-1, 1] go through vae.frames_to_uint8 on the device; against the TAE's
    own [0, 1] output y made uint8 directly, round(clamp(y, 0, 1) * 255), the [-1, 1] detour moves a pixel
    by at most one level (float rounding at a .5 boundary)."""
    decoder = TinyFrameDecoder(build_random_tae(TINY_TAE, 0))
    latents = _latents(3)[0]
    with torch.no_grad():
        video = decoder.decode(latents, CausalCache())
        frames = decoder.to_frames(video)
        y = decoder.tae._step(latents[None, :, 0], CausalCache())[0]         # [4, 3, H, W] in [0, 1]
    assert video.shape == (3, 9, 64, 112)
    assert frames.dtype == torch.uint8 and frames.shape == (9, 64, 112, 3)
    assert torch.equal(frames, frames_to_uint8(video))
    assert decoder.to_frames(None) is None
    direct = (y[-1].clamp(0, 1) * 255).round().to(torch.uint8).permute(1, 2, 0)   # the stream's first kept frame
    assert (frames[0].int() - direct.int()).abs().max() <= 1


def test_the_cache_state_round_trips():
    """A cache put back from its state_dict continues bitwise as the undisturbed one; it holds one frame per
    memory block (9 entries), counted by nbytes; a reset cache starts a new stream (trims again)."""
    tae = build_random_tae(TINY_TAE, 0)
    latents = _latents(12)
    with torch.no_grad():
        cache = CausalCache()
        for k in range(3):
            tae.decode(latents[:, :, 3 * k:3 * k + 3], cache)
        state = cache.state_dict(copy=lambda t: t.clone())
        restored = CausalCache()
        restored.load_state(state, "cpu")
        assert restored.bitwise_equal(cache) and restored.started
        assert torch.equal(tae.decode(latents[:, :, 9:12], restored), tae.decode(latents[:, :, 9:12], cache))
    c0, c1, c2 = TINY_TAE.channels[:3]
    blocks = (3, 4, 5, 9, 10, 11, 15, 16, 17)
    assert sorted(state, key=lambda k: int(k.split(".")[1])) == [f"decoder.{i}" for i in blocks]
    assert cache.nbytes() == 4 * 3 * (c0 * 8 * 14 + c1 * 16 * 28 + c2 * 32 * 56)
    cache.reset()
    assert tae.decode(latents[:, :, :3], cache).shape[2] == 9


def _written(tmp_path, model, suffix, edit=lambda state: None):
    """The model's state dict as the published file holds it (with encoder keys beside the decoder's), edited."""
    state = {k: v.clone() for k, v in model.state_dict().items()}
    state["encoder.0.weight"] = torch.zeros(64, 3, 3, 3)                      # the file's encoder, set aside
    edit(state)
    path = tmp_path / f"taew2_1{suffix}"
    if suffix == ".safetensors":
        from safetensors.torch import save_file
        save_file(state, path)
    else:
        torch.save(state, path)
    return path


@pytest.mark.parametrize("suffix", [".pth", ".safetensors"])
def test_strict_loading_of_both_file_forms(tmp_path, suffix):
    model = build_random_tae(TINY_TAE, 3)
    loaded = load_tae(_written(tmp_path, model, suffix), TINY_TAE)
    assert loaded.state_dict().keys() == model.state_dict().keys()
    for key, value in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key
    with torch.no_grad():
        assert torch.equal(loaded.decode(_latents(3), CausalCache()), model.decode(_latents(3), CausalCache()))
    bf16 = load_tae(_written(tmp_path, model, suffix), TINY_TAE, dtype=torch.bfloat16)
    assert bf16.dtype == torch.bfloat16

    def drop(state):
        del state["decoder.16.conv.2.bias"]

    def add(state):
        state["decoder.23.weight"] = torch.zeros(3)

    def reshape(state):                      # a grow of stride 1 where the file has 2
        state["decoder.13.conv.weight"] = torch.zeros(11, 11, 1, 1)
    for edit, message in ((drop, "is missing key 'decoder.16.conv.2.bias'"),
                          (add, "has unknown key 'decoder.23.weight'"),
                          (reshape, r"'decoder.13.conv.weight' has shape \[11, 11, 1, 1\] .* \[22, 11, 1, 1\]")):
        with pytest.raises(WeightsError, match=message):
            load_tae(_written(tmp_path, model, suffix, edit), TINY_TAE)


def test_loading_refuses_what_is_not_a_weights_file(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"taew2_1\.pth or taew2_1\.safetensors"):
        load_tae(tmp_path / "missing.pth")
    (tmp_path / "w.bin").write_bytes(b"")
    with pytest.raises(WeightsError, match=r"expected one of \['.pth', '.pt', '.safetensors'\]"):
        load_tae(tmp_path / "w.bin")
    torch.save({"decoder.1.weight": [1, 2]}, tmp_path / "w.pth")
    with pytest.raises(WeightsError, match="not a state dict of tensors"):
        load_tae(tmp_path / "w.pth")
    # the published widths against the tiny preset's: the first conv names the mismatch
    with pytest.raises(WeightsError, match=r"key 'decoder.1.weight' has shape \[256, 16, 3, 3\]"):
        load_tae(_written(tmp_path, build_random_tae(FILE, 0), ".pth"), TINY_TAE)


@pytest.mark.parametrize("cfg", [FILE, TINY_TAE], ids=["published-widths", "tiny-widths"])
def test_a_file_loads_at_its_own_widths(tmp_path, cfg):
    """Given no widths, the loader reads them from the file's tensor shapes: a file written from a random
    decoder of the published widths and one of the tiny preset's load to that decoder exactly. Loading stays
    strict: a key at a width the others do not chain to, or a missing conv in, is named."""
    model = build_random_tae(cfg, 5)
    path = _written(tmp_path, model, ".pth")
    assert read_tae_config(path) == cfg
    loaded = load_tae(path)
    assert loaded.config == cfg and loaded.state_dict().keys() == model.state_dict().keys()
    for key, value in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key
    latents = _latents(3, 2, 3)
    with torch.no_grad():
        assert torch.equal(loaded.decode(latents, CausalCache()), model.decode(latents, CausalCache()))

    def narrow(state):                       # the second stage's first memory block one channel wide
        state["decoder.9.conv.0.weight"] = torch.zeros(1, 1, 3, 3)

    def drop_conv_in(state):
        del state["decoder.1.weight"]
    with pytest.raises(WeightsError, match=r"'decoder\.9\.conv\.0\.weight' has shape \[1, 1, 3, 3\]"):
        load_tae(_written(tmp_path, model, ".pth", narrow))
    with pytest.raises(WeightsError, match=r"is missing key 'decoder\.1\.weight'"):
        load_tae(_written(tmp_path, model, ".pth", drop_conv_in))


def test_bf16_holds_against_float32():
    """The accelerator dtype (config.tae_dtype) on random weights at the file's widths. Measured at 64x112
    over 8 chunks: max |diff| 0.026 in [-1, 1] (3 uint8 levels), mean 0.0034, flat over the chunks (each
    frame sees a bounded past). Here, 6 chunks at 32x48 (bf16 convolutions are slow on a CPU): held to 0.05
    max and 0.01 mean per chunk, at most 6 uint8 levels, and the last chunk no worse than twice the first."""
    f32, b16 = build_random_tae(FILE, 0), build_random_tae(FILE, 0, torch.bfloat16)
    latents = _latents(18, 4, 6)
    worst, mean = [], []
    with torch.no_grad():
        c32, c16 = CausalCache(), CausalCache()
        for k in range(6):
            a = f32.decode(latents[:, :, 3 * k:3 * k + 3], c32)
            b = b16.decode(latents[:, :, 3 * k:3 * k + 3], c16)
            assert b.dtype == torch.float32
            diff = (a - b).abs()
            worst.append(diff.max().item())
            mean.append(diff.mean().item())
            levels = (frames_to_uint8(a[0]).int() - frames_to_uint8(b[0]).int()).abs().max().item()
            assert levels <= 6, (k, levels)
    assert max(worst) < 0.05 and max(mean) < 0.01, (worst, mean)
    assert worst[-1] < 2 * worst[0] and mean[-1] < 2 * mean[0]
