"""perf/device_check.py end to end on CPU with the tiny preset, so the GPU script cannot rot."""
import json

from perf import device_check


def test_device_check_runs_end_to_end_on_cpu(tmp_path, capsys):
    out = tmp_path / "check.json"
    report = device_check.main(["--preset", "tiny", "--device", "cpu", "--steady", "1", "--peak-seconds", "0.3",
                                "--json", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    assert list(report["modes"]) == ["eager", "compiled", "compiled+graphs"]    # on CPU: compiled, no graphs
    for mode in report["modes"].values():
        assert {"dit_steady_s", "whole_steady_s", "dit_fraction_of_peak"} <= set(mode)
    for name in ("compiled", "compiled+graphs"):
        assert report["modes"][name]["within_tolerance"] and report["modes"][name]["vs_eager_max_abs"] < 1e-5
    assert report["graphs_vs_compiled_bitwise"] and report["interleaved_sessions_intact"]
    assert {"session_bytes_budget_model", "matmul_peak_tflops"} <= set(report)
    snapshot = report["snapshot"]
    assert snapshot["async_bitwise"] and not snapshot["asynchronous"] and snapshot["bytes"] > 0
    assert {"chunk_s", "chunk_sync_snapshot_s", "chunk_async_snapshot_s"} <= set(snapshot)
    printed = capsys.readouterr().out
    assert "device check: tiny 112x64" in printed and "compiled+graphs vs eager latents" in printed
    assert "snapshot " in printed and "bitwise: True" in printed
