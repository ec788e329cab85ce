"""Serving settings: one typed, validated object built from serve_config.yaml's `args` (and the only
place that reads environment variables). Every error names the bad value and the fix."""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any, Optional

from lingbot.config import PRESETS, ConfigError, get_preset
from lingbot.io.video import H264_ENCODERS, H264Settings
from lingbot.parallel.pixels import DEFAULT_PIXEL_MODE, PIXEL_MODES

from .fetch import parse_allowlist

ENV_PREFIX = "LINGBOT_"
# Ray's resource for one accelerator of each device kind (NPUs are their own resource, not GPUs)
ACCELERATOR_RESOURCE = {"cuda": "GPU", "npu": "NPU"}


@dataclass(frozen=True)
class ServeSettings:
    # model
    preset: str = "tiny"
    model_path: Optional[str] = None
    device: str = "cpu"                      # cpu | cuda | npu
    sp: int = 2                              # ranks per group (sequence-parallel degree)
    pixel_mode: str = DEFAULT_PIXEL_MODE
    skip_fixed_point: bool = True
    compile: Optional[bool] = None           # regional torch.compile of the DiT blocks; None: on for cuda/npu
    cuda_graphs: bool = False                # the compiled regions as CUDA graphs (off until the device check
                                             # measures them faster on the target GPU)
    # placement (resources per bundle: [replica] + sp x [rank] + [muxer])
    replica_cpus: float = 0.05
    rank_cpus: float = 0.3
    rank_devices: float = 0.0                # accelerators per rank (GPUs for cuda, NPUs for npu): 1
    muxer_cpus: float = 0.1
    muxer_gpus: float = 0.0                  # > 0 lets the muxer see a GPU, so encoder "auto" can use NVENC
    ingress_cpus: float = 0.05
    # capacity: sessions per group = min(max_sessions_per_group, what fits per rank): on accelerators in the
    # memory measured after warm-up, unless memory_budget_gib (per rank) overrides it; on CPU in
    # memory_budget_gib (default 1 GiB)
    max_sessions_per_group: int = 2
    memory_budget_gib: Optional[float] = None
    # autoscaling (counted in sessions)
    min_groups: int = 1
    max_groups: int = 2
    graceful_shutdown_timeout_s: float = 600.0
    # sessions
    fps: float = 16.0
    pacing_lead_s: float = 1.5               # how far a session may run ahead of real time (adaptive: at most)
    pacing: str = "adaptive"                 # fixed: always pacing_lead_s; adaptive: learned per session
    pacing_margin_s: float = 0.1             # adaptive: slack kept above the needed lead
    pacing_quantile: float = 0.9             # adaptive: the share of recent chunks the lead must cover
    restart_stale_chunks: bool = False       # a control arriving in a chunk's probes restarts it with the control
    admission_wait_s: float = 20.0           # wait for a free group (autoscaler) before capacity_exhausted
    resume_sessions: bool = True             # a session whose group fails goes on on another (or the rebuilt) one
    resume_wait_s: float = 120.0             # how long a failed session waits for a group to resume on
    max_resumes: int = 3                     # resumes per session (a session that breaks every group is ended)
    snapshots: bool = True                   # each chunk's state to the object store: a resume restores, not replays
    drain_poll_s: float = 2.0                # how often a group asks Serve whether it is being stopped, to move its
                                             # sessions (scale-down, redeploy); 0: never (they end with it)
    drain_lead_s: float = 3.0                # a stopping group first runs each session this far ahead of its
                                             # playback (for at most 10 s), so the move plays out of the buffer
    retry_after_s: float = 10.0
    start_timeout_s: float = 10.0            # session.start must arrive this soon after connecting
    stall_timeout_s: float = 60.0            # a send to the client blocked this long (not reading, or gone) ends it
    idle_timeout_s: float = 300.0            # no interaction for this long ends the session
    max_lifetime_s: float = 3600.0
    max_start_bytes: int = 4 * 2 ** 20
    max_control_bytes: int = 128 * 2 ** 10
    max_queued_controls: int = 64            # per session: flow control on client messages
    max_ingress_sessions: int = 64           # WebSockets one ingress replica holds
    default_chunks: int = 8                  # when session.start gives no num_frames
    max_chunks: int = 100000
    # rank actors up, joined, loaded and warmed up: sized for real weights (8 ranks cold-loading ~45 GiB each
    # from a shared volume, then compiling); the tiny CPU default takes well under a minute
    group_start_timeout_s: float = 1800.0
    collective_timeout_s: float = 120.0
    # a chunk not back from every rank by then fails the group: NCCL errors abort asynchronously (its
    # watchdog), so a hung collective must not rely on an exception at the call site
    chunk_timeout_s: float = 600.0
    metrics_interval_s: float = 5.0
    # delivery: the ranks start a session's next chunk while its last one is copied, encoded and sent
    # per session, generated but not yet delivered; None: 2 on accelerators (the host's copy, encode and send
    # overlap the device), 1 on CPU (measured slower there: the encoder and the next chunk share the cores)
    max_in_flight_chunks: Optional[int] = None
    encoder: str = "auto"                    # auto (NVENC where the muxer sees a GPU, else x264) | libx264 | h264_nvenc
    encoder_preset: str = "veryfast"         # x264 preset (NVENC: p1..p7)
    encoder_threads: int = 0                 # 0: the encoder's choice
    api_keys: str = ""                       # comma-separated; when set, clients must present one (see README)
    max_sessions_per_key: int = 0            # sessions one key (or client address, without keys) may hold; 0: no limit
    max_starts_per_minute_per_key: int = 0   # session starts per key per minute; 0: no limit
    allowed_origins: str = ""                # comma-separated page origins besides the server's own ("*": any)
    image_url_allowlist: str = ""            # URL prefixes image_url / first_frame may be fetched from ("": none)
    image_fetch_timeout_s: float = 10.0
    image_fetch_max_bytes: int = 20 * 2 ** 20

    def __post_init__(self):
        try:
            parse_allowlist(self.image_url_allowlist)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        if self.preset not in PRESETS:
            raise ConfigError(f"preset {self.preset!r} is not one of {sorted(PRESETS)}")
        if self.device not in ("cpu", "cuda", "npu"):
            raise ConfigError(f"device {self.device!r} must be cpu, cuda or npu")
        if self.sp < 1:
            raise ConfigError(f"sp must be >= 1, got {self.sp}")
        heads = PRESETS[self.preset].transformer.num_attention_heads
        if heads % self.sp:
            raise ConfigError(f"sp {self.sp} does not divide the {heads} attention heads of {self.preset}")
        if self.pixel_mode not in PIXEL_MODES:
            raise ConfigError(f"pixel_mode {self.pixel_mode!r} is not one of {list(PIXEL_MODES)}")
        if self.device != "cpu" and self.rank_devices <= 0:
            raise ConfigError(f"device {self.device} needs rank_devices > 0 (one device per rank)")
        if self.device == "cpu" and self.rank_devices > 0:
            raise ConfigError(f"device cpu takes no accelerators: set rank_devices to 0 (got {self.rank_devices})")
        if self.preset != "tiny" and not self.model_path:
            raise ConfigError(f"preset {self.preset} needs model_path (the diffusers-format checkpoint folder)")
        if not 1 <= self.min_groups <= self.max_groups:
            raise ConfigError(f"need 1 <= min_groups ({self.min_groups}) <= max_groups ({self.max_groups})")
        if self.max_sessions_per_group < 1:
            raise ConfigError("max_sessions_per_group must be >= 1")
        if self.encoder not in H264_ENCODERS:
            raise ConfigError(f"encoder {self.encoder!r} is not one of {list(H264_ENCODERS)}")
        if self.cuda_graphs and self.device != "cuda":
            raise ConfigError(f"cuda_graphs needs device cuda, not {self.device}")
        if self.max_in_flight_chunks is not None and self.max_in_flight_chunks < 1:
            raise ConfigError(f"max_in_flight_chunks must be >= 1, got {self.max_in_flight_chunks}")
        if self.muxer_gpus > 0 and self.device != "cuda":
            raise ConfigError("muxer_gpus is for NVENC on CUDA nodes; set it to 0 for device "
                              f"{self.device}")
        if self.pacing not in ("fixed", "adaptive"):
            raise ConfigError(f"pacing {self.pacing!r} must be fixed or adaptive")
        if not 0 < self.pacing_quantile <= 1 or self.pacing_margin_s < 0:
            raise ConfigError(f"pacing_quantile must be in (0, 1] and pacing_margin_s >= 0, got "
                              f"{self.pacing_quantile} and {self.pacing_margin_s}")
        for name in ("fps", "pacing_lead_s", "admission_wait_s", "start_timeout_s", "stall_timeout_s", "resume_wait_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.drain_lead_s < 0:
            raise ConfigError(f"drain_lead_s must be >= 0, got {self.drain_lead_s}")
        if self.drain_poll_s < 0:
            raise ConfigError(f"drain_poll_s must be >= 0 (0 turns draining off), got {self.drain_poll_s}")

    @classmethod
    def from_args(cls, args: Optional[dict[str, Any]] = None) -> ServeSettings:
        """serve_config.yaml args, overridden by LINGBOT_<FIELD> environment variables."""
        args = dict(args or {})
        known = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(args) - set(known))
        if unknown:
            raise ConfigError(f"unknown serve settings {unknown}; known: {sorted(known)}")
        for name, _f in known.items():
            env = os.environ.get(ENV_PREFIX + name.upper())
            if env is not None:
                args[name] = env
        for name, value in list(args.items()):
            args[name] = _coerce(name, value, known[name].type)
        return cls(**args)

    @property
    def allowed_origin_set(self) -> frozenset:
        return frozenset(o.strip().rstrip("/") for o in self.allowed_origins.split(",") if o.strip())

    @property
    def api_key_set(self) -> frozenset:
        return frozenset(k.strip() for k in self.api_keys.split(",") if k.strip())

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

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
        return sessions_that_fit(get_preset(self.preset), self.sp, self.budget_bytes, self.max_sessions_per_group)

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
        return H264Settings(self.encoder, self.encoder_preset, threads=self.encoder_threads)

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
