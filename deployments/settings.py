"""Serving settings: one typed, validated object built from serve_config.yaml's `args` (and the only
place that reads environment variables). Every error names the bad value and the fix.

ServeSettings composes one small frozen dataclass per concern (model, placement, capacity, pace,
continuity, drain, encoding, door, limits, health), each validating its own fields; what spans concerns
(the device against the placement's accelerators) ServeSettings checks. The config stays flat: each field
has one flat key (`drain_lead_s` is `settings.drain.lead_s`), which serve_config.yaml, LINGBOT_<KEY>,
ServeSettings(**flat), to_dict() and `settings.<key>` all use.

    python -m deployments.settings                              # every setting: value, default, meaning
    python -m deployments.settings --config serve_config.yaml   # the values of that config's first app
    python -m deployments.settings --json
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from dataclasses import dataclass, field
from operator import attrgetter
from typing import Any, Optional

from lingbot.config import DTYPES, PRESETS, ConfigError, Preset, get_preset, with_dtype
from lingbot.io.video import H264_ENCODERS, H264Settings
from lingbot.parallel.pixels import DEFAULT_PIXEL_MODE, PIXEL_MODES

ENV_PREFIX = "LINGBOT_"
# Ray's resource for one accelerator of each device kind (NPUs are their own resource, not GPUs)
ACCELERATOR_RESOURCE = {"cuda": "GPU", "npu": "NPU"}


def setting(default: Any, help: str, key: Optional[str] = None):
    """A settings field: its default, what it means, and its flat key where that is not its name."""
    return field(default=default, metadata={"help": help, "key": key})


@dataclass(frozen=True)
class _Group:
    """One concern's settings. Errors name the flat key (what serve_config.yaml and LINGBOT_<KEY> set)."""

    @classmethod
    def key_of(cls, name: str) -> str:
        """The flat key of field `name`."""
        return next(f.metadata.get("key") or f.name for f in dataclasses.fields(cls) if f.name == name)

    def _at_least(self, bound: float, *names: str, strict: bool = False, why: str = ""):
        for name in names:
            value = getattr(self, name)
            if value < bound or (strict and value == bound):
                raise ConfigError(f"{self.key_of(name)} must be {'>' if strict else '>='} {bound:g}{why}, "
                                  f"got {value}")

    def _positive(self, *names: str):
        self._at_least(0, *names, strict=True)


@dataclass(frozen=True)
class ModelSettings(_Group):
    """The checkpoint, the device and the sequence-parallel degree."""
    preset: str = setting("tiny", f"model preset, one of {sorted(PRESETS)} (tiny: random weights, CPU tests)")
    model_path: Optional[str] = setting(None, "the diffusers-format checkpoint folder (every preset but tiny)")
    device: str = setting("cpu", "cpu | cuda | npu")
    dtype: Optional[str] = setting(None, f"the DiT's (and text encoder's) dtype instead of the preset's, one of "
                                         f"{sorted(DTYPES)}; null: the preset's (bfloat16 for the real checkpoints, "
                                         f"float32 for tiny). The VAE keeps the preset's vae_dtype (float32)")
    sp: int = setting(2, "ranks per group (sequence-parallel degree); must divide the preset's attention heads")
    pixel_mode: str = setting(DEFAULT_PIXEL_MODE, f"how a chunk's decoded pixels reach rank 0: {list(PIXEL_MODES)}")
    skip_fixed_point: bool = setting(True, "reuse the condition encoder's latents once its state reaches a fixed point "
                                             "(detected bitwise); false: always run the encoder (the reference path)")
    compile: Optional[bool] = setting(None, "regional torch.compile of the DiT blocks; null: on for cuda and npu, "
                                            "off for cpu")
    cuda_graphs: bool = setting(False, "the compiled regions as CUDA graphs (cuda only; off until the device "
                                       "check measures them faster on the target GPU)")

    def __post_init__(self):
        if self.preset not in PRESETS:
            raise ConfigError(f"preset {self.preset!r} is not one of {sorted(PRESETS)}")
        if self.device not in ("cpu", "cuda", "npu"):
            raise ConfigError(f"device {self.device!r} must be cpu, cuda or npu")
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ConfigError(f"dtype {self.dtype!r} is not one of {sorted(DTYPES)}; null keeps the preset's "
                              f"({PRESETS[self.preset].dtype})")
        if self.sp < 1:
            raise ConfigError(f"sp must be >= 1, got {self.sp}")
        heads = PRESETS[self.preset].transformer.num_attention_heads
        if heads % self.sp:
            raise ConfigError(f"sp {self.sp} does not divide the {heads} attention heads of {self.preset}")
        if self.pixel_mode not in PIXEL_MODES:
            raise ConfigError(f"pixel_mode {self.pixel_mode!r} is not one of {list(PIXEL_MODES)}")
        if self.preset != "tiny" and not self.model_path:
            raise ConfigError(f"preset {self.preset} needs model_path (the diffusers-format checkpoint folder)")
        if self.cuda_graphs and self.device != "cuda":
            raise ConfigError(f"cuda_graphs needs device cuda, not {self.device}")

    @property
    def model_preset(self) -> Preset:
        """The preset as the ranks run it (with the dtype override): what the budget is counted for."""
        return with_dtype(get_preset(self.preset), self.dtype)


