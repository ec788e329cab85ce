"""ServeSettings: every serving setting in one typed, validated, frozen object, built from serve_config.yaml's
`args` and overridden by LINGBOT_<KEY> environment variables (the only place that reads them). Each setting is
declared once, in its concern (concerns.py); ServeSettings inherits them all and is what every caller reads."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Optional

from lingbot.config import ConfigError
from lingbot.runtime.rungs import rung

from .concerns import (
    CONCERNS,
    KEYS,
    AccessSettings,
    CapacitySettings,
    ContinuitySettings,
    DrainSettings,
    EncoderSettings,
    HealthSettings,
    ModelSettings,
    PacingSettings,
    PlacementSettings,
    RecordingSettings,
    SessionLimits,
    SpectatorSettings,
    WorldSettings,
)
from .declare import check_bounds, env_name

# Ray's resource for one accelerator of each device kind (NPUs are their own resource, not GPUs)
ACCELERATOR_RESOURCE = {"cuda": "GPU", "npu": "NPU"}


# the concerns as bases, the last first: a dataclass takes its bases' fields from the end of the list, so the
# fields run in the concerns' order (CONCERNS), as to_dict() and describe() list them
@dataclass(frozen=True)
class ServeSettings(HealthSettings, WorldSettings, RecordingSettings, SpectatorSettings, SessionLimits, AccessSettings,
                    EncoderSettings, DrainSettings, ContinuitySettings, PacingSettings, CapacitySettings,
                    PlacementSettings, ModelSettings):
    """Every serve setting, one field per flat key (serve_config.yaml's args, LINGBOT_<KEY>, ServeSettings(**flat),
    to_dict()), declared with its default, meaning and bounds by its concern (concerns.py). Building it checks
    the bounds, then each concern's own checks, then what spans concerns."""

    def __post_init__(self):
        for key, (_, f) in KEYS.items():
            check_bounds(f, getattr(self, key))
        for cls in CONCERNS.values():
            cls.check(self)
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
        """serve_config.yaml args, overridden by LINGBOT_<KEY> environment variables (env_overrides())."""
        args = dict(args or {})
        unknown = sorted(set(args) - set(KEYS))
        if unknown:
            raise ConfigError(f"unknown serve settings {unknown}; known: {sorted(KEYS)}")
        args.update(env_overrides())
        return cls(**{key: _coerce(key, value, KEYS[key][1].type) for key, value in args.items()})

    def to_dict(self) -> dict:
        """The flat keys and their values (ServeSettings(**to_dict()) is an equal object)."""
        return {key: getattr(self, key) for key in KEYS}

    def describe(self) -> list[dict]:
        """Each setting in the concerns' order: its concern, flat key (name), environment variable, value (a secret
        masked), default and meaning."""
        return [{"concern": concern, "name": key, "env": env_name(key), "value": self._shown(key),
                 "default": f.default, "help": f.metadata["help"]}
                for key, (concern, f) in KEYS.items()]

    def _shown(self, key: str) -> Any:
        """A setting's value as describe() shows it: a secret (the API keys) masked, its count left."""
        value = getattr(self, key)
        if KEYS[key][1].metadata["secret"] and value:
            return f"<{len(self.api_key_set)} keys, masked>"
        return value

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
        return sessions_that_fit(self.model_preset, self.sp, self.budget_bytes, self.max_sessions_per_group,
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
    def tenant_session_limit(self) -> int:
        """The sessions one tenant may hold at once: max_sessions_per_key, never more than the deployment's seats
        (max_groups x max_sessions_per_group: one tenant cannot also hold the queue beyond them); 0: no limit."""
        if self.max_sessions_per_key == 0:
            return 0
        return min(self.max_sessions_per_key, self.max_groups * self.max_sessions_per_group)

    # settings whose null means "by device", resolved: read these, not the raw (nullable) field
    @property
    def resolved_spare_groups(self) -> int:
        """spare_groups, null resolved: 1 on accelerators (a group start is minutes there), 0 on cpu."""
        return _by_device(self.spare_groups, self.device, cpu=0, accelerator=1)

    @property
    def resolved_max_fps(self) -> float:
        """max_fps, null resolved: fps (what capacity is counted at)."""
        return self.fps if self.max_fps is None else self.max_fps

    @property
    def resolved_max_in_flight_chunks(self) -> int:
        """max_in_flight_chunks, null resolved: 2 on accelerators (the ranks run the next chunk while the last is
        encoded and sent), 1 on cpu (measured: the overlap only shares its cores there)."""
        return _by_device(self.max_in_flight_chunks, self.device, cpu=1, accelerator=2)

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


# settings a running app takes in place: they reach the groups as the WorldGroup deployment's user_config (Serve
# applies a change to it without replacing a replica: WorldGroup.reconfigure), not in the deployments' arguments
LIVE_SETTINGS = ("quality_ladder",)


def live_settings(user_config: dict, pinned: dict) -> tuple[dict, list[str]]:
    """The live settings a group runs with: its user_config (serve_config.yaml's `deployments:`, or the args' values
    where the file gives none), each overridden by the environment (`pinned`: the LINGBOT_<KEY> set where the app
    was built), as every setting is. Returns them and one line per value of the file the environment overrode."""
    unknown = set(user_config) - set(LIVE_SETTINGS)
    if unknown:
        raise ConfigError(f"WorldGroup user_config takes {', '.join(LIVE_SETTINGS)} only, not {sorted(unknown)}")
    overridden = [f"{key} {pinned[key]!r} from {env_name(key)} overrides the user_config's {user_config[key]!r}"
                  for key in sorted(set(user_config) & set(pinned)) if user_config[key] != pinned[key]]
    return {**user_config, **pinned}, overridden


def _by_device(value: Optional[int], device: str, cpu: int, accelerator: int) -> int:
    return value if value is not None else cpu if device == "cpu" else accelerator


def env_overrides() -> dict[str, str]:
    """The settings set in the environment (LINGBOT_<KEY>), as text: they override serve_config.yaml, its args and
    its deployments' user_config alike."""
    return {key: os.environ[env_name(key)] for key in KEYS if env_name(key) in os.environ}


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
