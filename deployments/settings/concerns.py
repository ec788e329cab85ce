"""Every serving setting, declared once: its flat key (the field's name: serve_config.yaml's args key, and
LINGBOT_<KEY> in the environment), type, default, meaning and bounds, in one small frozen dataclass per concern
(model, placement, capacity, pace, continuity, drain, encoding, access, limits, spectators, recordings,
worlds, health) with the checks of that concern. The concerns are sections of ServeSettings (serve.py), which
inherits every field and is the one object read everywhere (`settings.drain_lead_s`); a concern is never built
or read on its own.
`CONCERNS` lists them in the order the settings command shows them, `KEYS` maps each flat key to its concern.
How a setting is declared: declare.py."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional
from urllib.parse import urlsplit

from lingbot.config import DECODERS, DTYPES, PRESETS, ConfigError, Preset, get_preset, with_dtype
from lingbot.io.video import H264_ENCODERS, H264Settings
from lingbot.parallel.pixels import DEFAULT_PIXEL_MODE, PIXEL_MODES
from lingbot.runtime.rungs import LADDER

from ..addresses import parse_networks
from .declare import SettingsConcern, setting

MIN_KEY_CHARS = 16      # an API key shorter than this is refused at start
HEALTH_ROOM = 16        # requests an ingress takes beyond its sessions: refusals at the door, health and config


@dataclass(frozen=True)
class ModelSettings(SettingsConcern):
    """The checkpoint, the device and the sequence-parallel degree."""
    preset: str = setting("tiny", f"model preset, one of {sorted(PRESETS)} (tiny: random weights, CPU tests)")
    model_path: Optional[str] = setting(None, "the diffusers-format checkpoint folder (every preset but tiny)")
    device: str = setting("cpu", "cpu | cuda | npu")
    dtype: Optional[str] = setting(None, f"the DiT's (and text encoder's) dtype instead of the preset's, one of "
                                         f"{sorted(DTYPES)}; null: the preset's (bfloat16 for the real checkpoints, "
                                         f"float32 for tiny). The VAE keeps the preset's vae_dtype (float32)")
    sp: int = setting(2, "ranks per group (sequence-parallel degree); must divide the preset's attention heads",
                      at_least=1)
    pixel_mode: str = setting(DEFAULT_PIXEL_MODE, f"how a chunk's decoded pixels reach rank 0: {list(PIXEL_MODES)}")
    skip_fixed_point: bool = setting(True, "reuse the condition encoder's latents once its state reaches a fixed point "
                                             "(detected bitwise); false: always run the encoder (the reference path)")
    compile: Optional[bool] = setting(None, "regional torch.compile of the DiT blocks; null: on for cuda and npu, "
                                            "off for cpu")
    cuda_graphs: bool = setting(False, "the compiled regions as CUDA graphs (cuda only; off until the device "
                                       "check measures them faster on the target GPU)")
    decoder: Optional[str] = setting(None, f"the frame decoders the ranks load, comma-separated, the first the "
                                           f"sessions' default (a session may pick another loaded one), of "
                                           f"{list(DECODERS)}: wan (the Wan VAE's), tae (the tiny autoencoder, about "
                                           f"25x fewer FLOPs); null: 'tae,wan' on cpu (measured: it keeps 4 sessions "
                                           f"at real time there, the Wan decoder 1), 'wan' on accelerators")
    tae_path: Optional[str] = setting(None, "the tiny decoder's weights (taew2_1 .pth or .safetensors); null: seeded "
                                            "random weights, allowed with the tiny preset only")

    def check(self) -> None:
        if self.preset not in PRESETS:
            raise ConfigError(f"preset {self.preset!r} is not one of {sorted(PRESETS)}")
        if self.device not in ("cpu", "cuda", "npu"):
            raise ConfigError(f"device {self.device!r} must be cpu, cuda or npu")
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ConfigError(f"dtype {self.dtype!r} is not one of {sorted(DTYPES)}; null keeps the preset's "
                              f"({PRESETS[self.preset].dtype})")
        heads = PRESETS[self.preset].transformer.num_attention_heads
        if heads % self.sp:
            raise ConfigError(f"sp {self.sp} does not divide the {heads} attention heads of {self.preset}")
        if self.pixel_mode not in PIXEL_MODES:
            raise ConfigError(f"pixel_mode {self.pixel_mode!r} is not one of {list(PIXEL_MODES)}")
        if self.preset != "tiny" and not self.model_path:
            raise ConfigError(f"preset {self.preset} needs model_path (the diffusers-format checkpoint folder)")
        if self.cuda_graphs and self.device != "cuda":
            raise ConfigError(f"cuda_graphs needs device cuda, not {self.device}")
        names = self.decoder_names
        if not names or any(n not in DECODERS for n in names) or len(set(names)) != len(names):
            raise ConfigError(f"decoder {self.decoder!r} must name decoders of {list(DECODERS)}, each once, "
                              f"comma-separated (the first is the default)")
        if "tae" in names and self.tae_path is None and self.model_path is not None:
            raise ConfigError("decoder tae with a checkpoint needs tae_path (the taew2_1 weights); random tiny "
                              "decoder weights go with the tiny preset only")

    @property
    def decoder_names(self) -> tuple[str, ...]:
        names = self.decoder if self.decoder is not None else ("tae,wan" if self.device == "cpu" else "wan")
        return tuple(n.strip() for n in names.split(",") if n.strip())

    @property
    def model_preset(self) -> Preset:
        """The preset as the ranks run it (with the dtype override): what the budget is counted for."""
        return with_dtype(get_preset(self.preset), self.dtype)


@dataclass(frozen=True)
class PlacementSettings(SettingsConcern):
    """Ray resources per bundle of a group ([replica] + sp x [rank] + [muxer]) and of the ingress."""
    replica_cpus: float = setting(0.05, "CPUs of a group's replica (the Serve actor that schedules its sessions)",
                                  at_least=0)
    rank_cpus: float = setting(0.3, "CPUs per rank", at_least=0)
    rank_devices: float = setting(0.0, "accelerators per rank (GPUs for cuda, NPUs for npu; 1 on accelerators, "
                                       "0 on cpu)", at_least=0)
    muxer_cpus: float = setting(0.1, "CPUs of a group's muxer (encodes and packages the sessions' video)", at_least=0)
    muxer_gpus: float = setting(0.0, "GPUs of the muxer: > 0 lets it see a GPU, so encoder auto can use NVENC "
                                     "(cuda only)", at_least=0)
    ingress_cpus: float = setting(0.05, "CPUs per ingress replica (it holds the WebSockets)", at_least=0)


@dataclass(frozen=True)
class CapacitySettings(SettingsConcern):
    """Capacity and autoscaling: sessions per group = min(max_sessions_per_group, what fits per rank: on
    accelerators in the memory measured after warm-up unless memory_budget_gib overrides it, on CPU in
    memory_budget_gib, 1 GiB by default); Serve scales groups between min_groups and max_groups by sessions."""
    max_sessions_per_group: int = setting(2, "sessions one group serves at once, at most", at_least=1)
    memory_budget_gib: Optional[float] = setting(None, "per-rank memory budget for sessions (GiB); null: "
                                                       "measured after warm-up on accelerators, 1 GiB on cpu",
                                                 above=0)
    min_groups: int = setting(1, "groups Serve keeps running (autoscaling, counted in sessions)")
    max_groups: int = setting(2, "groups Serve may run")
    graceful_shutdown_timeout_s: float = setting(600.0, "how long Serve lets a stopping replica's sessions go "
                                                        "on before it kills it", at_least=0)
    spare_groups: Optional[int] = setting(None, "groups kept running with every slot free beyond what the "
                                                "sessions need (a burst or a resume finds one ready); null: 1 on "
                                                "accelerators, 0 on cpu", at_least=0)
    max_queue_wait_s: float = setting(600.0, "how long a new session waits in the queue while groups may still "
                                             "be added (below max_groups, or one starting) before "
                                             "capacity_exhausted", above=0)
    admission_wait_s: float = setting(0.0, "how long a new session waits for a slot to free when no group can "
                                           "be added (max_groups running, none starting); 0: refused at once",
                                     at_least=0)
    retry_after_s: float = setting(10.0, "the retry_after_s a refused client is told (capacity, key limits)",
                                  at_least=0)
    max_ingress_sessions: int = setting(64, "WebSockets one ingress replica serves; each one more is answered at "
                                            "once with server_busy (close 1013, retry_after_s with jitter), by "
                                            "Serve's proxy itself beyond this times max_ingress_replicas (its door: "
                                            "set in the environment Ray starts with)", at_least=1)
    max_waiting_sessions: int = setting(32, "sessions one ingress replica lets wait for a group at once (at most "
                                            "max_ingress_sessions); a start beyond them is refused at once with "
                                            "capacity_exhausted")
    max_ingress_replicas: int = setting(1, "ingress replicas Serve may run: above 1 it adds one when the WebSockets "
                                           "held pass 3/4 of max_ingress_sessions per replica (a crowd adds replicas, "
                                           "not refusals); each keeps its own waiting room, limits and keeper",
                                       at_least=1)
    min_ingress_replicas: int = setting(1, "ingress replicas Serve keeps running however few connect (at most "
                                           "max_ingress_replicas; equal to it: a fixed number of replicas): more than "
                                           "one keeps the page and new sessions served while one replica restarts; a "
                                           "shared session's viewers are served at any of them", at_least=1)
    max_ingress_connections: int = setting(1024, "requests Serve routes to one ingress replica at once (its "
                                                 "max_ongoing_requests): the sessions, the refusals being answered "
                                                 "and the HTTP routes; at least max_ingress_sessions + 16")

    def check(self) -> None:
        if not 1 <= self.min_groups <= self.max_groups:
            raise ConfigError(f"need 1 <= min_groups ({self.min_groups}) <= max_groups ({self.max_groups})")
        if not 1 <= self.max_waiting_sessions <= self.max_ingress_sessions:
            raise ConfigError(f"max_waiting_sessions ({self.max_waiting_sessions}) must be between 1 and "
                              f"max_ingress_sessions ({self.max_ingress_sessions}): only sessions it serves wait")
        if self.min_ingress_replicas > self.max_ingress_replicas:
            raise ConfigError(f"min_ingress_replicas ({self.min_ingress_replicas}) must be at most "
                              f"max_ingress_replicas ({self.max_ingress_replicas})")
        if self.max_ingress_connections < self.max_ingress_sessions + HEALTH_ROOM:
            raise ConfigError(f"max_ingress_connections ({self.max_ingress_connections}) must be at least "
                              f"max_ingress_sessions + {HEALTH_ROOM} ({self.max_ingress_sessions + HEALTH_ROOM}): "
                              "room for the refusals and the health routes")


@dataclass(frozen=True)
class PacingSettings(SettingsConcern):
    """Pacing and delivery: how far each session runs ahead of real time, and how many chunks it has in flight."""
    fps: float = setting(16.0, "frames per second of the sessions' video (real time)", above=0)
    max_fps: Optional[float] = setting(None, "the highest fps a session may ask for; null: fps (capacity is "
                                             "counted at fps: a faster session needs more chunks a second and, "
                                             "always late, would be run first, stalling its group's others)")
    pacing: str = setting("adaptive", "fixed: always pacing_lead_s ahead; adaptive: a lead learned per session, "
                                      "at most pacing_lead_s")
    pacing_lead_s: float = setting(1.5, "how far a session may run ahead of real time (adaptive: at most)",
                                   above=0)
    pacing_margin_s: float = setting(0.1, "adaptive: slack kept above the needed lead", at_least=0)
    pacing_quantile: float = setting(0.9, "adaptive: the share of recent chunks the lead must cover")
    restart_stale_chunks: bool = setting(False, "a control arriving in a chunk's probes restarts the chunk with "
                                                "the control")
    max_in_flight_chunks: Optional[int] = setting(None, "chunks per session generated but not yet delivered (the "
                                                        "ranks start the next while the last is encoded and sent); "
                                                        "null: 2 on accelerators, 1 on cpu", at_least=1)
    quality_ladder: str = setting("off", "off: every chunk at full quality; auto: each session's chunks on the "
                                         "step rung its group's load allows (deployments/group/ladder.py); "
                                         "a redeploy that changes only this switches running groups in place")
    quality_floor: str = setting("steps2", "the lowest rung the ladder may choose: steps3, steps2, or with both "
                                           "decoders loaded (decoder: wan,tae) tiny_steps2 (the tiny decoder)")

    @property
    def quality_rungs(self) -> tuple[str, ...]:
        """The rungs a session may run at or pin (extra_params.quality): full down to quality_floor."""
        return LADDER[:LADDER.index(self.quality_floor) + 1]

    def check(self) -> None:
        if self.pacing not in ("fixed", "adaptive"):
            raise ConfigError(f"pacing {self.pacing!r} must be fixed or adaptive")
        if not 0 < self.pacing_quantile <= 1:
            raise ConfigError(f"pacing_quantile must be in (0, 1], got {self.pacing_quantile}")
        if self.max_fps is not None and not self.fps <= self.max_fps <= 120:
            raise ConfigError(f"max_fps must be between fps ({self.fps:g}) and 120, got {self.max_fps:g}")
        if self.quality_ladder not in ("off", "auto"):
            raise ConfigError(f"quality_ladder {self.quality_ladder!r} must be off or auto")
        if self.quality_floor not in LADDER[1:]:
            raise ConfigError(f"quality_floor {self.quality_floor!r} must be one of {list(LADDER)[1:]}")


@dataclass(frozen=True)
class ContinuitySettings(SettingsConcern):
    """Continuity: a session whose group fails (resume) or stops (drain) goes on on another one."""
    resume_sessions: bool = setting(True, "a session whose group fails goes on on another (or the rebuilt) one")
    resume_wait_s: float = setting(120.0, "how long a failed session waits for a group to resume on", above=0)
    max_resumes: int = setting(3, "resumes after failures per session (a session that breaks every group is "
                                  "ended; drain moves are not counted)", at_least=0)
    snapshots: bool = setting(True, "each chunk's state to the object store, so a resume restores it instead "
                                    "of replaying the session")
    snapshot_interval_chunks: int = setting(1, "snapshot every k-th chunk (each copies the K/V slots no earlier one "
                                               "did): a resume replays at most k - 1 delivered chunks after the "
                                               "newest snapshot; 1: every chunk", at_least=1)
    snapshot_host_budget_gib: Optional[float] = setting(
        None, "host memory a group's snapshots may use (its ranks' pinned copies and what the keeper holds for its "
              "sessions, `lingbot snapshot-budget`); sessions beyond it run without snapshots (a resume replays "
              "them) and a warning says so; null: 30% of the node's memory (Ray's default object store), shared "
              "among the node's groups by their part of its accelerators", at_least=0)


@dataclass(frozen=True)
class DrainSettings(SettingsConcern):
    """Drain: a group Serve is stopping (scale-down, redeploy) moves its sessions to another group."""
    drain_poll_s: float = setting(2.0, "how often a group asks Serve whether it is being stopped, to move its "
                                       "sessions (scale-down, redeploy); 0: never (they end with it)", at_least=0,
                                  why=" (0 turns draining off)")
    drain_lead_s: float = setting(3.0, "a stopping group first runs each session this far ahead of its playback "
                                       "(for at most drain_fill_max_s), so the move plays out of the buffer; 0: no "
                                       "fill", at_least=0)
    drain_margin_s: float = setting(30.0, "a stopping group moves its sessions at the latest this long before Serve "
                                          "kills it (graceful_shutdown_timeout_s)", above=0)
    drain_flush_timeout_s: float = setting(10.0, "a draining group waits this long for the snapshots of its "
                                                 "sessions' last chunks", above=0)
    drain_fill_max_s: float = setting(10.0, "a draining group runs its sessions ahead (drain_lead_s) for at most "
                                            "this long", above=0)
    drain_wait_new_s: float = setting(30.0, "how long a stopping group waits for a new group before going to the "
                                            "old ones", above=0)
    drain_new_group_slack_s: float = setting(10.0, "a group started this long before the first stop was seen still "
                                                   "counts as new", at_least=0)


@dataclass(frozen=True)
class EncoderSettings(SettingsConcern):
    """The muxer's H.264 encoder."""
    encoder: str = setting("auto", f"one of {list(H264_ENCODERS)} (auto: NVENC where the muxer sees a GPU, "
                                   "else x264)")
    encoder_preset: str = setting("veryfast", "the encoder's preset (x264: ultrafast..veryslow; NVENC: p1..p7)")
    encoder_threads: int = setting(0, "encoder threads; 0: the encoder's choice", at_least=0)

    def check(self) -> None:
        if self.encoder not in H264_ENCODERS:
            raise ConfigError(f"encoder {self.encoder!r} is not one of {list(H264_ENCODERS)}")

    @property
    def h264_settings(self) -> H264Settings:
        return H264Settings(self.encoder, self.encoder_preset, threads=self.encoder_threads)