@dataclass(frozen=True)
class PlacementSettings(_Group):
    """Ray resources per bundle of a group ([replica] + sp x [rank] + [muxer]) and of the ingress."""
    replica_cpus: float = setting(0.05, "CPUs of a group's replica (the Serve actor that schedules its sessions)")
    rank_cpus: float = setting(0.3, "CPUs per rank")
    rank_devices: float = setting(0.0, "accelerators per rank (GPUs for cuda, NPUs for npu; 1 on accelerators, "
                                       "0 on cpu)")
    muxer_cpus: float = setting(0.1, "CPUs of a group's muxer (encodes and packages the sessions' video)")
    muxer_gpus: float = setting(0.0, "GPUs of the muxer: > 0 lets it see a GPU, so encoder auto can use NVENC "
                                     "(cuda only)")
    ingress_cpus: float = setting(0.05, "CPUs per ingress replica (the WebSocket door)")

    def __post_init__(self):
        self._at_least(0, "replica_cpus", "rank_cpus", "rank_devices", "muxer_cpus", "muxer_gpus", "ingress_cpus")


@dataclass(frozen=True)
class CapacitySettings(_Group):
    """Capacity and autoscaling: sessions per group = min(max_sessions_per_group, what fits per rank: on
    accelerators in the memory measured after warm-up unless memory_budget_gib overrides it, on CPU in
    memory_budget_gib, 1 GiB by default); Serve scales groups between min_groups and max_groups by sessions."""
    max_sessions_per_group: int = setting(2, "sessions one group serves at once, at most")
    memory_budget_gib: Optional[float] = setting(None, "per-rank memory budget for sessions (GiB); null: "
                                                       "measured after warm-up on accelerators, 1 GiB on cpu")
    min_groups: int = setting(1, "groups Serve keeps running (autoscaling, counted in sessions)")
    max_groups: int = setting(2, "groups Serve may run")
    graceful_shutdown_timeout_s: float = setting(600.0, "how long Serve lets a stopping replica's sessions go "
                                                        "on before it kills it")
    admission_wait_s: float = setting(20.0, "how long a new session waits for a free group (the autoscaler) "
                                            "before capacity_exhausted")
    retry_after_s: float = setting(10.0, "the retry_after_s a refused client is told (capacity, key limits)")
    max_ingress_sessions: int = setting(64, "WebSockets one ingress replica holds")

    def __post_init__(self):
        if not 1 <= self.min_groups <= self.max_groups:
            raise ConfigError(f"need 1 <= min_groups ({self.min_groups}) <= max_groups ({self.max_groups})")
        if self.max_sessions_per_group < 1:
            raise ConfigError("max_sessions_per_group must be >= 1")
        if self.memory_budget_gib is not None:
            self._positive("memory_budget_gib")
        self._positive("admission_wait_s")
        self._at_least(0, "graceful_shutdown_timeout_s", "retry_after_s")
        self._at_least(1, "max_ingress_sessions")


