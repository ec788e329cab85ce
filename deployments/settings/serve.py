"""ServeSettings: every serving setting, one typed and validated object built from serve_config.yaml's `args`
(and the only place that reads environment variables). Each flat key is a declared, typed field; the concerns
(concerns.py) group them, validate them and carry their meaning."""
from __future__ import annotations

import dataclasses
import itertools
import os
import warnings
from dataclasses import dataclass, field
from typing import Any, Optional

from lingbot.config import ConfigError
from lingbot.io.video import H264Settings
from lingbot.runtime.rungs import rung

from .concerns import (
    CONCERNS,
    KEYS,
    CapacitySettings,
    ContinuitySettings,
    DoorSettings,
    DrainSettings,
    EncoderSettings,
    HealthSettings,
    ModelSettings,
    PacingSettings,
    PlacementSettings,
    SessionLimits,
)

ENV_PREFIX = "LINGBOT_"
SECRET_KEYS = frozenset({"api_keys"})      # never printed (describe(), the settings command): masked
# Ray's resource for one accelerator of each device kind (NPUs are their own resource, not GPUs)
ACCELERATOR_RESOURCE = {"cuda": "GPU", "npu": "NPU"}


@dataclass(frozen=True, init=False)
class ServeSettings:
    """Every serve setting: one typed field per flat key (serve_config.yaml's args, LINGBOT_<KEY>,
    ServeSettings(**flat), to_dict()), declared as its concern declares it (concerns.py: default, meaning,
    checks), in the concerns' order. The concerns are built from the fields and validate them:
    `settings.drain` is the DrainSettings of the drain_* keys. ServeSettings(**flat) also takes whole
    concerns: ServeSettings(drain=DrainSettings(...), sp=4)."""
    # model
    preset: str = ModelSettings.preset
    model_path: Optional[str] = ModelSettings.model_path
    device: str = ModelSettings.device
    dtype: Optional[str] = ModelSettings.dtype
    sp: int = ModelSettings.sp
    pixel_mode: str = ModelSettings.pixel_mode
    skip_fixed_point: bool = ModelSettings.skip_fixed_point
    compile: Optional[bool] = ModelSettings.compile
    cuda_graphs: bool = ModelSettings.cuda_graphs
    decoder: Optional[str] = ModelSettings.decoder
    tae_path: Optional[str] = ModelSettings.tae_path
    # placement
    replica_cpus: float = PlacementSettings.replica_cpus
    rank_cpus: float = PlacementSettings.rank_cpus
    rank_devices: float = PlacementSettings.rank_devices
    muxer_cpus: float = PlacementSettings.muxer_cpus
    muxer_gpus: float = PlacementSettings.muxer_gpus
    ingress_cpus: float = PlacementSettings.ingress_cpus
    # capacity
    max_sessions_per_group: int = CapacitySettings.max_sessions_per_group
    memory_budget_gib: Optional[float] = CapacitySettings.memory_budget_gib
    min_groups: int = CapacitySettings.min_groups
    max_groups: int = CapacitySettings.max_groups
    graceful_shutdown_timeout_s: float = CapacitySettings.graceful_shutdown_timeout_s
    spare_groups: Optional[int] = CapacitySettings.spare_groups
    max_queue_wait_s: float = CapacitySettings.max_queue_wait_s
    admission_wait_s: float = CapacitySettings.admission_wait_s
    retry_after_s: float = CapacitySettings.retry_after_s
    max_ingress_sessions: int = CapacitySettings.max_ingress_sessions
    max_waiting_sessions: int = CapacitySettings.max_waiting_sessions
    max_ingress_replicas: int = CapacitySettings.max_ingress_replicas
    max_ingress_connections: int = CapacitySettings.max_ingress_connections
    # pace
    fps: float = PacingSettings.fps
    max_fps: Optional[float] = PacingSettings.max_fps
    pacing: str = PacingSettings.mode
    pacing_lead_s: float = PacingSettings.lead_s
    pacing_margin_s: float = PacingSettings.margin_s
    pacing_quantile: float = PacingSettings.quantile
    restart_stale_chunks: bool = PacingSettings.restart_stale_chunks
    max_in_flight_chunks: Optional[int] = PacingSettings.max_in_flight_chunks
    quality_ladder: str = PacingSettings.quality_ladder
    quality_floor: str = PacingSettings.quality_floor
    # continuity
    resume_sessions: bool = ContinuitySettings.resume_sessions
    resume_wait_s: float = ContinuitySettings.resume_wait_s
    max_resumes: int = ContinuitySettings.max_resumes
    snapshots: bool = ContinuitySettings.snapshots
    snapshot_interval_chunks: int = ContinuitySettings.snapshot_interval_chunks
    snapshot_host_budget_gib: Optional[float] = ContinuitySettings.snapshot_host_budget_gib
    # drain
    drain_poll_s: float = DrainSettings.poll_s
    drain_lead_s: float = DrainSettings.lead_s
    drain_margin_s: float = DrainSettings.margin_s
    drain_flush_timeout_s: float = DrainSettings.flush_timeout_s
    drain_fill_max_s: float = DrainSettings.fill_max_s
    drain_wait_new_s: float = DrainSettings.wait_new_s
    drain_new_group_slack_s: float = DrainSettings.new_group_slack_s
    # encoding
    encoder: str = EncoderSettings.encoder
    encoder_preset: str = EncoderSettings.preset
    encoder_threads: int = EncoderSettings.threads
    # door
    api_keys: str = field(default=DoorSettings.api_keys, repr=False)     # a secret: never in a repr
    max_sessions_per_key: int = DoorSettings.max_sessions_per_key
    max_starts_per_minute_per_key: int = DoorSettings.max_starts_per_minute_per_key
    max_connections_per_address: int = DoorSettings.max_connections_per_address
    trusted_proxies: str = DoorSettings.trusted_proxies
    allowed_origins: str = DoorSettings.allowed_origins
    allowed_hosts: str = DoorSettings.allowed_hosts
    image_url_allowlist: str = DoorSettings.image_url_allowlist
    image_fetch_timeout_s: float = DoorSettings.image_fetch_timeout_s
    image_fetch_max_bytes: int = DoorSettings.image_fetch_max_bytes
    max_header_bytes: int = DoorSettings.max_header_bytes
    # limits
    start_timeout_s: float = SessionLimits.start_timeout_s
    stall_timeout_s: float = SessionLimits.stall_timeout_s
    idle_timeout_s: float = SessionLimits.idle_timeout_s
    max_lifetime_s: float = SessionLimits.max_lifetime_s
    max_start_bytes: int = SessionLimits.max_start_bytes
    max_control_bytes: int = SessionLimits.max_control_bytes
    max_queued_controls: int = SessionLimits.max_queued_controls
    max_messages_per_s: float = SessionLimits.max_messages_per_s
    default_chunks: int = SessionLimits.default_chunks
    max_chunks: int = SessionLimits.max_chunks
    # health
    group_start_timeout_s: float = HealthSettings.group_start_timeout_s
    collective_timeout_s: float = HealthSettings.collective_timeout_s
    chunk_timeout_s: float = HealthSettings.chunk_timeout_s
    metrics_interval_s: float = HealthSettings.metrics_interval_s

    # the concerns, built from the fields above (each validates its own)
    model: ModelSettings = field(init=False, repr=False, compare=False)
    placement: PlacementSettings = field(init=False, repr=False, compare=False)
    capacity: CapacitySettings = field(init=False, repr=False, compare=False)
    pace: PacingSettings = field(init=False, repr=False, compare=False)
    continuity: ContinuitySettings = field(init=False, repr=False, compare=False)
    drain: DrainSettings = field(init=False, repr=False, compare=False)
    encoding: EncoderSettings = field(init=False, repr=False, compare=False)
    door: DoorSettings = field(init=False, repr=False, compare=False)
    limits: SessionLimits = field(init=False, repr=False, compare=False)
    health: HealthSettings = field(init=False, repr=False, compare=False)

    def __init__(self, **settings: Any):
        """Flat keys override the concerns given whole, whatever their order (so dataclasses.replace(s, sp=4),
        which passes every flat key, works)."""
        values = {key: f.default for key, (_, f) in KEYS.items()}
        flat: dict[str, Any] = {}
        for key, value in settings.items():
            if key in CONCERNS:
                if not isinstance(value, CONCERNS[key]):
                    raise TypeError(f"ServeSettings {key} must be a {CONCERNS[key].__name__}, got "
                                    f"{type(value).__name__}")
                values.update(value.to_flat())
            elif key in KEYS:
                flat[key] = value
            else:
                raise TypeError(f"ServeSettings got an unexpected keyword argument {key!r}")
        values.update(flat)
        for key, value in values.items():
            object.__setattr__(self, key, value)
        self.__post_init__()

    def __post_init__(self):
        """Each concern validates its own fields; what spans concerns is checked here."""
        for concern, cls in CONCERNS.items():
            object.__setattr__(self, concern, cls.from_flat(vars(self)))
        if self.device != "cpu" and self.rank_devices <= 0:
            raise ConfigError(f"device {self.device} needs rank_devices > 0 (one device per rank)")
        if self.device == "cpu" and self.rank_devices > 0:
            raise ConfigError(f"device cpu takes no accelerators: set rank_devices to 0 (got {self.rank_devices})")
        if self.muxer_gpus > 0 and self.device != "cuda":
            raise ConfigError("muxer_gpus is for NVENC on CUDA nodes; set it to 0 for device "
                              f"{self.device}")
        if rung(self.quality_floor).decoder is not None and not {"wan", "tae"} <= set(self.decoder_names):
            raise ConfigError(f"quality_floor {self.quality_floor!r} is a decoder rung: it needs both decoders "
                              f"loaded (decoder: wan,tae), not {','.join(self.decoder_names)}")

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
        return {key: getattr(self, key) for key in KEYS}

    def describe(self) -> list[dict]:
        """Each setting, by concern: its concern (as "group", the command's JSON since before the rename), flat
        key (name), attribute on the concern, value, default and meaning."""
        return [{"group": concern, "name": key, "attribute": f"{concern}.{f.name}", "value": self._shown(key),
                 "default": f.default, "help": f.metadata["help"]}
                for key, (concern, f) in KEYS.items()]

    def _shown(self, key: str) -> Any:
        """A setting's value as describe() shows it: a secret (the API keys) masked, its count left."""
        value = getattr(self, key)
        if key in SECRET_KEYS and value:
            return f"<{len(self.api_key_set)} keys, masked>"
        return value

    @property
    def allowed_origin_set(self) -> frozenset:
        return self.door.allowed_origin_set

    @property
    def allowed_host_set(self) -> frozenset:
        return self.door.allowed_host_set

    @property
    def api_key_set(self) -> frozenset:
        return self.door.api_key_set

    @property
    def trusted_proxy_networks(self) -> tuple:
        return self.door.trusted_proxy_networks

    @property
    def decoder_names(self) -> tuple[str, ...]:
        """The frame decoders the ranks load, the first the sessions' default."""
        return self.model.decoder_names

    @property
    def budget_bytes(self) -> Optional[int]:
        """The per-rank memory budget of the config rule; None where capacity is measured (accelerators
        without memory_budget_gib)."""
        from lingbot.runtime.budget import CPU_BUDGET_BYTES
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
        return sessions_that_fit(self.model.model_preset, self.sp, self.budget_bytes, self.max_sessions_per_group,
                                 cuda_graphs=self.cuda_graphs)

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

    # settings whose null means "by device", resolved: read these, not the raw (nullable) field
    @property
    def resolved_spare_groups(self) -> int:
        """spare_groups, null resolved: 1 on accelerators (a group start is minutes there), 0 on cpu."""
        return _by_device(self.spare_groups, self.device, cpu=0, accelerator=1)

    @property
    def quality_rungs(self) -> tuple[str, ...]:
        """The rungs a session may pin (extra_params.quality): full down to quality_floor."""
        return self.pace.quality_rungs

    @property
    def resolved_max_fps(self) -> float:
        """max_fps, null resolved: fps (what capacity is counted at)."""
        return self.fps if self.max_fps is None else self.max_fps

    @property
    def resolved_max_in_flight_chunks(self) -> int:
        """max_in_flight_chunks, null resolved: 2 on accelerators (the ranks run the next chunk while the last is
        encoded and sent), 1 on cpu (measured: the overlap only shares its cores there)."""
        return _by_device(self.max_in_flight_chunks, self.device, cpu=1, accelerator=2)

    @property
    def headroom_groups(self) -> int:
        """Deprecated name of resolved_spare_groups."""
        return _renamed(self, "headroom_groups", "resolved_spare_groups")

    @property
    def in_flight_chunks(self) -> int:
        """Deprecated name of resolved_max_in_flight_chunks."""
        return _renamed(self, "in_flight_chunks", "resolved_max_in_flight_chunks")

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


def _declared_as_the_concerns_declare_them() -> None:
    """ServeSettings' flat fields are the concerns' fields under their flat keys: same order, type and default
    (a key added to a concern and not here, or a property shadowing a field, fails at import)."""
    declared = [(f.name, f.type, f.default) for f in dataclasses.fields(ServeSettings) if f.init]
    wanted = [(key, f.type, f.default) for key, (_, f) in KEYS.items()]
    for have, want in itertools.zip_longest(declared, wanted):
        if have != want:
            raise RuntimeError(f"ServeSettings declares {have}, its concerns {want} (flat key, type, default)")


_declared_as_the_concerns_declare_them()


def _by_device(value: Optional[int], device: str, cpu: int, accelerator: int) -> int:
    return value if value is not None else cpu if device == "cpu" else accelerator


def _renamed(settings: ServeSettings, old: str, new: str):
    warnings.warn(f"ServeSettings.{old} is deprecated: read ServeSettings.{new}", DeprecationWarning, stacklevel=3)
    return getattr(settings, new)


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
