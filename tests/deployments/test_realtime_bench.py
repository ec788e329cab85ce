"""perf/realtime.py against the real local server: a short run, its JSON and its checks."""
import json

from perf import realtime


def test_benchmark_json(serve_app, tmp_path, capsys):
    out = tmp_path / "bench.json"
    report = realtime.main(["--url", serve_app, "--num-chunks", "8", "--sessions", "2", "--concurrency", "2",
                            "--warmup-sessions", "0", "--ping-interval", "1", "--profile-stages",
                            "--control-interval", "0.5",
                            "--output-json", str(out), "--plot", str(tmp_path / "p.png")])
    data = json.loads(out.read_text())
    assert data["benchmark"] == "lingbot_world_realtime"
    assert data["workload"]["num_frames"] == 93 and data["workload"]["width"] == 112
    assert len(data["sessions"]) == 2
    for s in data["sessions"]:
        assert [c["index"] for c in s["chunks"]] == list(range(8))
        assert s["frames_decoded"] == 93
        m = s["metrics"]
        assert m["chunks_received"] == 8 and m["total_frames"] == 93 and m["steady_state_reached"]
        assert m["interval_steady"]["count"] == 2 and m["interval_all"]["count"] == 7
        assert {"ttfc_ms", "video_rtf"} <= set(m) and 0 <= m["slo_attainment"] <= 1
        assert m["chunk_deadline_ms"] == 750
        # every control a chunk started was shown after it was sent; the count adds up
        assert m["controls_sent"] == len(s["controls"]) >= 1
        assert m["control_to_display"]["count"] + m["controls_not_shown"] == m["controls_sent"]
        assert all(ms > 0 for ms in m["control_latencies_ms"])
        assert {"probe_0", "commit", "decode", "root_to_muxer", "outside_engine"} <= set(s["stage_medians_ms"])
    agg = data["metrics"]
    assert agg["sessions"] == 2 and agg["chunks_received"] == 16
    assert agg["chunks_per_rung"] == {"full": 16}                     # the ladder is off here
    assert agg["video_rtf_best"] <= agg["video_rtf_mean"] <= agg["video_rtf_worst"]
    assert (tmp_path / "p.png").stat().st_size > 1000
    assert agg["control_to_display"]["count"] == sum(s["metrics"]["control_to_display"]["count"]
                                                     for s in data["sessions"])
    printed = capsys.readouterr().out
    assert "LingBot-World realtime streaming benchmark" in printed and "Across sessions" not in printed
    assert report["metrics"] == data["metrics"]


def test_benchmark_rejects_a_wrong_stream():
    """The checks fail loudly on a stream that does not match the request."""
    import pytest

    class Result:
        def __init__(self):
            self.done = {"chunks": 3}

    chunks = [{"index": i, "transport_index": i, "num_frames": 9 if i == 0 else 12} for i in (0, 2)]
    with pytest.raises(realtime.BenchmarkError, match="not contiguous"):
        realtime._check(chunks, Result(), 2)
    chunks = [{"index": i, "transport_index": i, "num_frames": 12} for i in range(3)]
    with pytest.raises(realtime.BenchmarkError, match="36 frames announced, 33 expected"):
        realtime._check(chunks, Result(), 3)