@dataclass(frozen=True)
class PacingSettings(_Group):
    """Pacing and delivery: how far each session runs ahead of real time, and how many chunks it has in flight."""
    fps: float = setting(16.0, "frames per second of the sessions' video (real time)")
    mode: str = setting("adaptive", "fixed: always pacing_lead_s ahead; adaptive: a lead learned per session, "
                                    "at most pacing_lead_s", key="pacing")
    lead_s: float = setting(1.5, "how far a session may run ahead of real time (adaptive: at most)",
                            key="pacing_lead_s")
    margin_s: float = setting(0.1, "adaptive: slack kept above the needed lead", key="pacing_margin_s")
    quantile: float = setting(0.9, "adaptive: the share of recent chunks the lead must cover",
                              key="pacing_quantile")
    restart_stale_chunks: bool = setting(False, "a control arriving in a chunk's probes restarts the chunk with "
                                                "the control")
    max_in_flight_chunks: Optional[int] = setting(None, "chunks per session generated but not yet delivered (the "
                                                        "ranks start the next while the last is encoded and sent); "
                                                        "null: 2 on accelerators, 1 on cpu")

    def __post_init__(self):
        if self.mode not in ("fixed", "adaptive"):
            raise ConfigError(f"pacing {self.mode!r} must be fixed or adaptive")
        if not 0 < self.quantile <= 1 or self.margin_s < 0:
            raise ConfigError(f"pacing_quantile must be in (0, 1] and pacing_margin_s >= 0, got "
                              f"{self.quantile} and {self.margin_s}")
        self._positive("fps", "lead_s")
        if self.max_in_flight_chunks is not None and self.max_in_flight_chunks < 1:
            raise ConfigError(f"max_in_flight_chunks must be >= 1, got {self.max_in_flight_chunks}")


@dataclass(frozen=True)
class ContinuitySettings(_Group):
    """Continuity: a session whose group fails (resume) or stops (drain) goes on on another one."""
    resume_sessions: bool = setting(True, "a session whose group fails goes on on another (or the rebuilt) one")
    resume_wait_s: float = setting(120.0, "how long a failed session waits for a group to resume on")
    max_resumes: int = setting(3, "resumes after failures per session (a session that breaks every group is "
                                  "ended; drain moves are not counted)")
    snapshots: bool = setting(True, "each chunk's state to the object store, so a resume restores it instead "
                                    "of replaying the session")

    def __post_init__(self):
        self._positive("resume_wait_s")
        self._at_least(0, "max_resumes")


@dataclass(frozen=True)
class DrainSettings(_Group):
    """Drain: a group Serve is stopping (scale-down, redeploy) moves its sessions to another group."""
    poll_s: float = setting(2.0, "how often a group asks Serve whether it is being stopped, to move its sessions "
                                 "(scale-down, redeploy); 0: never (they end with it)", key="drain_poll_s")
    lead_s: float = setting(3.0, "a stopping group first runs each session this far ahead of its playback (for "
                                 "at most drain_fill_max_s), so the move plays out of the buffer; 0: no fill",
                            key="drain_lead_s")
    margin_s: float = setting(30.0, "a stopping group moves its sessions at the latest this long before Serve "
                                    "kills it (graceful_shutdown_timeout_s)", key="drain_margin_s")
    flush_timeout_s: float = setting(10.0, "a draining group waits this long for the snapshots of its sessions' "
                                           "last chunks", key="drain_flush_timeout_s")
    fill_max_s: float = setting(10.0, "a draining group runs its sessions ahead (drain_lead_s) for at most this "
                                      "long", key="drain_fill_max_s")
    wait_new_s: float = setting(30.0, "how long a stopping group waits for a new group before going to the old "
                                      "ones", key="drain_wait_new_s")
    new_group_slack_s: float = setting(10.0, "a group started this long before the first stop was seen still "
                                             "counts as new", key="drain_new_group_slack_s")

    def __post_init__(self):
        self._at_least(0, "lead_s")
        self._at_least(0, "poll_s", why=" (0 turns draining off)")
        self._positive("margin_s", "flush_timeout_s", "fill_max_s", "wait_new_s")
        self._at_least(0, "new_group_slack_s")


