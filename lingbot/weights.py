"""Transformer weights on disk in the diffusers layout: `transformer/config.json` + safetensors shards
(+ `diffusion_pytorch_model.safetensors.index.json` when sharded), keys = our parameter names.

Loading is strict: a missing, unknown or mis-shaped key is an error that names it. Load order follows
STYLE.md §5: build on the meta device, load with assign=True, then cast and move.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from .config import TransformerConfig
from .model import CausalWanModel

log = logging.getLogger(__name__)

WEIGHTS_NAME = "diffusion_pytorch_model.safetensors"
INDEX_NAME = "diffusion_pytorch_model.safetensors.index.json"


class WeightsError(ValueError):
    """A checkpoint folder does not match the model; the message names the offending key or file."""


def build_random_transformer(config: TransformerConfig, seed: int, dtype: torch.dtype = torch.float32,
                             device="cpu") -> CausalWanModel:
    """The model with seeded random weights (PyTorch's default init), independent of the global RNG."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = CausalWanModel(config)
    return model.to(device=device, dtype=dtype).eval().requires_grad_(False)


def save_transformer(model: CausalWanModel, folder: str | Path, max_shard_bytes: int = 5 * 2 ** 30) -> Path:
    """Write config.json and the state dict as safetensors shards (index written when > 1 shard)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(model.config.to_json_dict(), indent=2))
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in model.state_dict().items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor.detach().contiguous().cpu()
        size += nbytes
    if len(shards) == 1:
        save_file(shards[0], folder / WEIGHTS_NAME)
        return folder
    weight_map, total = {}, 0
    for i, shard in enumerate(shards):
        filename = f"diffusion_pytorch_model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, folder / filename)
        for name, t in shard.items():
            weight_map[name] = filename
            total += t.numel() * t.element_size()
    (folder / INDEX_NAME).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map},
                                                indent=2))
    return folder


def read_state_dict(folder: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of a diffusers-layout folder (sharded with an index, or one file), on the CPU."""
    folder = Path(folder)
    if (folder / INDEX_NAME).exists():
        weight_map = json.loads((folder / INDEX_NAME).read_text())["weight_map"]
        state: dict[str, torch.Tensor] = {}
        for filename in sorted(set(weight_map.values())):
            if not (folder / filename).exists():
                raise WeightsError(f"{folder / filename} is listed in {INDEX_NAME} but missing")
            shard = load_file(folder / filename)
            listed = {k for k, f in weight_map.items() if f == filename}
            if set(shard) != listed:
                extra = sorted(set(shard) - listed) or sorted(listed - set(shard))
                raise WeightsError(f"{filename} does not match {INDEX_NAME} for keys {extra[:5]}")
            state.update(shard)
        return state
    if (folder / WEIGHTS_NAME).exists():
        return load_file(folder / WEIGHTS_NAME)
    raise WeightsError(f"no {INDEX_NAME} or {WEIGHTS_NAME} in {folder}")


def check_state_dict(expected: dict, state: dict, source, dtype: torch.dtype) -> dict:
    """Strict match of a checkpoint's tensors against a model's: a missing, unknown or mis-shaped key is a
    WeightsError naming it. Returns the tensors cast to `dtype`, ready for load_state_dict(assign=True)."""
    missing = sorted(set(expected) - set(state))
    unknown = sorted(set(state) - set(expected))
    if missing:
        raise WeightsError(f"checkpoint {source} is missing key {missing[0]!r}"
                           + (f" (and {len(missing) - 1} more: {missing[1:6]})" if len(missing) > 1 else ""))
    if unknown:
        raise WeightsError(f"checkpoint {source} has unknown key {unknown[0]!r}"
                           + (f" (and {len(unknown) - 1} more: {unknown[1:6]})" if len(unknown) > 1 else ""))
    for name, tensor in state.items():
        if tuple(tensor.shape) != tuple(expected[name].shape):
            raise WeightsError(f"key {name!r} has shape {list(tensor.shape)} in {source}, "
                               f"the config expects {list(expected[name].shape)}")
    return {name: tensor.to(dtype) for name, tensor in state.items()}


def load_transformer(folder: str | Path, dtype: torch.dtype = torch.bfloat16, device="cpu") -> CausalWanModel:
    """Strictly load `folder` (a diffusers-format transformer/ directory) into our model."""
    folder = Path(folder)
    if not (folder / "config.json").exists():
        raise WeightsError(f"{folder / 'config.json'} is missing: is {folder} a transformer/ folder?")
    config = TransformerConfig.from_json_file(folder / "config.json")
    with torch.device("meta"):
        model = CausalWanModel(config)
    state = check_state_dict(model.state_dict(), read_state_dict(folder), folder, dtype)
    model.load_state_dict(state, strict=True, assign=True)
    log.info("loaded %d tensors from %s", len(state), folder)
    return model.to(device).eval().requires_grad_(False)
