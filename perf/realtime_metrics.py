"""Realtime streaming metrics, defined as the vLLM-Omni LingBot-World realtime benchmark defines them so
numbers compare across servers (docs/architecture.md, "Metrics"):

- TTFC: from just after session.start is sent to the arrival of the first chunk's binary bytes.
- Inter-arrival of chunk i (i >= 1): arrival(i) - arrival(i-1), arrivals taken when the binary arrives.
  "all" = chunks 1..N-1; "steady" = chunks with index >= warmup_chunks (6: the attention window is full).
  Summaries: count, mean, median, sample std (n-1), min, p90, p95, p99, max; percentiles interpolate
  linearly between order statistics (numpy's default).
- VIDEO_RTF = session wall seconds / video seconds (sum of num_frames / fps); < 1 is real time.
  VIDEO_RTFX is its reciprocal. Steady RTF = sum of steady intervals / their chunks' video seconds.
- Chunk deadline = 12 / fps (the video one chunk adds); SLO attainment = share of steady intervals
  within the deadline.
- Player: starts when chunk (buffer_chunks - 1) has arrived; plays each chunk's frames at fps; a chunk
  that arrives after the play cursor is an underrun: the stall (arrival - cursor) is added and play
  resumes at once. Stall ratio = total stall / playback span (video + stalls).
- Control-to-display latency of an interaction: from the moment the client sent it to the moment the
  player shows the first frame generated with it, i.e. the play start (in the player above) of the first
  chunk whose metadata lists the event in started_event_ids. Events no chunk started are counted apart.
"""
from __future__ import annotations

import collections
import itertools
import math
from collections.abc import Sequence
from typing import Optional

from lingbot.stats import percentile


def sample_std(values: Sequence[float]) -> float:
    if len(values) < 2:
        return 0.0
    mean = sum(values) / len(values)
    return math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))


def latency_summary(values_ms: Sequence[float]) -> dict:
    values = list(values_ms)
    if not values:
        return {"count": 0}
    return {"count": len(values), "mean_ms": sum(values) / len(values), "median_ms": percentile(values, 0.5),
            "std_ms": sample_std(values), "min_ms": min(values), "p90_ms": percentile(values, 0.90),
            "p95_ms": percentile(values, 0.95), "p99_ms": percentile(values, 0.99), "max_ms": max(values)}


def simulate_playback(chunks: Sequence[dict], fps: float, buffer_chunks: int = 1) -> dict:
    """chunks: dicts with index, arrival_s (relative to the start), num_frames."""
    ordered = sorted(chunks, key=lambda c: c["index"])
    if not ordered:
        return {"buffer_chunks": buffer_chunks, "underrun_count": 0, "total_stall_ms": 0.0, "playback_span_s": 0.0,
                "stall_ratio": 0.0, "first_underrun_chunk": None}
    buffer_chunks = max(1, min(buffer_chunks, len(ordered)))
    start = cursor = ordered[buffer_chunks - 1]["arrival_s"]
    stall, underruns, first, play_start = 0.0, 0, None, {}
    for chunk in ordered:
        if chunk["arrival_s"] > cursor:
            stall += chunk["arrival_s"] - cursor
            underruns += 1
            first = chunk["index"] if first is None else first
            cursor = chunk["arrival_s"]
        play_start[chunk["index"]] = cursor              # the chunk's first frame is on screen
        cursor += chunk["num_frames"] / fps
    span = cursor - start
    return {"buffer_chunks": buffer_chunks, "underrun_count": underruns, "total_stall_ms": stall * 1e3,
            "playback_span_s": span, "stall_ratio": stall / span if span > 0 else 0.0, "first_underrun_chunk": first,
            "play_start_s": play_start}


def control_latencies(controls: Sequence[dict], chunks: Sequence[dict], play_start: dict) -> tuple[list, list]:
    """controls: dicts with event_id and sent_s; chunks: dicts with index and started (event ids the chunk
    started). Returns (latencies in ms of the events a chunk started, event ids no chunk started)."""
    first_chunk: dict = {}
    for chunk in sorted(chunks, key=lambda c: c["index"]):
        for event_id in chunk.get("started") or ():
            first_chunk.setdefault(event_id, chunk["index"])
    shown, missing = [], []
    for control in controls:
        k = first_chunk.get(control["event_id"])
        if k is None or k not in play_start:
            missing.append(control["event_id"])
        else:
            shown.append((play_start[k] - control["sent_s"]) * 1e3)
    return shown, missing