@dataclass(frozen=True)
class EncoderSettings(_Group):
    """The muxer's H.264 encoder."""
    encoder: str = setting("auto", f"one of {list(H264_ENCODERS)} (auto: NVENC where the muxer sees a GPU, "
                                   "else x264)")
    preset: str = setting("veryfast", "the encoder's preset (x264: ultrafast..veryslow; NVENC: p1..p7)",
                          key="encoder_preset")
    threads: int = setting(0, "encoder threads; 0: the encoder's choice", key="encoder_threads")

    def __post_init__(self):
        if self.encoder not in H264_ENCODERS:
            raise ConfigError(f"encoder {self.encoder!r} is not one of {list(H264_ENCODERS)}")
        self._at_least(0, "threads")

    @property
    def h264(self) -> H264Settings:
        return H264Settings(self.encoder, self.preset, threads=self.threads)


@dataclass(frozen=True)
class DoorSettings(_Group):
    """The door: who may open sessions, how many, from which pages, and which images the server fetches."""
    api_keys: str = setting("", "comma-separated API keys; when set, clients must present one (see README)")
    max_sessions_per_key: int = setting(0, "sessions one key (or client address, without keys) may hold at "
                                           "once; 0: no limit")
    max_starts_per_minute_per_key: int = setting(0, "session starts per key (or client address) per minute; "
                                                    "0: no limit")
    allowed_origins: str = setting("", "comma-separated page origins besides the server's own that may open a "
                                       "WebSocket (*: any)")
    image_url_allowlist: str = setting("", "comma-separated URL prefixes (scheme://host[:port]/path/) image_url "
                                           "and first_frame may be fetched from; empty: none (inline images only)")
    image_fetch_timeout_s: float = setting(10.0, "time limit of one image fetch")
    image_fetch_max_bytes: int = setting(20 * 2 ** 20, "size limit of one fetched image")

    def __post_init__(self):
        try:
            _parse_allowlist(self.image_url_allowlist)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        self._at_least(0, "max_sessions_per_key", "max_starts_per_minute_per_key")
        self._positive("image_fetch_timeout_s", "image_fetch_max_bytes")

    @property
    def allowed_origin_set(self) -> frozenset:
        return frozenset(o.strip().rstrip("/") for o in self.allowed_origins.split(",") if o.strip())

    @property
    def api_key_set(self) -> frozenset:
        return frozenset(k.strip() for k in self.api_keys.split(",") if k.strip())


@dataclass(frozen=True)
class SessionLimits(_Group):
    """One session's limits: timeouts, message sizes, length."""
    start_timeout_s: float = setting(10.0, "session.start must arrive this soon after connecting")
    stall_timeout_s: float = setting(60.0, "a send to the client blocked this long (not reading, or gone) ends "
                                           "the session")
    idle_timeout_s: float = setting(300.0, "no interaction for this long ends the session")
    max_lifetime_s: float = setting(3600.0, "a session ends after this long")
    max_start_bytes: int = setting(4 * 2 ** 20, "size limit of the session.start message (with its image)")
    max_control_bytes: int = setting(128 * 2 ** 10, "size limit of any later client message")
    max_queued_controls: int = setting(64, "client messages queued per session (flow control)")
    default_chunks: int = setting(8, "chunks of a session whose session.start gives no num_frames")
    max_chunks: int = setting(100000, "chunks one session may ask for, at most")

    def __post_init__(self):
        self._positive("start_timeout_s", "stall_timeout_s", "idle_timeout_s", "max_lifetime_s")
        self._at_least(1, "max_start_bytes", "max_control_bytes", "max_queued_controls", "default_chunks")
        if self.default_chunks > self.max_chunks:
            raise ConfigError(f"default_chunks ({self.default_chunks}) must be <= max_chunks ({self.max_chunks})")


