"""Typed configuration: the transformer's config.json, the sampler, the text encoder and the presets.

Field names of `TransformerConfig` mirror the 20 keys of the checkpoint's `transformer/config.json`
(docs/architecture.md, "The model"), so a real config loads by name and a written one round-trips.
The chunk geometry (latent and pixel frames per chunk, frames for N chunks) is derived here, from a
preset, and nowhere else.
"""
from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Optional

import torch


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the value and the fix."""


@dataclass(frozen=True)
class TransformerConfig:
    """The 20 keys of `transformer/config.json` (defaults: the real 14B checkpoint)."""

    patch_size: tuple[int, int, int] = (1, 2, 2)
    num_attention_heads: int = 40
    attention_head_dim: int = 128
    in_channels: int = 36
    out_channels: int = 16
    text_dim: int = 4096
    freq_dim: int = 256
    ffn_dim: int = 13824
    num_layers: int = 40
    cross_attn_norm: bool = True
    eps: float = 1e-6
    image_dim: Optional[int] = None
    added_kv_proj_dim: Optional[int] = None
    pos_embed_seq_len: Optional[int] = None
    rope_max_seq_len: int = 1024
    qk_norm: str = "rms_norm_across_heads"
    sink_size: int = 9
    num_frames_per_block: int = 3
    sliding_window_num_frames: int = 18
    local_attn_size: int = -1

    def __post_init__(self):
        object.__setattr__(self, "patch_size", tuple(self.patch_size))
        if self.patch_size != (1, 2, 2):
            raise ConfigError(f"patch_size {list(self.patch_size)} is not supported; LingBot-World uses [1, 2, 2]")
        if self.attention_head_dim % 2:
            raise ConfigError(f"attention_head_dim {self.attention_head_dim} must be even (RoPE rotates pairs)")
        if self.qk_norm != "rms_norm_across_heads":
            raise ConfigError(f"qk_norm {self.qk_norm!r} is not supported; expected 'rms_norm_across_heads'")
        if self.image_dim is not None or self.added_kv_proj_dim is not None:
            raise ConfigError("image_dim / added_kv_proj_dim must be null: LingBot-World has no CLIP image branch")
        if self.sink_size % self.num_frames_per_block or self.sliding_window_num_frames % self.num_frames_per_block:
            raise ConfigError(
                f"sink_size {self.sink_size} and sliding_window_num_frames {self.sliding_window_num_frames} "
                f"must be multiples of num_frames_per_block {self.num_frames_per_block}")
        if not self.sink_size < self.sliding_window_num_frames - self.num_frames_per_block + 1:
            raise ConfigError("the window must hold the sink, at least one history chunk and the current chunk")
        if self.in_channels != 2 * self.out_channels + 4:
            raise ConfigError(f"in_channels {self.in_channels} must be 2 * out_channels + 4 (x_t, mask, image latent)")

    # ---- derived sizes -------------------------------------------------------------------------
    @property
    def dim(self) -> int:
        return self.num_attention_heads * self.attention_head_dim

    @property
    def rope_axes(self) -> tuple[int, int, int]:
        """Head-dim split for (time, height, width): 128 -> (44, 42, 42)."""
        d = self.attention_head_dim
        hw = 2 * (d // 6)
        return d - 2 * hw, hw, hw

    @property
    def camera_in_features(self) -> int:
        """6 ray channels x 8x8 pixel unshuffle x the 1x2x2 patch = 1536."""
        return 6 * 64 * math.prod(self.patch_size)

    @property
    def sink_chunks(self) -> int:
        return self.sink_size // self.num_frames_per_block

    @property
    def window_chunks(self) -> int:
        return self.sliding_window_num_frames // self.num_frames_per_block

    # ---- config.json ---------------------------------------------------------------------------
    def to_json_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["patch_size"] = list(self.patch_size)
        return {"_class_name": "WanCausalCameraTransformer3DModel", **d}

    @classmethod
    def from_json_dict(cls, d: dict) -> TransformerConfig:
        keys = {f.name for f in dataclasses.fields(cls)}
        given = {k: v for k, v in d.items() if not k.startswith("_")}
        unknown = sorted(set(given) - keys)
        if unknown:
            raise ConfigError(f"transformer config.json has unknown keys {unknown}; "
                              f"expected the 20 keys of {sorted(keys)}")
        missing = sorted(keys - set(given))
        if missing:
            raise ConfigError(f"transformer config.json is missing keys {missing}")
        return cls(**given)

    @classmethod
    def from_json_file(cls, path: str | Path) -> TransformerConfig:
        with open(path) as f:
            return cls.from_json_dict(json.load(f))


@dataclass(frozen=True)
class SamplerConfig:
    """The few-step DMD sampler: raw timesteps on the 1000-step scale and the flow shift."""

    timesteps: tuple[float, ...] = (1000.0, 750.0, 500.0, 250.0)
    shift: float = 5.0
    num_train_timesteps: int = 1000

    def sigmas(self) -> list[float]:
        """sigma = shift*s / (1 - s + shift*s), s = t / 1000 (computed in float64)."""
        out = []
        for t in self.timesteps:
            s = t / self.num_train_timesteps
            out.append(self.shift * s / (1.0 - s + self.shift * s))
        return out

    def warped_timesteps(self) -> list[float]:
        """What the DiT sees: t' = sigma * 1000."""
        return [s * self.num_train_timesteps for s in self.sigmas()]


