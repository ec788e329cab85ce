"""Shared fixtures: the tiny preset, its random model and text encoder (built once per test session)."""
import pytest
import torch

from lingbot.config import get_preset
from lingbot.io.weights import build_random_text_encoder, build_random_transformer

torch.set_num_threads(2)


@pytest.fixture(scope="session")
def tiny():
    return get_preset("tiny")


@pytest.fixture(scope="session")
def tiny_model(tiny):
    return build_random_transformer(tiny.transformer, tiny.weights_seed)


@pytest.fixture(scope="session")
def tiny_text_encoder(tiny):
    return build_random_text_encoder(tiny.text, tiny.weights_seed)


@pytest.fixture(scope="session")
def tiny_runner(tiny, tiny_model, tiny_text_encoder):
    from lingbot.runtime.dit_runner import DiTRunner
    return DiTRunner(tiny, tiny_model, tiny_text_encoder)


def random_condition(preset, frames=60, seed=1):
    """Normalised image latents for LatentCondition (stand-in for nothing: any latent is a valid input)."""
    lh, lw = preset.latent_hw
    return torch.randn(16, frames, lh, lw, generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="session")
def tiny_vae(tiny):
    from lingbot.io.weights import build_random_vae
    return build_random_vae(tiny.vae, tiny.weights_seed)


@pytest.fixture(scope="session")
def tiny_pipeline(tiny_runner, tiny_vae):
    from lingbot.runtime.pipeline import WorldPipeline
    return WorldPipeline(tiny_runner, tiny_vae, skip_fixed_point=True)


def random_image(preset, seed=0):
    """A first frame in [-1, 1] of the preset's size."""
    g = torch.Generator().manual_seed(seed)
    return torch.rand(3, preset.height, preset.width, generator=g) * 2 - 1
