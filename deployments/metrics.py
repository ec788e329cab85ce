"""Metrics through Ray's metrics API (they appear on the node's metrics endpoint and the dashboard).

Defined lazily (inside a Ray worker) and recorded by the ingress and the group replica."""
from __future__ import annotations

import logging

log = logging.getLogger(__name__)

CHUNK_BUCKETS = [0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0]
STAGE_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0]


class Metrics:
    def __init__(self, component: str):
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
        self.refusals = m.Counter("lingbot_refusals_total", "refused requests and messages", tag_keys=("code",))
        self.sessions_total = m.Counter("lingbot_sessions_total", "sessions started", tag_keys=("component",))
        self.gpu_util = m.Gauge("lingbot_rank_gpu_utilization", "GPU utilisation per rank (NVML)",
                                tag_keys=("group", "rank"))
        self.gpu_memory = m.Gauge("lingbot_rank_gpu_memory_bytes", "GPU memory used per rank (NVML)",
                                  tag_keys=("group", "rank"))
        self.component = component


def gpu_stats() -> list[dict]:
    """Per visible GPU: utilisation (%) and memory used (bytes); [] where there is no NVIDIA GPU."""
    try:
        import pynvml
        pynvml.nvmlInit()
    except Exception:
        return []
    out = []
    try:
        for i in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            util = pynvml.nvmlDeviceGetUtilizationRates(handle)
            mem = pynvml.nvmlDeviceGetMemoryInfo(handle)
            out.append({"index": i, "utilization": util.gpu, "memory_used": mem.used})
    except Exception as e:          # a driver hiccup must not take the group down
        log.warning("NVML query failed: %s", e)
    return out