@dataclass(frozen=True)
class TextEncoderConfig:
    """UMT5 encoder dims, used to build random weights (a real folder brings its own config.json)."""

    max_length: int
    vocab_size: int
    d_model: int
    d_kv: int
    d_ff: int
    num_layers: int
    num_heads: int


WAN21_LATENTS_MEAN = (-0.7571, -0.7089, -0.9113, 0.1075, -0.1745, 0.9653, -0.1517, 1.5508,
                      0.4134, -0.0715, 0.5517, -0.3632, -0.1922, -0.9497, 0.2503, -0.2921)
WAN21_LATENTS_STD = (2.8184, 1.4541, 2.3275, 2.6558, 1.2196, 1.7708, 2.6052, 2.0743,
                     3.2687, 2.1526, 2.8652, 1.5579, 1.6382, 1.1253, 2.8251, 1.916)


@dataclass(frozen=True)
class VAEConfig:
    """The keys of diffusers' AutoencoderKLWan config.json that shape the Wan 2.1 VAE."""
    base_dim: int = 96
    z_dim: int = 16
    dim_mult: tuple[int, ...] = (1, 2, 4, 4)
    num_res_blocks: int = 2
    attn_scales: tuple[float, ...] = ()
    temperal_downsample: tuple[bool, ...] = (False, True, True)
    dropout: float = 0.0
    latents_mean: tuple[float, ...] = WAN21_LATENTS_MEAN
    latents_std: tuple[float, ...] = WAN21_LATENTS_STD

    # keys diffusers writes that must keep their Wan 2.1 values here
    _FIXED: ClassVar[dict] = {"decoder_base_dim": None, "is_residual": False, "in_channels": 3, "out_channels": 3,
                              "patch_size": None, "scale_factor_temporal": 4, "scale_factor_spatial": 8}

    def __post_init__(self):
        for name in ("dim_mult", "attn_scales", "temperal_downsample", "latents_mean", "latents_std"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        if self.attn_scales:
            raise ConfigError(f"attn_scales {list(self.attn_scales)} is not supported (the Wan 2.1 VAE has none)")
        if len(self.latents_mean) != self.z_dim or len(self.latents_std) != self.z_dim:
            raise ConfigError(f"latents_mean/std need {self.z_dim} values each")

    @property
    def spatial_stride(self) -> int:
        """Pixels per latent pixel along height and width: 2 per down/up-sampling stage (8)."""
        return 2 ** (len(self.dim_mult) - 1)

    @property
    def temporal_stride(self) -> int:
        """Pixel frames per latent frame after the first (4); a clip's first latent frame gives 1."""
        return 2 ** sum(self.temperal_downsample)

    def to_json_dict(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d = {k: list(v) if isinstance(v, tuple) else v for k, v in d.items()}
        return {"_class_name": "AutoencoderKLWan", **d, **self._FIXED}

    @classmethod
    def from_json_dict(cls, d: dict) -> VAEConfig:
        names = {f.name for f in dataclasses.fields(cls)}
        for key, value in cls._FIXED.items():
            if key in d and d[key] != value:
                raise ConfigError(f"vae config {key}={d[key]!r} is not supported; the Wan 2.1 VAE has {value!r}")
        unknown = sorted(k for k in d if not k.startswith("_") and k not in names and k not in cls._FIXED)
        if unknown:
            raise ConfigError(f"vae config.json has unknown keys {unknown}")
        return cls(**{k: v for k, v in d.items() if k in names})


@dataclass(frozen=True)
class TAEConfig:
    """The tiny autoencoder's decoder (lingbot/models/tae.py): the widths of its conv-in and three stages and
    its latent channels. The defaults are the published `taew2_1` file's; a random-weight preset narrows the
    widths as it narrows the VAE. Time and space strides are fixed (4 and 8, the Wan 2.1 VAE's)."""
    latent_channels: int = 16
    channels: tuple[int, int, int, int] = (256, 128, 64, 64)

    def __post_init__(self):
        object.__setattr__(self, "channels", tuple(self.channels))
        if len(self.channels) != 4 or min(self.channels) < 1:
            raise ConfigError(f"TAE channels {list(self.channels)} must be 4 positive widths")


@dataclass(frozen=True)
class ChunkGeometry:
    """Frames per chunk. A chunk is `latent_frames` latent frames; the VAE gives `temporal_stride` pixel
    frames per latent frame, except the first latent frame of a clip, which gives one. For LingBot-World:
    chunk 0 = 9 pixel frames, every later chunk 12, and N chunks = (3N - 1) * 4 + 1 frames."""
    latent_frames: int
    temporal_stride: int

    def pixel_frames(self, chunk: int) -> int:
        """Pixel frames of chunk `chunk` (0-based)."""
        frames = self.latent_frames * self.temporal_stride
        return frames - self.temporal_stride + 1 if chunk == 0 else frames

    def video_frames(self, chunks: int) -> int:
        """Pixel frames of the first `chunks` chunks."""
        return (self.latent_frames * chunks - 1) * self.temporal_stride + 1

    def chunks_for(self, num_frames: int) -> Optional[int]:
        """The N with video_frames(N) == num_frames, else None."""
        if num_frames < self.video_frames(1) or (num_frames - 1) % self.temporal_stride:
            return None
        latent = (num_frames - 1) // self.temporal_stride + 1
        return latent // self.latent_frames if latent % self.latent_frames == 0 else None

    def describe(self) -> str:
        """The frame-count rule in words, for error messages."""
        n, s = self.latent_frames, self.temporal_stride
        return (f"({n}N - 1) * {s} + 1: {', '.join(str(self.video_frames(k)) for k in (1, 2, 3))}, ... "
                f"for N = 1, 2, 3, ...")


def split_sizes(total: int, parts: int) -> list[int]:
    """How sequence parallelism shares `total` (tokens, heads, latent columns) among `parts` ranks: contiguous,
    as even as possible, the first total % parts ranks one more. The memory budget counts a rank's share by
    it and lingbot/parallel/ shards by it."""
    base, extra = divmod(total, parts)
    return [base + (1 if r < extra else 0) for r in range(parts)]


def split_range(total: int, parts: int, index: int) -> tuple[int, int]:
    """Rank `index`'s [start, end) of `total` split by split_sizes."""
    sizes = split_sizes(total, parts)
    start = sum(sizes[:index])
    return start, start + sizes[index]


@dataclass(frozen=True)
class Preset:
    name: str
    transformer: TransformerConfig
    sampler: SamplerConfig
    text: TextEncoderConfig
    height: int
    width: int
    dtype: str = "bfloat16"
    vae: VAEConfig = VAEConfig()
    vae_dtype: str = "float32"
    weights_seed: Optional[int] = None  # random-weight presets: the seed of their weights
    description: str = ""
    tae: TAEConfig = TAEConfig()        # the tiny decoder (used when a pipeline loads it)

    def __post_init__(self):
        if self.height % 16 or self.width % 16:
            raise ConfigError(f"preset {self.name}: size {self.width}x{self.height} must be divisible by 16")
        if self.tae.latent_channels != self.vae.z_dim:
            raise ConfigError(f"preset {self.name}: the tiny decoder's {self.tae.latent_channels} latent channels "
                              f"must be the VAE's z_dim {self.vae.z_dim}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return parse_dtype(self.dtype)

    @property
    def vae_stride(self) -> tuple[int, int, int]:
        """(time, height, width): pixel frames / pixels per latent frame / latent pixel (4, 8, 8)."""
        return self.vae.temporal_stride, self.vae.spatial_stride, self.vae.spatial_stride

    @property
    def geometry(self) -> ChunkGeometry:
        return ChunkGeometry(self.transformer.num_frames_per_block, self.vae.temporal_stride)

    @property
    def latent_hw(self) -> tuple[int, int]:
        return self.height // self.vae_stride[1], self.width // self.vae_stride[2]

    @property
    def tokens_per_frame(self) -> int:
        h, w = self.latent_hw
        return (h // self.transformer.patch_size[1]) * (w // self.transformer.patch_size[2])


# dtype names a preset, `lingbot generate --dtype` and the serving setting `dtype` accept (short aliases too)
DTYPES: dict[str, torch.dtype] = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16,
                                  "fp16": torch.float16, "float32": torch.float32, "fp32": torch.float32}
DTYPE_NAMES = ("bfloat16", "float16", "float32")        # the canonical names (what a preset holds)


def parse_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ConfigError(f"dtype {name!r} is not one of {sorted(DTYPES)}")
    return DTYPES[name]


# frame decoders a pipeline may load (lingbot/builder.py): the Wan VAE's, and the tiny autoencoder's
DECODERS = ("wan", "tae")


def tae_dtype(device: torch.device | str) -> torch.dtype:
    """The tiny decoder's dtype on `device`: float32 on the CPU, bfloat16 on accelerators. Against float32,
    on random weights at the published file's widths over 8 chunks, bf16 differs by at most 0.026 in [-1, 1]
    (3 uint8 levels), 0.0034 on average (under half a level), with no growth from chunk to chunk: each
    frame sees a bounded past (one frame per memory block), so rounding cannot compound
    (tests/lingbot/models/test_tae.py holds it to 0.05 max, 0.01 mean)."""
    return torch.float32 if torch.device(device).type == "cpu" else torch.bfloat16


def with_dtype(preset: Preset, dtype: Optional[str | torch.dtype]) -> Preset:
    """The preset with its DiT dtype replaced (None: unchanged). The DiT's weights, its K/V window and the
    text encoder take this dtype; the DiT's residual stream, modulation and time embedding stay float32
    (lingbot/models/dit.py). The VAE (condition encoder and decoder) keeps the preset's own `vae_dtype`,
    float32 in every preset: it is configured apart from the DiT, so a bf16 run on the CPU runs the VAE
    exactly as a GPU run of the real preset does. The preset keeps its name (the override changes numbers,
    not the model); the dtype is stored by its canonical name ("bf16" -> "bfloat16"), so the budget and the
    model facts read it as they read any preset's."""
    if dtype is None:
        return preset
    if isinstance(dtype, torch.dtype):
        names = {v: k for k, v in DTYPES.items() if k in DTYPE_NAMES}
        if dtype not in names:
            raise ConfigError(f"dtype {dtype} is not one of {list(DTYPE_NAMES)}")
        name = names[dtype]
    else:
        name = next(k for k in DTYPE_NAMES if DTYPES[k] == parse_dtype(dtype))
    return preset if name == preset.dtype else dataclasses.replace(preset, dtype=name)


# umt5-xxl encoder dims (the real text_encoder/config.json overrides these when a folder is loaded)
UMT5_XXL = TextEncoderConfig(max_length=512, vocab_size=256384, d_model=4096, d_kv=64, d_ff=10240, num_layers=24,
                             num_heads=64)
V2_SAMPLER = SamplerConfig(timesteps=(1000.0, 750.0, 500.0, 250.0), shift=5.0)
V1_SAMPLER = SamplerConfig(timesteps=(1000.0, 821.0, 642.0, 321.0), shift=10.0)

PRESETS: dict[str, Preset] = {
    "lingbot-world-v2-14b": Preset(
        name="lingbot-world-v2-14b", transformer=TransformerConfig(), sampler=V2_SAMPLER,
        text=UMT5_XXL, height=480, width=832, dtype="bfloat16",
        description="robbyant/lingbot-world-v2-14b-causal-fast-diffusers (real weights, loaded from disk)"),
    "lingbot-world-fast-v1": Preset(
        name="lingbot-world-fast-v1", transformer=TransformerConfig(), sampler=V1_SAMPLER,
        text=UMT5_XXL, height=480, width=832, dtype="bfloat16",
        description="the v1 causal fast checkpoint: same dims, schedule [1000, 821, 642, 321], shift 10"),
    "tiny": Preset(
        name="tiny",
        transformer=TransformerConfig(num_attention_heads=4, attention_head_dim=32, text_dim=64, freq_dim=256,
                                      ffn_dim=256, num_layers=2),
        sampler=V2_SAMPLER,
        text=TextEncoderConfig(max_length=512, vocab_size=259, d_model=64, d_kv=16, d_ff=128, num_layers=2,
                               num_heads=4),
        vae=VAEConfig(base_dim=8), height=64, width=112, dtype="float32", weights_seed=0,
        # the tiny decoder narrowed as the VAE is (96 -> 8, 1/12): the two decoders' FLOP ratio stays near the
        # real dims' (24x per chunk here, 25x at 480x832; perf/decode_time.py)
        tae=TAEConfig(channels=(21, 11, 5, 5)),
        description="same architecture, small dims, random weights: CPU tests and the embedded default"),
}


def get_preset(name: str) -> Preset:
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
    return PRESETS[name]


# Every LingBot-World preset shares this geometry; a client that does not know the server's preset uses it.
LINGBOT_GEOMETRY = PRESETS["lingbot-world-v2-14b"].geometry