def session_metrics(chunks: Sequence[dict], wall_s: Optional[float], fps: float, warmup_chunks: int = 6,
                    slo_ms: Optional[float] = None, buffer_chunks: int = 1,
                    controls: Sequence[dict] = ()) -> dict:
    """chunks: dicts with index, arrival_s (seconds since session.start was sent), num_frames, byte_length,
    quality (the chunk's rung; absent: full), restarted (truthy: run again for a control) and (for control
    latency) started; controls: the interactions sent, with event_id and sent_s."""
    ordered = sorted(chunks, key=lambda c: c["index"])
    deadline_ms = slo_ms if slo_ms is not None else 12.0 / fps * 1e3
    intervals = [(c["index"], (c["arrival_s"] - p["arrival_s"]) * 1e3, c["num_frames"])
                 for p, c in itertools.pairwise(ordered)]
    steady = [(i, ms, n) for i, ms, n in intervals if i >= warmup_chunks]
    frames = sum(c["num_frames"] for c in ordered)
    video_s = frames / fps
    wall = wall_s if wall_s is not None else (ordered[-1]["arrival_s"] if ordered else 0.0)
    out = {
        "chunks_received": len(ordered), "warmup_chunks": warmup_chunks, "steady_chunks": len(steady),
        "steady_state_reached": bool(steady), "total_frames": frames,
        "total_bytes": sum(c.get("byte_length", 0) for c in ordered), "video_seconds": video_s,
        "wall_seconds": wall, "video_rtf": wall / video_s if video_s else math.nan,
        "video_rtfx": video_s / wall if wall else math.nan, "frames_per_second": frames / wall if wall else math.nan,
        "chunk_deadline_ms": deadline_ms, "ttfc_ms": ordered[0]["arrival_s"] * 1e3 if ordered else math.nan,
        "interval_all": latency_summary([ms for _, ms, _ in intervals]),
        "interval_steady": latency_summary([ms for _, ms, _ in steady]),
        "playback": simulate_playback(ordered, fps, buffer_chunks),
        "chunks_per_rung": dict(collections.Counter(c.get("quality", "full") for c in ordered)),
        # run again once for a control that arrived in its probes (restart_stale_chunks)
        "chunks_restarted": sum(1 for c in ordered if c.get("restarted")),
    }
    shown, missing = control_latencies(controls, ordered, out["playback"]["play_start_s"])
    out["control_to_display"] = latency_summary(shown)
    out["control_latencies_ms"] = shown
    out["controls_sent"], out["controls_not_shown"] = len(controls), len(missing)
    if steady:
        steady_wall = sum(ms for _, ms, _ in steady) / 1e3
        steady_video = sum(n for _, _, n in steady) / fps
        late = sum(1 for _, ms, _ in steady if ms > deadline_ms)
        out.update(steady_video_rtf=steady_wall / steady_video, steady_video_rtfx=steady_video / steady_wall,
                   slo_attainment=1 - late / len(steady), slo_violations=late)
    return out


def aggregate(sessions: Sequence[dict]) -> dict:
    """Across sessions (per-session metrics dicts)."""
    if len(sessions) == 1:
        return {"sessions": 1, **sessions[0]}
    steady = [s["interval_steady"]["mean_ms"] for s in sessions if s["interval_steady"]["count"]]
    rtf = [s["video_rtf"] for s in sessions]
    ttfc = [s["ttfc_ms"] for s in sessions]
    pooled = [s for s in sessions if s["interval_steady"]["count"]]
    weights = sum(s["interval_steady"]["count"] for s in pooled)
    return {
        "sessions": len(sessions), "chunks_received": sum(s["chunks_received"] for s in sessions),
        "total_frames": sum(s["total_frames"] for s in sessions),
        "video_seconds": sum(s["video_seconds"] for s in sessions),
        "wall_seconds": sum(s["wall_seconds"] for s in sessions),
        "video_rtf_mean": sum(rtf) / len(rtf), "video_rtf_best": min(rtf), "video_rtf_worst": max(rtf),
        "ttfc_ms_mean": sum(ttfc) / len(ttfc), "ttfc_ms_max": max(ttfc),
        "steady_interval_ms_mean": (sum(s["interval_steady"]["mean_ms"] * s["interval_steady"]["count"]
                                        for s in pooled) / weights) if weights else math.nan,
        "steady_interval_ms_spread": (max(steady) - min(steady)) if steady else math.nan,
        "underrun_count": sum(s["playback"]["underrun_count"] for s in sessions),
        "stall_ratio_mean": sum(s["playback"]["stall_ratio"] for s in sessions) / len(sessions),
        "control_to_display": latency_summary([ms for s in sessions for ms in s.get("control_latencies_ms", [])]),
        "chunk_deadline_ms": sessions[0]["chunk_deadline_ms"],
        "chunks_restarted": sum(s["chunks_restarted"] for s in sessions),
        "chunks_per_rung": dict(sum((collections.Counter(s["chunks_per_rung"]) for s in sessions),
                                    collections.Counter())),
    }