def parse_allowlist(text: str) -> tuple[str, ...]:
    """image_url_allowlist's value -> its prefixes: "https://cdn.example.com/images/, http://10.0.0.5:8080/" ->
    ("https://cdn.example.com/images/", "http://10.0.0.5:8080/"); ValueError for a bad one. The ingress's
    fetcher (deployments/ingress/fetch.py) fetches only under these."""
    prefixes = tuple(p.strip() for p in text.split(",") if p.strip())
    for p in prefixes:
        parts = urlsplit(p)
        if parts.scheme not in ("http", "https") or not parts.hostname or not p.endswith("/") \
                or "@" in parts.netloc or parts.query or parts.fragment:
            raise ValueError(f"image_url_allowlist entry {p!r} must be scheme://host[:port]/path/ (http or https, "
                             f"ending in '/', no credentials or query)")
    return prefixes


@dataclass(frozen=True)
class AccessSettings(SettingsConcern):
    """Access: who may open sessions, how many, from which pages, and which images the server fetches."""
    api_keys: str = setting("", "comma-separated API keys; when set, clients must present one (see README)",
                            secret=True)
    allow_anonymous: bool = setting(False, "serve clients without api_keys on an address beyond this machine "
                                           "(0.0.0.0, a LAN or public one) on purpose; without it such an app "
                                           "refuses to start (a missing keys Secret would open the GPUs to anyone)")
    max_sessions_per_key: int = setting(8, "sessions one key (or client address, without keys) may hold at "
                                           "once; 0: no limit", at_least=0)
    max_starts_per_minute_per_key: int = setting(60, "session starts per key (or client address) per minute; "
                                                     "0: no limit", at_least=0)
    max_failed_keys_per_minute: int = setting(10, "wrong API keys one client address may present per minute; past "
                                                  "them its connections are refused (rate_limited) before a key "
                                                  "is compared; 0: no limit", at_least=0)
    max_connections_per_address: int = setting(16, "WebSocket connections one client address may hold open at "
                                                   "once, started or not; 0: no limit", at_least=0)
    trusted_proxies: str = setting("", "comma-separated addresses or networks (CIDR) of proxies in front of the "
                                       "server whose X-Forwarded-For names the client; empty: the client's address "
                                       "is the connection's (behind a proxy every client would share the proxy's)")
    allowed_origins: str = setting("", "comma-separated page origins besides the server's own that may open a "
                                       "WebSocket (*: any)")
    allowed_hosts: str = setting("localhost", "comma-separated host names clients may reach the server by to open a "
                                              "session (IP addresses always may; *: any name): others are refused, "
                                              "against DNS rebinding")
    image_url_allowlist: str = setting("", "comma-separated URL prefixes (scheme://host[:port]/path/) image_url "
                                           "and first_frame may be fetched from; empty: none (inline images only)")
    image_fetch_timeout_s: float = setting(10.0, "time limit of one image fetch, start to end", above=0)
    image_fetch_max_bytes: int = setting(20 * 2 ** 20, "size limit of one fetched image", above=0)
    max_header_bytes: int = setting(16 * 2 ** 10, "a WebSocket handshake whose headers (names and values) are "
                                                  "larger is refused (headers_too_large)", above=0)

    def check(self) -> None:
        try:
            parse_allowlist(self.image_url_allowlist)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        try:
            everyone = [str(n) for n in self.trusted_proxy_networks if n.prefixlen == 0]
        except ValueError:
            raise ConfigError(f"trusted_proxies {self.trusted_proxies!r} must be addresses or networks "
                              "(10.0.0.0/8, ::1), comma-separated") from None
        short = [k for k in self.api_key_set if len(k) < MIN_KEY_CHARS]
        if short:
            raise ConfigError(f"{len(short)} of the api_keys are shorter than {MIN_KEY_CHARS} characters: a short key "
                              "is guessed; make them long and random (openssl rand -hex 24)")
        if everyone:
            raise ConfigError(f"trusted_proxies {', '.join(everyone)} trusts every address: any client could name "
                              "any address in X-Forwarded-For (and so escape the per-address limits); name your "
                              "proxies' addresses or networks")

    @property
    def allowed_host_set(self) -> frozenset:
        return frozenset(h.strip().lower().rstrip(".") for h in self.allowed_hosts.split(",") if h.strip())

    @property
    def allowed_origin_set(self) -> frozenset:
        return frozenset(o.strip().rstrip("/") for o in self.allowed_origins.split(",") if o.strip())

    @property
    def api_key_set(self) -> frozenset:
        return frozenset(k.strip() for k in self.api_keys.split(",") if k.strip())

    @property
    def trusted_proxy_networks(self) -> tuple:
        return parse_networks(self.trusted_proxies)