@dataclass(frozen=True)
class HealthSettings(_Group):
    """Group health: when a group counts as failed, and how often it reports metrics."""
    group_start_timeout_s: float = setting(1800.0, "rank actors up, joined, loaded and warmed up within this (sized "
                                                   "for 8 ranks cold-loading ~45 GiB each from a shared volume, "
                                                   "then compiling; tiny on CPU takes well under a minute)")
    collective_timeout_s: float = setting(120.0, "timeout of the ranks' collectives (NCCL, HCCL, gloo)")
    chunk_timeout_s: float = setting(600.0, "a chunk not back from every rank by then fails the group (a hung "
                                            "collective may raise nothing at the call site)")
    metrics_interval_s: float = setting(5.0, "how often a group exports its metrics")

    def __post_init__(self):
        self._positive("group_start_timeout_s", "collective_timeout_s", "chunk_timeout_s", "metrics_interval_s")


# the concerns, by their attribute on ServeSettings, in the order describe() and the command list them
GROUPS: dict[str, type[_Group]] = {
    "model": ModelSettings, "placement": PlacementSettings, "capacity": CapacitySettings, "pace": PacingSettings,
    "continuity": ContinuitySettings, "drain": DrainSettings, "encoding": EncoderSettings, "door": DoorSettings,
    "limits": SessionLimits, "health": HealthSettings,
}
# flat key -> (group attribute, field)
KEYS: dict[str, tuple[str, dataclasses.Field]] = {
    f.metadata.get("key") or f.name: (group, f) for group, cls in GROUPS.items() for f in dataclasses.fields(cls)}


