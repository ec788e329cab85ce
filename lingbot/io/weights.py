"""Model folders in the diffusers layout of the real checkpoint: read, check, load, write, and random.

A folder holds `transformer/` (config.json + safetensors shards, with
`diffusion_pytorch_model.safetensors.index.json` when sharded), `vae/` (config.json + one safetensors
file), `text_encoder/` + `tokenizer/` (transformers' layout) and `model_index.json`. Keys on disk equal
our parameter names. Loading is strict: a missing, unknown or mis-shaped key is an error that names it.
Load order: build on the meta device, load with assign=True, then cast and move.

`write_random_checkpoint` writes any preset with seeded random weights in the same layout, so tests and
the embedded default load the tiny model from disk exactly as real weights are loaded. Nothing here
downloads anything.
"""
from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Optional

import torch
from safetensors.torch import save_file
from torch import nn

from ..config import ConfigError, Preset, TAEConfig, TextEncoderConfig, TransformerConfig, VAEConfig, parse_dtype
from ..models.dit import CausalWanModel
from ..models.tae import TinyDecoder, config_from_shapes
from ..models.text_encoder import TextEncoder
from ..models.vae import WanVAE

log = logging.getLogger(__name__)

WEIGHTS_NAME = "diffusion_pytorch_model.safetensors"
INDEX_NAME = "diffusion_pytorch_model.safetensors.index.json"


class WeightsError(ValueError):
    """A checkpoint folder does not match the model; the message names the offending key or file."""


# ---------------------------------------------------------------------------------------------------
# transformer/
# ---------------------------------------------------------------------------------------------------

def build_random_transformer(config: TransformerConfig, seed: int, dtype: torch.dtype = torch.float32,
                             device="cpu") -> CausalWanModel:
    """The model with seeded random weights, made on `device` in `dtype` (no host copy, no fp32 detour: at
    the real 14B dims this is how a GPU gets a model without a checkpoint). The init follows PyTorch's
    defaults: Linear / Conv weights and biases U(-1/sqrt(fan_in), 1/sqrt(fan_in)), norm weights 1 and
    biases 0, modulation tables N(0, 1/dim). The global RNG is not touched."""
    with torch.device("meta"):
        model = CausalWanModel(config)
    model = model.to(dtype=dtype).to_empty(device=device)
    generator = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for module in model.modules():
            for name, param in module.named_parameters(recurse=False):
                if isinstance(module, (nn.Linear, nn.Conv3d)):
                    bound = 1.0 / math.sqrt(module.weight[0].numel())
                    param.uniform_(-bound, bound, generator=generator)
                elif name == "modulation":
                    param.normal_(0.0, config.dim ** -0.5, generator=generator)
                else:
                    param.fill_(1.0 if name == "weight" else 0.0)          # RMSNorm / affine LayerNorm
    return model.eval().requires_grad_(False)


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


def checkpoint_files(folder: str | Path) -> dict[str, Path]:
    """Which file holds each tensor of a diffusers-layout folder (sharded with an index, or one file).
    Reads the safetensors headers only; nothing is loaded."""
    from safetensors import safe_open
    folder = Path(folder)
    if (folder / INDEX_NAME).exists():
        weight_map = json.loads((folder / INDEX_NAME).read_text())["weight_map"]
        files: dict[str, Path] = {}
        for filename in sorted(set(weight_map.values())):
            if not (folder / filename).exists():
                raise WeightsError(f"{folder / filename} is listed in {INDEX_NAME} but missing")
            with safe_open(folder / filename, framework="pt") as f:
                keys = set(f.keys())
            listed = {k for k, f in weight_map.items() if f == filename}
            if keys != listed:
                extra = sorted(keys - listed) or sorted(listed - keys)
                raise WeightsError(f"{filename} does not match {INDEX_NAME} for keys {extra[:5]}")
            files.update(dict.fromkeys(keys, folder / filename))
        return files
    if (folder / WEIGHTS_NAME).exists():
        with safe_open(folder / WEIGHTS_NAME, framework="pt") as f:
            return dict.fromkeys(f.keys(), folder / WEIGHTS_NAME)
    raise WeightsError(f"no {INDEX_NAME} or {WEIGHTS_NAME} in {folder}")