@dataclass(frozen=True)
class SessionLimits(SettingsConcern):
    """One session's limits: timeouts, message sizes, length."""
    start_timeout_s: float = setting(10.0, "session.start must arrive this soon after connecting", above=0)
    stall_timeout_s: float = setting(60.0, "a send to the client blocked this long (not reading, or gone) ends "
                                           "the session", above=0)
    stall_max_bytes: int = setting(64 * 2 ** 20, "bytes a session's client may leave unread in Serve's proxy; past "
                                                 "it the session ends as after stall_timeout_s (raw frames come at "
                                                 "about 19 MB a second)", at_least=1)
    idle_timeout_s: float = setting(300.0, "no interaction for this long ends the session", above=0)
    max_lifetime_s: float = setting(3600.0, "a session ends after this long", above=0)
    max_start_bytes: int = setting(4 * 2 ** 20, "size limit of the session.start message (with its image)",
                                   at_least=1)
    max_control_bytes: int = setting(128 * 2 ** 10, "size limit of any later client message", at_least=1)
    max_queued_controls: int = setting(64, "client messages queued per session (flow control)", at_least=1)
    max_messages_per_s: float = setting(50.0, "client messages a session may send per second, in bursts of twice "
                                              "that; past it a message is dropped (one rate_limited a second)",
                                      above=0)
    default_chunks: int = setting(8, "chunks of a session whose session.start gives no num_frames", at_least=1)
    max_chunks: int = setting(100000, "chunks one session may ask for, at most")

    def check(self) -> None:
        if self.default_chunks > self.max_chunks:
            raise ConfigError(f"default_chunks ({self.default_chunks}) must be <= max_chunks ({self.max_chunks})")