@dataclass(frozen=True, init=False)
class ServeSettings:
    """Every serve setting, by concern. ServeSettings(**flat) takes the flat keys (and whole groups:
    ServeSettings(drain=DrainSettings(...), sp=4)); `settings.<key>` reads one."""
    model: ModelSettings = field(default_factory=ModelSettings)
    placement: PlacementSettings = field(default_factory=PlacementSettings)
    capacity: CapacitySettings = field(default_factory=CapacitySettings)
    pace: PacingSettings = field(default_factory=PacingSettings)
    continuity: ContinuitySettings = field(default_factory=ContinuitySettings)
    drain: DrainSettings = field(default_factory=DrainSettings)
    encoding: EncoderSettings = field(default_factory=EncoderSettings)
    door: DoorSettings = field(default_factory=DoorSettings)
    limits: SessionLimits = field(default_factory=SessionLimits)
    health: HealthSettings = field(default_factory=HealthSettings)

    def __init__(self, **settings: Any):
        """Flat keys override the groups given whole (so dataclasses.replace(s, sp=4) works)."""
        given: dict[str, _Group] = {}
        flat: dict[str, dict[str, Any]] = {group: {} for group in GROUPS}
        for key, value in settings.items():
            if key in GROUPS:
                if not isinstance(value, GROUPS[key]):
                    raise TypeError(f"ServeSettings {key} must be a {GROUPS[key].__name__}, got {type(value).__name__}")
                given[key] = value
            elif key in KEYS:
                group, f = KEYS[key]
                flat[group][f.name] = value
            else:
                raise TypeError(f"ServeSettings got an unexpected keyword argument {key!r}")
        for group, cls in GROUPS.items():
            value = dataclasses.replace(given[group], **flat[group]) if group in given else cls(**flat[group])
            object.__setattr__(self, group, value)
        self.__post_init__()

    def __post_init__(self):
        """What spans concerns; each group validated its own fields."""
        if self.device != "cpu" and self.rank_devices <= 0:
            raise ConfigError(f"device {self.device} needs rank_devices > 0 (one device per rank)")
        if self.device == "cpu" and self.rank_devices > 0:
            raise ConfigError(f"device cpu takes no accelerators: set rank_devices to 0 (got {self.rank_devices})")
        if self.muxer_gpus > 0 and self.device != "cuda":
            raise ConfigError("muxer_gpus is for NVENC on CUDA nodes; set it to 0 for device "
                              f"{self.device}")

    @classmethod
    def from_args(cls, args: Optional[dict[str, Any]] = None) -> ServeSettings:
        """serve_config.yaml args, overridden by LINGBOT_<FIELD> environment variables."""
        args = dict(args or {})
        unknown = sorted(set(args) - set(KEYS))
        if unknown:
            raise ConfigError(f"unknown serve settings {unknown}; known: {sorted(KEYS)}")
        for key in KEYS:
            env = os.environ.get(ENV_PREFIX + key.upper())
            if env is not None:
                args[key] = env
        for key, value in list(args.items()):
            args[key] = _coerce(key, value, KEYS[key][1].type)
        return cls(**args)

    def to_dict(self) -> dict:
        """The flat keys and their values (ServeSettings(**to_dict()) is an equal object)."""
        return {key: getattr(getattr(self, group), f.name) for key, (group, f) in KEYS.items()}

    def describe(self) -> list[dict]:
        """Each setting: its group, flat key (name), attribute, value, default and meaning, by concern."""
        return [{"group": group, "name": key, "attribute": f"{group}.{f.name}",
                 "value": getattr(getattr(self, group), f.name), "default": f.default, "help": f.metadata["help"]}
                for key, (group, f) in KEYS.items()]

    @property
    def allowed_origin_set(self) -> frozenset:
        return self.door.allowed_origin_set

    @property
    def api_key_set(self) -> frozenset:
        return self.door.api_key_set

    @property
    def budget_bytes(self) -> Optional[int]:
        """The per-rank memory budget of the config rule; None where capacity is measured (accelerators
        without memory_budget_gib)."""
        from lingbot.runtime.lifecycle import CPU_BUDGET_BYTES
        if self.memory_budget_gib is not None:
            return int(self.memory_budget_gib * 2 ** 30)
        return CPU_BUDGET_BYTES if self.device == "cpu" else None

    def sessions_per_group(self) -> int:
        """Sessions one group admits as far as the config tells (the app sizes Serve's routing and
        autoscaling with it): the budget rule, or max_sessions_per_group where the ranks measure memory
        at start-up (each group then admits what its ranks measured, at most this)."""
        from lingbot.runtime.budget import sessions_that_fit
        if self.budget_bytes is None:
            return self.max_sessions_per_group
        return sessions_that_fit(self.model.model_preset, self.sp, self.budget_bytes, self.max_sessions_per_group)

    @property
    def rank_accelerators(self) -> dict[str, float]:
        """Ray resources of one rank's accelerator: {"GPU": n} for cuda, {"NPU": n} for npu, {} for cpu."""
        if self.device == "cpu":
            return {}
        return {ACCELERATOR_RESOURCE[self.device]: self.rank_devices}

    @property
    def placement_bundles(self) -> list[dict]:
        """[replica] + one bundle per rank + [muxer]: derived here, and only here."""
        rank = {"CPU": self.rank_cpus, **self.rank_accelerators}
        muxer = {"CPU": self.muxer_cpus, **({"GPU": self.muxer_gpus} if self.muxer_gpus > 0 else {})}
        return [{"CPU": self.replica_cpus}] + [dict(rank) for _ in range(self.sp)] + [muxer]

    @property
    def in_flight_chunks(self) -> int:
        if self.max_in_flight_chunks is not None:
            return self.max_in_flight_chunks
        return 1 if self.device == "cpu" else 2

    @property
    def h264_settings(self) -> H264Settings:
        return self.encoding.h264

    def rank_actor_options(self) -> dict:
        """Ray actor options of a rank (its bundle's resources): GPUs through num_gpus, which makes Ray set
        CUDA_VISIBLE_DEVICES; other accelerators as named resources (Ray sets ASCEND_RT_VISIBLE_DEVICES).
        CUDA ranks get expandable allocator segments (sessions allocate and free multi-GiB slabs) and NCCL
        warnings in their logs."""
        options: dict = {"num_cpus": self.rank_cpus}
        if self.device == "cuda":
            options["runtime_env"] = {"env_vars": {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
                                                   "NCCL_DEBUG": "WARN"}}
        for name, amount in self.rank_accelerators.items():
            if name == "GPU":
                options["num_gpus"] = amount
            else:
                options.setdefault("resources", {})[name] = amount
        return options

    @property
    def replica_bundle(self) -> int:
        return 0

    def rank_bundle(self, rank: int) -> int:
        return 1 + rank

    @property
    def muxer_bundle(self) -> int:
        return 1 + self.sp