def _grouped(files: dict[str, Path]) -> dict[Path, list[str]]:
    by_file: dict[Path, list[str]] = {}
    for key, path in files.items():
        by_file.setdefault(path, []).append(key)
    return by_file


def read_state_dict(folder: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of a diffusers-layout folder, on the CPU, as stored (for tools and tests)."""
    from safetensors import safe_open
    state = {}
    for path, keys in _grouped(checkpoint_files(folder)).items():
        with safe_open(path, framework="pt") as f:
            state.update({k: f.get_tensor(k) for k in keys})
    return state


def load_state_dict(folder: str | Path, expected: dict, dtype: torch.dtype, device="cpu") -> dict:
    """A checkpoint's tensors for a model whose state dict (on meta) is `expected`: strictly matched by name
    and shape before anything is read (a WeightsError names the first bad key), then read tensor by tensor
    straight to `device` and cast there, so the host never holds the checkpoint (nor an fp32 copy of it)."""
    from safetensors import safe_open
    files = checkpoint_files(folder)
    missing = sorted(set(expected) - set(files))
    unknown = sorted(set(files) - set(expected))
    if missing:
        raise WeightsError(f"checkpoint {folder} is missing key {missing[0]!r}"
                           + (f" (and {len(missing) - 1} more: {missing[1:6]})" if len(missing) > 1 else ""))
    if unknown:
        raise WeightsError(f"checkpoint {folder} has unknown key {unknown[0]!r}"
                           + (f" (and {len(unknown) - 1} more: {unknown[1:6]})" if len(unknown) > 1 else ""))
    device = torch.device(device)
    # safetensors reads straight into CPU or CUDA memory; other devices get each tensor through the host
    read_on = str(device) if device.type in ("cpu", "cuda") else "cpu"
    by_file = _grouped(files)
    for path, keys in by_file.items():                       # every shape first: fail before reading GiBs
        with safe_open(path, framework="pt") as f:
            for name in keys:
                shape = tuple(f.get_slice(name).get_shape())
                if shape != tuple(expected[name].shape):
                    raise WeightsError(f"key {name!r} has shape {list(shape)} in {folder}, "
                                       f"the config expects {list(expected[name].shape)}")
    state = {}
    for path, keys in by_file.items():
        with safe_open(path, framework="pt", device=read_on) as f:
            for name in keys:
                state[name] = f.get_tensor(name).to(device=device, dtype=dtype)
    return state


def load_transformer(folder: str | Path, dtype: torch.dtype = torch.bfloat16, device="cpu") -> CausalWanModel:
    """Strictly load `folder` (a diffusers-format transformer/ directory) into our model."""
    folder = Path(folder)
    if not (folder / "config.json").exists():
        raise WeightsError(f"{folder / 'config.json'} is missing: is {folder} a transformer/ folder?")
    config = TransformerConfig.from_json_file(folder / "config.json")
    with torch.device("meta"):
        model = CausalWanModel(config)
    state = load_state_dict(folder, model.state_dict(), dtype, device)
    model.load_state_dict(state, strict=True, assign=True)
    log.info("loaded %d tensors from %s to %s", len(state), folder, device)
    return model.eval().requires_grad_(False)


# ---------------------------------------------------------------------------------------------------
# vae/
# ---------------------------------------------------------------------------------------------------
def build_random_vae(cfg: VAEConfig, seed: int, dtype: torch.dtype = torch.float32) -> WanVAE:
    with torch.random.fork_rng(devices=[]):          # seeded, and the global RNG is left as it was
        torch.manual_seed(seed)
        vae = WanVAE(cfg)
        # RMS-norm gammas start at 1 (PyTorch init); randomise them so tests see the real weight paths
        for name, p in vae.named_parameters():
            if name.endswith("gamma"):
                p.data.uniform_(0.5, 1.5)
    return vae.to(dtype).eval().requires_grad_(False)


def save_vae(vae: WanVAE, folder: str | Path) -> Path:
    from safetensors.torch import save_file
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(vae.config.to_json_dict(), indent=2))
    save_file({k: v.contiguous() for k, v in vae.state_dict().items()}, folder / WEIGHTS_NAME)
    return folder


def load_vae(folder: str | Path, dtype: torch.dtype = torch.float32, device="cpu") -> WanVAE:
    """Strictly load a diffusers-format `vae/` folder: every key must match by name and shape."""
    folder = Path(folder)
    if not (folder / "config.json").exists():
        raise WeightsError(f"{folder / 'config.json'} is missing: is {folder} a vae/ folder?")
    cfg = VAEConfig.from_json_dict(json.loads((folder / "config.json").read_text()))
    with torch.device("meta"):
        vae = WanVAE(cfg)
    state = load_state_dict(folder, vae.state_dict(), dtype, device)
    vae.load_state_dict(state, strict=True, assign=True)
    # non-persistent buffers were created on meta: rebuild them on the target device
    vae.latents_mean = torch.tensor(cfg.latents_mean, device=device).view(1, -1, 1, 1, 1)
    vae.latents_inv_std = 1.0 / torch.tensor(cfg.latents_std, device=device).view(1, -1, 1, 1, 1)
    return vae.eval().requires_grad_(False)


# ---------------------------------------------------------------------------------------------------
# the tiny decoder: one file, taew2_1.pth or safetensors/taew2_1.safetensors of madebyollin/taehv
# ---------------------------------------------------------------------------------------------------
TAE_SUFFIXES = (".pth", ".pt", ".safetensors")


def build_random_tae(cfg: TAEConfig, seed: int, dtype: torch.dtype = torch.float32, device="cpu") -> TinyDecoder:
    """The tiny decoder with seeded random weights (the global RNG is not touched). PyTorch's default init
    makes the signal vanish through its ReLU stack (the frames come out flat), so convs get He-uniform
    bounds sqrt(6 / fan_in), the last conv of each memory block's branch a quarter of it (the residual sum
    stays bounded), the RGB conv 0.1 / sqrt(fan_in) with its bias at 0.5: frames with texture, mostly inside
    [0, 1], which the streaming and dtype tests need to mean anything."""
    with torch.device("meta"):
        model = TinyDecoder(cfg)
    model = model.to_empty(device="cpu")                 # every tensor is drawn below, from `seed` alone
    rgb = f"decoder.{len(model.decoder) - 1}."
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.ndim == 1:
                param.uniform_(-0.02, 0.02, generator=generator)
                if name.startswith(rgb):
                    param.add_(0.5)
                continue
            fan_in = param[0].numel()
            bound = 0.1 / math.sqrt(fan_in) if name.startswith(rgb) else math.sqrt(6.0 / fan_in)
            param.uniform_(-bound, bound, generator=generator)
            if name.endswith("conv.4.weight"):
                param.mul_(0.25)
    return model.to(device=device, dtype=dtype).eval().requires_grad_(False)


def read_tae_file(path: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of a tiny-autoencoder file, on the CPU: a `.pth` through torch.load(weights_only=True)
    (no pickled code runs), or a `.safetensors`."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"tiny decoder weights {path} do not exist (taew2_1.pth or taew2_1.safetensors "
                                "from github.com/madebyollin/taehv)")
    if path.suffix not in TAE_SUFFIXES:
        raise WeightsError(f"tiny decoder weights {path}: expected one of {list(TAE_SUFFIXES)}")
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file
        return load_file(path)
    state = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise WeightsError(f"{path} is not a state dict of tensors")
    return state


def tae_config_of(state: dict[str, torch.Tensor]) -> TAEConfig:
    """The widths of the tiny decoder a file's tensors hold (models/tae.py, config_from_shapes); the published
    ones where the file lacks a weight they are read from (loading it then names that key)."""
    return config_from_shapes({k: v.shape for k, v in state.items()}) or TAEConfig()


def read_tae_config(path: str | Path) -> TAEConfig:
    """The widths of the tiny decoder in a TAEHV-family file: the published taew2_1's, or a random preset's."""
    return tae_config_of(read_tae_file(path))


def load_tae(path: str | Path, cfg: Optional[TAEConfig] = None, dtype: torch.dtype = torch.float32,
             device="cpu") -> TinyDecoder:
    """Strictly load the tiny decoder from a TAEHV-family file. The file holds the whole autoencoder: its
    `decoder.*` keys are our module names as they are; its `encoder.*` keys are set aside (the engine never
    encodes with it). `cfg`: the widths the file must have; None: the file's own, read from its tensor
    shapes (the published file and a random preset's load alike). Any other key, a missing decoder key or a
    shape that differs is a WeightsError naming the key."""
    state = read_tae_file(path)
    with torch.device("meta"):
        model = TinyDecoder(cfg or tae_config_of(state))
    expected = model.state_dict()
    decoder = {k: v for k, v in state.items() if not k.startswith("encoder.")}
    missing = sorted(set(expected) - set(decoder))
    unknown = sorted(set(decoder) - set(expected))
    for kind, keys in (("is missing", missing), ("has unknown", unknown)):
        if keys:
            raise WeightsError(f"tiny decoder file {path} {kind} key {keys[0]!r}"
                               + (f" (and {len(keys) - 1} more: {keys[1:6]})" if len(keys) > 1 else ""))
    for name, tensor in decoder.items():
        if tensor.shape != expected[name].shape:
            raise WeightsError(f"key {name!r} has shape {list(tensor.shape)} in {path}, the tiny decoder "
                               f"expects {list(expected[name].shape)}")
    model.load_state_dict({k: v.to(device=device, dtype=dtype) for k, v in decoder.items()}, strict=True,
                          assign=True)
    log.info("loaded the tiny decoder (%d tensors, %d encoder tensors set aside) from %s", len(decoder),
             len(state) - len(decoder), path)
    return model.eval().requires_grad_(False)


# ---------------------------------------------------------------------------------------------------
# text_encoder/ and tokenizer/
# ---------------------------------------------------------------------------------------------------
PAD, EOS, UNK = "<pad>", "</s>", "<unk>"


def load_text_encoder(root: str | Path, device="cpu", dtype: torch.dtype | None = None,
                      max_length: int = 512) -> TextEncoder:
    """Load `root/tokenizer` and `root/text_encoder` (the diffusers layout) from local disk only, the weights
    in `dtype` (None: as stored). `from_pretrained(dtype=...)` is the spelling transformers honours from 4.56
    on (pyproject's floor); an older one ignores it and loads float32 (UMT5-XXL: about 22.7 GB instead of
    11), which is cast here with a warning rather than served at twice the memory."""
    import transformers
    from transformers import AutoTokenizer, UMT5EncoderModel
    root = Path(root)
    for part in ("tokenizer", "text_encoder"):
        if not (root / part).is_dir():
            raise FileNotFoundError(f"{root / part} is missing: a model folder needs tokenizer/ and text_encoder/")
    tokenizer = AutoTokenizer.from_pretrained(root / "tokenizer", local_files_only=True)
    kwargs = {"local_files_only": True}
    if dtype is not None:
        kwargs["dtype"] = dtype
    model = UMT5EncoderModel.from_pretrained(root / "text_encoder", **kwargs)
    if dtype is not None and model.dtype != dtype:
        log.warning("transformers %s loaded %s/text_encoder in %s, not the %s asked for (upgrade: pip install "
                    "'transformers>=4.56'); casting it", transformers.__version__, root, model.dtype, dtype)
        model = model.to(dtype)
    return TextEncoder(tokenizer, model.to(device), max_length)


def build_byte_tokenizer(max_length: int = 512):
    """A T5-style tokenizer over raw bytes (<pad>=0, </s>=1, <unk>=2, bytes 3..258), EOS appended."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    byte_chars = sorted(alphabet)
    vocab = {PAD: 0, EOS: 1, UNK: 2}
    for i, ch in enumerate(byte_chars):
        vocab[ch] = 3 + i
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.TemplateProcessing(single=f"$A {EOS}", special_tokens=[(EOS, 1)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=PAD, eos_token=EOS, unk_token=UNK,
                                   model_max_length=max_length)


def build_random_text_encoder(config: TextEncoderConfig, seed: int, dtype: torch.dtype = torch.float32,
                              device="cpu") -> TextEncoder:
    """A UMT5 encoder of the given dims with seeded random weights and the byte tokenizer, made on `device`
    (no host copy at real dims) and then cast to `dtype`: the init runs in float32, so on the CPU the weights
    are those of a written checkpoint (write_random_checkpoint, float32) loaded in `dtype`. The global RNGs
    are left as they were."""
    from transformers import UMT5Config, UMT5EncoderModel
    umt5 = UMT5Config(vocab_size=config.vocab_size, d_model=config.d_model, d_kv=config.d_kv, d_ff=config.d_ff,
                      num_layers=config.num_layers, num_heads=config.num_heads, feed_forward_proj="gated-gelu",
                      relative_attention_num_buckets=32, relative_attention_max_distance=128,
                      pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)
    device = torch.device(device)
    forked = [] if device.type == "cpu" else [device]          # the device's RNG too, where the init draws
    with torch.random.fork_rng(devices=forked, device_type="cuda" if not forked else device.type), device:
        torch.manual_seed(seed)
        model = UMT5EncoderModel(umt5)
    return TextEncoder(build_byte_tokenizer(config.max_length), model.to(dtype), config.max_length)


def save_text_encoder(encoder: TextEncoder, root: str | Path) -> None:
    """Write `root/tokenizer` and `root/text_encoder` in the layout of the real checkpoint."""
    root = Path(root)
    encoder.tokenizer.save_pretrained(root / "tokenizer")
    encoder.model.save_pretrained(root / "text_encoder", safe_serialization=True)


# ---------------------------------------------------------------------------------------------------
# scheduler/
# ---------------------------------------------------------------------------------------------------
SCHEDULER_CONFIG = "scheduler/scheduler_config.json"


def read_flow_shift(root: str | Path) -> Optional[float]:
    """The flow shift of a checkpoint folder's scheduler config (`shift` or `flow_shift`), or None."""
    path = Path(root) / SCHEDULER_CONFIG
    if not path.exists():
        return None
    config = json.loads(path.read_text())
    value = config.get("shift", config.get("flow_shift"))
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
        raise WeightsError(f"{path}: shift {value!r} must be a positive number")
    return float(value)


# ---------------------------------------------------------------------------------------------------
# the whole folder
# ---------------------------------------------------------------------------------------------------
def write_random_checkpoint(preset: Preset, folder: str | Path, seed: Optional[int] = None,
                            max_shard_bytes: int = 5 * 2 ** 30) -> Path:
    """Write `preset` with random weights (seed: the preset's weights_seed unless given) to `folder`."""
    seed = preset.weights_seed if seed is None else seed
    if seed is None:
        raise ConfigError(f"preset {preset.name} has real weights; pass a seed to write random ones")
    folder = Path(folder)
    model = build_random_transformer(preset.transformer, seed, preset.torch_dtype)
    save_transformer(model, folder / "transformer", max_shard_bytes)
    save_vae(build_random_vae(preset.vae, seed, parse_dtype(preset.vae_dtype)), folder / "vae")
    save_text_encoder(build_random_text_encoder(preset.text, seed), folder)
    (folder / "scheduler").mkdir(parents=True, exist_ok=True)
    (folder / SCHEDULER_CONFIG).write_text(json.dumps(
        {"_class_name": "FlowMatchEulerDiscreteScheduler", "shift": preset.sampler.shift,
         "num_train_timesteps": preset.sampler.num_train_timesteps}, indent=2))
    index = {"_class_name": "LingBotWorldPipeline", "lingbot_preset": preset.name,
             "transformer": ["lingbot", "CausalWanModel"], "vae": ["diffusers", "AutoencoderKLWan"],
             "text_encoder": ["transformers", "UMT5EncoderModel"],
             "tokenizer": ["transformers", "PreTrainedTokenizerFast"],
             "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"]}
    (folder / "model_index.json").write_text(json.dumps(index, indent=2))
    log.info("wrote random %s checkpoint (seed %d) to %s", preset.name, seed, folder)
    return folder
