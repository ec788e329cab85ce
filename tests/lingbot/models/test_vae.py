"""Our Wan VAE against diffusers' AutoencoderKLWan (bitwise with PyTorch's own kernel choice, to float rounding
with the CPU's faster kernels, the default), streaming decode, strict loading, uint8 pixels."""
import diffusers
import numpy as np
import pytest
import torch

from lingbot.config import VAEConfig
from lingbot.io.weights import WeightsError, build_random_vae, load_vae, save_vae
from lingbot.models.vae import CausalCache, frames_to_uint8

CFG = VAEConfig(base_dim=8)


@pytest.fixture(scope="module")
def vae_pair():
    ours = build_random_vae(CFG, seed=3)
    theirs = diffusers.AutoencoderKLWan(base_dim=8, z_dim=16).eval()
    theirs.load_state_dict(ours.state_dict(), strict=True)        # same names, same shapes
    return ours, theirs


@pytest.fixture()
def exact_pair(vae_pair):
    """The pair with ours on the kernels PyTorch picks, as diffusers' layers run them."""
    ours, theirs = vae_pair
    yield ours.use_exact_kernels(), theirs
    ours.use_exact_kernels(False)


def _norm(cfg):
    mean = torch.tensor(cfg.latents_mean).view(1, -1, 1, 1, 1)
    inv_std = 1.0 / torch.tensor(cfg.latents_std).view(1, -1, 1, 1, 1)
    return mean, inv_std


def test_encode_equals_diffusers_bitwise(exact_pair):
    ours, theirs = exact_pair
    video = torch.rand(1, 3, 9, 32, 48, generator=torch.Generator().manual_seed(0)) * 2 - 1
    mean, inv_std = _norm(CFG)
    with torch.no_grad():
        expected = (theirs.encode(video).latent_dist.mode() - mean) * inv_std     # the pipelines' normalisation
        got = ours.encode(video, CausalCache())
    assert got.shape == (1, 16, 3, 4, 6)
    assert torch.equal(got, expected)


def test_whole_clip_decode_equals_diffusers_bitwise(exact_pair):
    ours, theirs = exact_pair
    latents = torch.randn(1, 16, 4, 4, 6, generator=torch.Generator().manual_seed(1))
    mean, inv_std = _norm(CFG)
    with torch.no_grad():
        expected = theirs.decode(latents / inv_std + mean).sample
        got = ours.decode(latents, CausalCache())
    assert got.shape == (1, 3, 13, 32, 48)
    assert torch.equal(got, expected)


def test_the_cpu_kernels_are_onednns_conv_and_a_plain_norm_and_agree_with_diffusers_to_rounding(vae_pair):
    """The default on the CPU: every causal conv runs oneDNN's convolution (PyTorch's own choice sends these
    small inputs to its im2col fallback) and the RMS norm a plain sum of squares; encode and decode then
    agree with diffusers' to float rounding."""
    from torch.profiler import ProfilerActivity, profile
    ours, theirs = vae_pair
    video = torch.rand(1, 3, 9, 32, 48, generator=torch.Generator().manual_seed(0)) * 2 - 1
    latents = torch.randn(1, 16, 4, 4, 6, generator=torch.Generator().manual_seed(1))
    mean, inv_std = _norm(CFG)
    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU]) as prof:
        got_latents = ours.encode(video, CausalCache())
        got_pixels = ours.decode(latents, CausalCache())
    ops = {e.key: e.count for e in prof.key_averages()}
    assert ops.get("aten::mkldnn_convolution", 0) > 0 and "aten::slow_conv3d_forward" not in ops
    assert "aten::linalg_vector_norm" not in ops
    with torch.no_grad():
        expected_latents = (theirs.encode(video).latent_dist.mode() - mean) * inv_std
        expected_pixels = theirs.decode(latents / inv_std + mean).sample
    assert not torch.equal(got_latents, expected_latents)          # other kernels: not bitwise
    torch.testing.assert_close(got_latents, expected_latents, rtol=0, atol=1e-4)
    torch.testing.assert_close(got_pixels, expected_pixels, rtol=0, atol=1e-4)