# settings.<flat key>: read-only, from its group
for _key, (_group, _f) in KEYS.items():
    if hasattr(ServeSettings, _key):
        raise RuntimeError(f"flat key {_key} would shadow ServeSettings.{_key}")
    setattr(ServeSettings, _key, property(attrgetter(f"{_group}.{_f.name}"), doc=_f.metadata["help"]))
del _key, _group, _f


def _parse_allowlist(text: str) -> tuple[str, ...]:
    """The door's own parser of image_url_allowlist (deployments/ingress/fetch.py), imported when needed: the
    ingress imports this module."""
    from .ingress.fetch import parse_allowlist
    return parse_allowlist(text)


def _coerce(name: str, value: Any, annotation: str):
    text = str(annotation).removeprefix("Optional[")
    if value is None:
        return value
    try:
        if text.startswith("bool"):
            if isinstance(value, str):
                if value.lower() not in ("1", "0", "true", "false", "yes", "no"):
                    raise ValueError(value)
                return value.lower() in ("1", "true", "yes")
            return bool(value)
        if text.startswith("int"):
            return int(value)
        if text.startswith("float"):
            return float(value)
        return str(value)
    except (TypeError, ValueError):
        raise ConfigError(f"serve setting {name}={value!r} is not a valid {text}") from None


def _show(value: Any) -> str:
    return json.dumps(value)        # null, true, "auto", "": as unambiguous as YAML


def format_table(rows: list[dict]) -> str:
    """describe()'s rows as one table per concern: key, value (* where not the default), default, meaning."""
    widths = [max(len(r["name"]) for r in rows), max(len(_show(r["value"])) for r in rows) + 1,
              max(len(_show(r["default"])) for r in rows)]
    lines: list[str] = []
    for group, cls in GROUPS.items():
        lines += [f"[{group}] {' '.join(cls.__doc__.split())}",
                  _row(widths, "setting", " value", "default", "meaning")]
        for r in rows:
            if r["group"] == group:
                changed = "*" if r["value"] != r["default"] else " "
                lines.append(_row(widths, r["name"], changed + _show(r["value"]), _show(r["default"]), r["help"]))
        lines.append("")
    return "\n".join(lines).rstrip("\n")


def _row(widths: list[int], *cells: str) -> str:
    return "  " + "  ".join(f"{c:<{w}}" for c, w in zip(cells, widths)) + "  " + cells[-1]


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m deployments.settings",
        description="Every serve setting by concern: its flat key (serve_config.yaml args, LINGBOT_<KEY>), value, "
                    "default and meaning. Values are what the app would run with here: the config's args (the "
                    "defaults without --config), overridden by LINGBOT_<KEY> environment variables.")
    parser.add_argument("--config", help="a Serve config (serve_config.yaml): show its first application's args")
    parser.add_argument("--json", action="store_true", help="describe()'s rows as JSON")
    args = parser.parse_args(argv)
    config_args: dict = {}
    if args.config:
        import yaml
        with open(args.config) as f:
            config = yaml.safe_load(f) or {}
        apps = config.get("applications") or []
        if not apps:
            parser.error(f"{args.config} has no applications")
        config_args = apps[0].get("args") or {}
    try:
        settings = ServeSettings.from_args(config_args)
    except ConfigError as e:
        print(f"invalid settings: {e}", file=sys.stderr)
        return 2
    rows = settings.describe()
    print(json.dumps(rows, indent=2) if args.json else format_table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
