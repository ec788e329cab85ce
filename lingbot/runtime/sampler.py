"""The few-step DMD sampler of the causal fast checkpoints (docs/architecture.md, "The sampler").

A chunk is `len(timesteps)` probes and one commit. Probe i sees x_t at the warped timestep t'_i and
predicts the flow v; x0 = x_t - sigma_i * v; the next probe's input is re-noised with fresh noise from
the session's generator: x_t = (1 - sigma_{i+1}) * x0 + sigma_{i+1} * noise. The last probe's x0 is the
chunk's clean latent, which the commit forward (t = 0) writes into the K/V window. Step math in fp32.
"""
from __future__ import annotations

import torch
from torch import Tensor

from ..config import SamplerConfig


class DMDSampler:
    def __init__(self, config: SamplerConfig):
        self.config = config
        self.sigmas = config.sigmas()                      # python floats (float64), one per probe
        self.timesteps = config.warped_timesteps()         # what the DiT sees
        self.commit_timestep = 0.0

    @property
    def num_steps(self) -> int:
        return len(self.sigmas)

    def initial_noise(self, shape: tuple[int, ...], generator: torch.Generator, device) -> Tensor:
        return torch.randn(shape, generator=generator, device=device, dtype=torch.float32)

    def denoise(self, x_t: Tensor, flow: Tensor, step: int) -> Tensor:
        """x0 = x_t - sigma * v, in fp32."""
        return x_t.float() - self.sigmas[step] * flow.float()

    def renoise(self, x0: Tensor, step: int, generator: torch.Generator) -> Tensor:
        """Input of probe `step` (>= 1): (1 - sigma) * x0 + sigma * noise, fresh noise per step."""
        sigma = self.sigmas[step]
        noise = torch.randn(x0.shape, generator=generator, device=x0.device, dtype=torch.float32)
        return (1.0 - sigma) * x0 + sigma * noise