@pytest.mark.parametrize("split,frame_counts", [((1, 3, 3, 3), [1, 12, 12, 12]), ((3, 3, 3, 3), [9, 12, 12, 12])])
def test_streaming_decode_is_bit_identical_to_whole_clip(vae_pair, split, frame_counts):
    ours, _ = vae_pair
    latents = torch.randn(1, 16, sum(split), 4, 6, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        whole = ours.decode(latents, CausalCache())
        cache, parts, start = CausalCache(), [], 0
        for n in split:
            parts.append(ours.decode(latents[:, :, start:start + n], cache))
            start += n
    assert [p.shape[2] for p in parts] == frame_counts
    assert torch.equal(torch.cat(parts, dim=2), whole)


def test_save_load_round_trip_and_diffusers_reads_our_folder(tmp_path, vae_pair):
    ours, _ = vae_pair
    folder = save_vae(ours, tmp_path / "vae")
    loaded = load_vae(folder)
    for k, v in ours.state_dict().items():
        assert torch.equal(v, loaded.state_dict()[k]), k
    theirs = diffusers.AutoencoderKLWan.from_pretrained(folder)        # the layout is diffusers' own
    assert theirs.config.base_dim == 8 and list(theirs.config.latents_std) == list(CFG.latents_std)


def test_strict_vae_loading(tmp_path, vae_pair):
    from safetensors.torch import load_file, save_file
    ours, _ = vae_pair
    folder = save_vae(ours, tmp_path / "vae")
    state = load_file(folder / "diffusion_pytorch_model.safetensors")
    del state["decoder.conv_out.bias"]
    state["decoder.extra.weight"] = torch.zeros(1)
    save_file(state, folder / "diffusion_pytorch_model.safetensors")
    with pytest.raises(WeightsError, match=r"missing key 'decoder\.conv_out\.bias'"):
        load_vae(folder)
    state["decoder.conv_out.bias"] = torch.zeros(3)
    save_file(state, folder / "diffusion_pytorch_model.safetensors")
    with pytest.raises(WeightsError, match=r"unknown key 'decoder\.extra\.weight'"):
        load_vae(folder)


def test_bad_vae_config_is_refused():
    from lingbot.config import ConfigError
    with pytest.raises(ConfigError, match="is_residual=True is not supported"):
        VAEConfig.from_json_dict({**CFG.to_json_dict(), "is_residual": True})


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_uint8_pixels_equal_diffusers_video_processor(dtype):
    from diffusers.video_processor import VideoProcessor
    g = torch.Generator().manual_seed(0)
    video = (torch.randn(3, 5, 16, 24, generator=g) * 0.8).to(dtype)                  # [C, F, H, W]
    video[0, 0, 0, :4] = torch.tensor([-1.5, 1.5, 0.0, -1.0]).to(dtype)                   # clamps and exact ends
    # every representable value on a fine grid, to hit rounding ties
    video[1, 1] = torch.linspace(-1.01, 1.01, 16 * 24).view(16, 24).to(dtype)
    expected = VideoProcessor().postprocess_video(video[None], output_type="np")[0]     # [F, H, W, C] float
    expected = (expected * 255).round().astype("uint8")
    got = frames_to_uint8(video)
    assert got.dtype == torch.uint8 and got.shape == (5, 16, 24, 3)
    assert np.array_equal(got.numpy(), expected)


def test_causal_cache_state_round_trip_continues_the_decode_bitwise(vae_pair):
    ours, _ = vae_pair
    latents = torch.randn(1, 16, 5, 4, 6, generator=torch.Generator().manual_seed(4))
    copied = []

    def host(t):                                  # a snapshot's copy to the host, counted
        copied.append(t.to("cpu", copy=True))
        return copied[-1]
    with torch.no_grad():
        cache = CausalCache()
        ours.decode(latents[:, :, :3], cache)
        state = cache.state_dict(copy=host)
        assert state.keys() == cache.entries.keys() and len(copied) == len(state) > 0
        assert all(state[k] is not v and torch.equal(state[k], v) for k, v in cache.entries.items())
        restored = CausalCache()
        restored.load_state(state, "cpu")
        assert restored.bitwise_equal(cache) and restored.state_dict().keys() == state.keys()
        assert torch.equal(ours.decode(latents[:, :, 3:], restored), ours.decode(latents[:, :, 3:], cache))