@dataclass(frozen=True)
class HealthSettings(SettingsConcern):
    """Group health: when a group counts as failed, and how often it reports metrics."""
    group_start_timeout_s: float = setting(1800.0, "rank actors up, joined, loaded and warmed up within this (sized "
                                                   "for 8 ranks cold-loading ~45 GiB each from a shared volume, "
                                                   "then compiling; tiny on CPU takes well under a minute)", above=0)
    collective_timeout_s: float = setting(120.0, "timeout of the ranks' collectives (NCCL, HCCL, gloo)", above=0)
    chunk_timeout_s: float = setting(600.0, "a chunk not back from every rank by then fails the group (a hung "
                                            "collective may raise nothing at the call site)", above=0)
    metrics_interval_s: float = setting(5.0, "how often a group exports its metrics", above=0)


@dataclass(frozen=True)
class SpectatorSettings(SettingsConcern):
    """Viewers of shared sessions (deployments/session/audience.py): how many, and how far one may fall behind."""
    max_viewers_per_session: int = setting(100, "viewers one shared session may have at one ingress replica (0: "
                                                "sessions cannot be shared)", at_least=0)
    max_viewers: int = setting(1000, "viewers one ingress replica serves in all", at_least=0)
    spectators_need_key: bool = setting(True, "with api_keys, a viewer presents a key too (never in the watch URL)")
    viewer_queue_chunks: int = setting(4, "chunks a viewer may hold unsent; past it (or viewer_queue_bytes) it "
                                          "skips to the next keyframe", at_least=1)
    viewer_queue_bytes: int = setting(16 * 2 ** 20, "bytes a viewer may hold unsent", at_least=1)
    viewer_max_skips: int = setting(3, "a viewer that skipped this often is cut (viewer_too_slow)", at_least=1)
    viewer_keyframe_chunks: int = setting(4, "while a shared session has viewers, a keyframe at least every this many "
                                             "chunks (where a viewer that skipped starts again)", at_least=1)


