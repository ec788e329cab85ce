"""ServeSettings: every serving setting, one typed and validated object built from serve_config.yaml's `args`
(and the only place that reads environment variables), composed of the concerns in groups.py."""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from operator import attrgetter
from typing import Any, Optional

from lingbot.config import ConfigError
from lingbot.io.video import H264Settings

from .groups import (
    GROUPS,
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
    _Group,
)

ENV_PREFIX = "LINGBOT_"
# Ray's resource for one accelerator of each device kind (NPUs are their own resource, not GPUs)
ACCELERATOR_RESOURCE = {"cuda": "GPU", "npu": "NPU"}


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
    def decoder_names(self) -> tuple[str, ...]:
        """The frame decoders the ranks load, the first the sessions' default."""
        return self.model.decoder_names

    @property
    def budget_bytes(self) -> Optional[int]:
        """The per-rank memory budget of the config rule; None where capacity is measured (accelerators
        without memory_budget_gib)."""
        from lingbot.lifecycle import CPU_BUDGET_BYTES
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

    @property
    def headroom_groups(self) -> int:
        """spare_groups resolved: 1 on accelerators (a group start is minutes there), 0 on cpu."""
        if self.spare_groups is not None:
            return self.spare_groups
        return 0 if self.device == "cpu" else 1

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
