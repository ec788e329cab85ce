"""Realtime metric arithmetic against hand-computed cases."""
import math

import pytest

from perf.realtime_metrics import aggregate, latency_summary, percentile, sample_std, session_metrics, simulate_playback


def test_percentiles_and_std_by_hand():
    assert percentile([10, 20, 30, 40], 0.5) == 25
    assert percentile([40, 10, 30, 20], 0.9) == pytest.approx(37.0)      # pos 2.7: 30 + 0.7 * 10
    assert percentile([5], 0.99) == 5
    assert math.isnan(percentile([], 0.5))
    assert sample_std([2, 4, 4, 4, 5, 5, 7, 9]) == pytest.approx(math.sqrt(32 / 7))
    assert sample_std([3]) == 0.0
    s = latency_summary([100, 200, 300])
    assert (s["count"], s["mean_ms"], s["median_ms"], s["min_ms"], s["max_ms"]) == (3, 200, 200, 100, 300)
    assert s["p95_ms"] == pytest.approx(290) and s["std_ms"] == pytest.approx(100)


def _chunks(arrivals):
    return [{"index": i, "arrival_s": t, "num_frames": 9 if i == 0 else 12, "byte_length": 100}
            for i, t in enumerate(arrivals)]


def test_player_simulation_by_hand():
    # fps 12: chunk 0 plays 0.75 s, later chunks 1.0 s. Arrivals 1.0, 1.5, 3.0, 3.5
    p = simulate_playback(_chunks([1.0, 1.5, 3.0, 3.5]), fps=12, buffer_chunks=1)
    # cursor: 1.0 -> 1.75; chunk 1 at 1.5 ok -> 2.75; chunk 2 at 3.0: stall 0.25, cursor 3.0 -> 4.0; chunk 3 ok -> 5.0
    assert p["underrun_count"] == 1 and p["first_underrun_chunk"] == 2
    assert p["total_stall_ms"] == pytest.approx(250)
    assert p["playback_span_s"] == pytest.approx(4.0)
    assert p["stall_ratio"] == pytest.approx(0.25 / 4.0)
    p2 = simulate_playback(_chunks([1.0, 1.5, 3.0, 3.5]), fps=12, buffer_chunks=2)
    # start at chunk 1's arrival 1.5: 1.5 -> 2.25 -> 3.25; chunk 2 at 3.0 ok -> 4.25; chunk 3 ok -> 5.25
    assert p2["underrun_count"] == 0 and p2["playback_span_s"] == pytest.approx(3.75)


def test_session_metrics_by_hand():
    arrivals = [0.5] + [0.5 + 0.7 * i for i in range(1, 8)] + [0.5 + 0.7 * 7 + 0.9]   # 9 chunks
    m = session_metrics(_chunks(arrivals), wall_s=6.5, fps=16, warmup_chunks=6)
    assert m["ttfc_ms"] == pytest.approx(500)
    assert m["total_frames"] == 9 + 12 * 8 and m["video_seconds"] == pytest.approx(105 / 16)
    assert m["video_rtf"] == pytest.approx(6.5 / (105 / 16)) and m["video_rtfx"] == pytest.approx(105 / 16 / 6.5)
    assert m["chunk_deadline_ms"] == pytest.approx(750)
    assert m["interval_all"]["count"] == 8 and m["interval_steady"]["count"] == 3      # chunks 6, 7, 8
    assert m["interval_steady"]["max_ms"] == pytest.approx(900)
    assert m["slo_attainment"] == pytest.approx(2 / 3) and m["slo_violations"] == 1
    assert m["steady_video_rtf"] == pytest.approx((0.7 + 0.7 + 0.9) / (36 / 16))
    assert m["chunks_per_rung"] == {"full": 9}                  # no chunk names its rung: full
    short = session_metrics(_chunks([0.5, 1.0, 1.5]), wall_s=2.0, fps=16)
    assert not short["steady_state_reached"] and "slo_attainment" not in short


def test_aggregate():
    a = session_metrics(_chunks([0.5 + 0.5 * i for i in range(8)]), wall_s=4.0, fps=16)
    b = session_metrics(_chunks([1.0 + 1.0 * i for i in range(8)]), wall_s=8.0, fps=16)
    agg = aggregate([a, b])
    assert agg["sessions"] == 2 and agg["ttfc_ms_max"] == pytest.approx(1000)
    assert agg["video_rtf_best"] == a["video_rtf"] and agg["video_rtf_worst"] == b["video_rtf"]
    assert agg["steady_interval_ms_mean"] == pytest.approx(750)
    assert agg["steady_interval_ms_spread"] == pytest.approx(500)
    assert aggregate([a])["sessions"] == 1 and aggregate([a])["video_rtf"] == a["video_rtf"]
    laddered = _chunks([0.5 + 0.5 * i for i in range(8)])
    for c, rung in zip(laddered, ["full"] * 3 + ["steps3"] * 2 + ["steps2"] * 3):
        c["quality"] = rung
    c = session_metrics(laddered, wall_s=4.0, fps=16)
    assert c["chunks_per_rung"] == {"full": 3, "steps3": 2, "steps2": 3}
    assert aggregate([a, c])["chunks_per_rung"] == {"full": 11, "steps3": 2, "steps2": 3}


def test_control_to_display_by_hand():
    # fps 12, arrivals 1.0, 1.5, 3.0, 3.5: play starts 1.0, 1.75, 3.0 (after a 0.25 s stall), 4.0
    chunks = _chunks([1.0, 1.5, 3.0, 3.5])
    for c, started in zip(chunks, [[], ["a"], ["b", "c"], []]):
        c["started"] = started
    controls = [{"event_id": "a", "sent_s": 0.9}, {"event_id": "b", "sent_s": 1.6},
                {"event_id": "c", "sent_s": 2.0}, {"event_id": "d", "sent_s": 3.2}]      # d: no chunk started it
    m = session_metrics(chunks, None, fps=12, controls=controls)
    assert m["playback"]["play_start_s"] == {0: 1.0, 1: 1.75, 2: 3.0, 3: 4.0}
    assert m["control_latencies_ms"] == pytest.approx([850.0, 1400.0, 1000.0])       # 1.75-0.9, 3.0-1.6, 3.0-2.0
    s = m["control_to_display"]
    assert s["count"] == 3 and s["median_ms"] == pytest.approx(1000.0) and s["max_ms"] == pytest.approx(1400.0)
    assert (m["controls_sent"], m["controls_not_shown"]) == (4, 1)
    assert m["chunks_restarted"] == 0
    chunks[2]["restarted"] = 1.0                     # run again once for a control in its probes (the server says)
    assert session_metrics(chunks, None, fps=12, controls=controls)["chunks_restarted"] == 1
    # with a 2-chunk start buffer every chunk plays later: the same events show 0.5 s later... except that
    # chunk 2 no longer stalls (start 1.5: 1.5, 2.25, 3.25, 4.25)
    m2 = session_metrics(chunks, None, fps=12, buffer_chunks=2, controls=controls)
    assert m2["control_latencies_ms"] == pytest.approx([1350.0, 1650.0, 1250.0])
    both = aggregate([m, m2])
    assert both["control_to_display"]["count"] == 6 and both["chunks_restarted"] == 1
    assert both["control_to_display"]["median_ms"] == pytest.approx((1250 + 1350) / 2)