@dataclass(frozen=True)
class RecordingSettings(SettingsConcern):
    """Recordings of sessions (deployments/session/recording.py): where they go, how long and how much is kept."""
    record_sessions: bool = setting(False, "record every session of the first protocol unless its start says "
                                           "extra_params.record: false")
    recordings_dir: str = setting("~/lingbot-recordings", "where recordings are stored: a folder, or an fsspec URL "
                                                         "(s3://bucket/prefix with s3fs installed, memory:// in tests)")
    recording_keep_s: float = setting(7 * 86400.0, "a recording is deleted this long after it was written",
                                      above=0)
    recordings_max_bytes: int = setting(10 * 2 ** 30, "the recordings kept in all; past it the oldest go first",
                                        at_least=0)
    recording_spool_bytes: int = setting(64 * 2 ** 20, "a session's video waiting to be written; past it (a disk "
                                                       "too slow) its recording stops", at_least=1)



@dataclass(frozen=True)
class WorldSettings(SettingsConcern):
    """Saved worlds (deployments/session/worlds.py): where they go, how long and how many a key keeps."""
    worlds_dir: str = setting("~/lingbot-worlds", "where saved worlds are stored: a folder, or an fsspec URL; empty: "
                                                  "session.save and world_id are refused (worlds_off)")
    world_keep_s: float = setting(30 * 86400.0, "a world is deleted this long after it was saved", above=0)
    max_worlds_per_key: int = setting(100, "worlds one API key (or, without keys, everybody) may keep", at_least=1)
    max_world_bytes_per_key: int = setting(2 ** 30, "bytes of worlds one API key may keep", at_least=1)
    max_world_chunks: int = setting(4000, "chunks a saved world may hold (a resume replays those after its snapshot)",
                                    at_least=1)
    max_world_snapshot_bytes: int = setting(256 * 2 ** 20, "a saved world keeps the snapshot of its newest restore "
                                                           "point up to this size (a resume restores it, then "
                                                           "replays the chunks after it); 0: never (a resume replays "
                                                           "every chunk). At 14B one is ~24 GiB", at_least=0)

# the concerns by name, in the order describe() and the settings command list them
CONCERNS: dict[str, type[SettingsConcern]] = {
    "model": ModelSettings, "placement": PlacementSettings, "capacity": CapacitySettings, "pace": PacingSettings,
    "continuity": ContinuitySettings, "drain": DrainSettings, "encoding": EncoderSettings, "access": AccessSettings,
    "limits": SessionLimits, "spectators": SpectatorSettings, "recordings": RecordingSettings,
    "worlds": WorldSettings, "health": HealthSettings,
}
# flat key -> (its concern's name, its field), in the concerns' order
KEYS: dict[str, tuple[str, dataclasses.Field]] = {
    f.name: (concern, f) for concern, cls in CONCERNS.items() for f in dataclasses.fields(cls)}
