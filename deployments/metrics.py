"""Metrics through Ray's metrics API (they appear on the node's metrics endpoint and the dashboard).

Defined lazily (inside a Ray worker) and recorded by the ingress and the group replica. Per-rank device
utilisation and memory are measured by each rank on its own device (RankWorker.device_stats; on
CPU the device is the rank's process)."""
from __future__ import annotations

CHUNK_BUCKETS = [0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0]
STAGE_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0]


class Metrics:
    def __init__(self):
        from ray.util import metrics as m
        self.active_sessions = m.Gauge("lingbot_active_sessions", "sessions running on a group", tag_keys=("group",))
        self.chunk_interval = m.Histogram("lingbot_chunk_interval_seconds", "time between a session's chunks",
                                          boundaries=CHUNK_BUCKETS, tag_keys=("group",))
        self.stage = m.Histogram("lingbot_stage_seconds", "per-chunk stage time", boundaries=STAGE_BUCKETS,
                                 tag_keys=("stage",))
        self.rtf = m.Gauge("lingbot_video_rtf", "wall seconds per video second of a session's last chunk "
                           "(< 1 is real time)", tag_keys=("group",))
        self.stalls = m.Counter("lingbot_stalls_total", "chunks that arrived after the player ran dry",
                                tag_keys=("group",))
        self.chunks = m.Counter("lingbot_chunks_total", "chunks run, by the rung they ran at (quality: full, steps3, "
                                "steps2)", tag_keys=("group", "quality"))
        self.refusals = refusals_counter()
        self.sessions_total = m.Counter("lingbot_sessions_total", "sessions started", tag_keys=("component",))
        self.unknown_fields = m.Counter("lingbot_unknown_start_fields_total", "fields of session starts this server "
                                        "does not know (ignored, as the peers ignore them)")
        self.resumes = m.Counter("lingbot_session_resumes_total", "sessions continued on another group after a "
                                 "fault or while their group was stopped (outcome: resumed, failed; reason: fault, "
                                 "drain)", tag_keys=("outcome", "reason"))
        self.viewers = m.Gauge("lingbot_viewers", "viewers watching shared sessions at an ingress replica")
        self.video_bytes = m.Counter("lingbot_video_bytes_total", "video bytes sent to clients, by role (owner: the "
                                     "session's own client; viewer: a shared session's)", tag_keys=("role",))
        self.viewer_skips = viewer_skips_counter()
        self.recordings = m.Counter("lingbot_recordings_total", "session recordings by outcome (written; empty: no "
                                    "chunk; disk, slow_disk: stopped by the disk; failed: a server fault)",
                                    tag_keys=("outcome",))
        self.recording_bytes = m.Counter("lingbot_recording_bytes_total", "bytes of the recordings written (MP4)")
        self.unprotected = m.Gauge("lingbot_proxy_protection_missing",
                                   "1 where the Ray cluster started without a proxy-side protection "
                                   "(deployments/ingress/front.py, PROTECTIONS), else 0", tag_keys=("protection",))
        self.device_util = m.Gauge("lingbot_rank_device_utilization",
                                   "device utilisation per rank, percent (GPU: kernel time; CPU: of one core)",
                                   tag_keys=("group", "rank"))
        self.device_memory = m.Gauge("lingbot_rank_device_memory_bytes",
                                     "device memory used per rank (GPU: device memory; CPU: resident memory)",
                                     tag_keys=("group", "rank"))


def viewer_skips_counter():
    """Viewers that fell behind and skipped to the next keyframe, by where their queue was (ingress; door: Serve's
    proxy, deployments/ingress/pacing_door.py). A viewer cut for it is a refusal (viewer_too_slow)."""
    from ray.util import metrics as m
    return m.Counter("lingbot_viewer_skips_total", "viewers that fell behind and skipped to a keyframe",
                     tag_keys=("where",))


def refusals_counter():
    """Refusals by code: the ingress's, and the proxies' doors' (deployments/ingress/front.py)."""
    from ray.util import metrics as m
    return m.Counter("lingbot_refusals_total", "refused requests and messages", tag_keys=("code",))
