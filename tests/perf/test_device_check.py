"""perf/device_check/ end to end on CPU with the tiny preset, so the GPU script cannot rot; and its guards:
a stage that fails late keeps what it measured and every other stage's figures, a stage past the deadline
is skipped and says so. (The run's guards alone, without the pipeline: test_device_check_runner.py.)"""
import json

from perf import device_check

TINY = ["--preset", "tiny", "--device", "cpu", "--steady", "1", "--peak-seconds", "0.3"]


def _saved(folder) -> dict:
    assert not list(folder.glob("*.tmp"))                  # every write renamed into place
    return json.loads((folder / "device_check.json").read_text())


def _statuses(report) -> dict:
    return {name: r["status"] for name, r in report["stages"].items()}


def test_device_check_runs_end_to_end_on_cpu_and_a_late_failure_keeps_its_figures(tmp_path, capsys):
    """One whole run (the suite's time: the script compiles twice), with the graphs stage made to fail after
    its DiT and its step comparison: it keeps them, and the stage after it that wants graphs runs the
    compiled regions instead (a broken mode is not built again); every other stage runs and keeps its
    figures; those with nothing to measure on CPU say so."""
    # no deadline here: every stage must run however slow the machine (the deadline has its own test below)
    report = device_check.main([*TINY, "--deadline-s", "100000", "--fail-stage", "graphs@graphs_vs_compiled_bitwise",
                                "--out", str(tmp_path)])
    saved = _saved(tmp_path)
    assert saved == json.loads(json.dumps(report))
    assert _statuses(report) == {**dict.fromkeys(device_check.STAGE_NAMES, "ok"), "graphs": "failed",
                                 "no_sync": "not applicable", "comm": "not applicable"}
    failed = saved["stages"]["graphs"]
    assert failed["error"] == ("InjectedFailure: stage graphs failed on purpose after graphs_vs_compiled_bitwise "
                               "(--fail-stage graphs@graphs_vs_compiled_bitwise)")
    assert failed["traceback"].startswith("Traceback") and "in keep" in failed["traceback"]
    # what graphs measured before it failed is kept: the DiT and its comparisons, not the whole chunk
    assert {"dit_steady_s", "step_relative_diff", "graphs_vs_compiled_bitwise"} <= set(failed["figures"])
    assert "whole_steady_s" not in failed["figures"] and failed["figures"]["graphs_vs_compiled_bitwise"]
    # each stage ran with the serving flags and in the regions it declares
    serving = {**device_check.SERVING_FLAGS, "float32_matmul_precision": "highest"}
    assert all(r["flags"] == serving for r in report["stages"].values())
    regions = {name: r.get("regions") for name, r in report["stages"].items() if r.get("regions")}
    assert regions == {"eager_dit": "eager", "eager_whole": "eager", "compiled": "compiled", "no_sync": "compiled",
                       "rungs": "compiled", "snapshots": "compiled", "memory": "compiled", "graphs": "compiled+graphs",
                       "interleaving": "compiled"}                 # graphs broke: the compiled regions stand in
    for name, mode in regions.items():
        assert report["stages"][name]["figures"].get("regions", mode) == mode
    figures = {name: r["figures"] for name, r in report["stages"].items()}
    modes = report["modes"]
    assert list(modes) == ["eager", "compiled", "compiled+graphs"]    # on CPU: compiled, no graphs
    assert not modes["eager"]["partial"] and not modes["compiled"]["partial"] and modes["compiled+graphs"]["partial"]
    for mode in modes.values():
        assert {"dit_steady_s", "dit_fraction_of_peak"} <= set(mode)
    assert "whole_steady_s" in modes["eager"] and "whole_steady_s" in modes["compiled"]
    assert "whole_steady_s" not in modes["compiled+graphs"]
    for name in ("compiled", "compiled+graphs"):
        assert modes[name]["within_tolerance"] and modes[name]["step_relative_diff"] < 1e-5
        assert modes[name]["chunk0_within_tolerance"] and modes[name]["chunk0_relative_diff"] < 1e-5
        assert modes[name]["vs_eager_max_abs"] < 1e-5
    assert figures["interleaving"]["intact"]
    rungs = figures["rungs"]                           # each step rung timed past the sink, beside the model's ratio
    assert set(rungs["rung_steady_s"]) == {"full", "steps3", "steps2"} and rungs["rung_ratio"]["full"] == 1.0
    assert rungs["rung_forward_ratio"] == {"full": 1.0, "steps3": 0.8, "steps2": 0.6}
    # and each decoder's chunk: every rung's whole chunk, the decoder rungs' with the tiny decoder's decode
    assert rungs["rung_chunk_s"]["tiny"] == rungs["rung_steady_s"]["full"] + rungs["decode_chunk_s"]["tae"]
    assert rungs["rung_chunk_s"]["steps2"] == rungs["rung_steady_s"]["steps2"] + rungs["decode_chunk_s"]["wan"]
    assert 0 < rungs["wan_decode_share"] < 1 and rungs["climb_at_once_decode_s"] == 14 * rungs["decode_chunk_s"]["wan"]
    # the whole chunks replay the first frame's conditions (primed to the fixed point), in every mode
    whole = figures["eager_whole"]
    assert whole["condition_fixed_point_chunk"] is not None and whole["condition_encode_s"]
    for name in ("eager_whole", "compiled"):
        assert figures[name]["condition_replayed"] and figures[name]["condition_encoded_chunks"] == 0
    tiny = figures["tiny_decoder"]
    assert tiny["dtype"] == "float32" and tiny["chunk_s"] > 0 and tiny["vs_fp32_max_abs"] == 0.0     # fp32 on CPU
    assert tiny["cache_bytes"] > 0 and tiny["peak_growth_bytes"] is None              # no device allocator
    # no TF32 on CPU: float32 as served is IEEE, bitwise; the preset is float32, so no rounding either
    tf32 = figures["tf32"]
    assert not tf32["tf32_applies"] and tf32["condition_tf32_max"] == tf32["decoder_tf32_max_levels"] == 0.0
    assert tf32["condition_rounding_max"] == 0.0 and tf32["condition_tf32_within_rounding"]
    snapshot = figures["snapshots"]
    assert snapshot["async_bitwise"] and not snapshot["asynchronous"] and snapshot["bytes"] > 0
    assert {"chunk_s", "chunk_sync_snapshot_s", "chunk_async_snapshot_s", "sync_cost", "async_cost", "copy_sync_s",
            "copy_async_s", "budget_copy_s", "budget_copy_fraction_of_chunk"} <= set(snapshot)
    assert snapshot["host_plan"].startswith(f"snapshots for {snapshot['host_sessions']} sessions")
    assert snapshot["host_memory_bytes"] == report["environment"]["host_memory_bytes"]
    # the bytes per chunk against the snapshot budget's: the slot exactly, the state (conditions replayed: no
    # encoder cache) within its largest
    assert snapshot["slot_bytes"] == snapshot["budget_slot_bytes"] > 0
    assert 0 < snapshot["state_bytes"] < snapshot["budget_state_bytes"]
    # memory: like with like, part by part (no device allocator on CPU)
    memory = figures["memory"]
    budget, dit, whole_session = memory["budget_model"], memory["dit_session"], memory["whole_session"]
    assert dit["kv_window_bytes"] == budget["kv_window"] and dit["text_kv_bytes"] == budget["text_kv"]
    assert dit["allocated_bytes"] is None and dit["owned_bytes"] >= dit["budget_bytes"]
    assert whole_session["parts_max"]["kv_window"] == budget["kv_window"]
    assert whole_session["parts_max"]["decoder_cache"] == budget["decoder_cache"]
    assert whole_session["max_owned_bytes"] > dit["owned_bytes"]             # + decoder and encoder caches
    # the rank lifecycle from a safetensors folder: eager on CPU a one-chunk warm-up, the CPU budget rule
    life = figures["lifecycle"]
    assert life["checkpoint_bytes"] > 0 and life["warmup"]["chunks"] == 1 and life["memory"] is None
    assert life["capacity"] > 0 and not life["compiled"]
    table = (tmp_path / "device_check.md").read_text()
    assert table.startswith("Device check: tiny 112x64 float32 on cpu") and "| compiled+graphs (stage failed: " in table
    assert f"commit {report['environment']['commit'][:12]}" in table.splitlines()[0]
    assert "| snapshot copy alone, device idle |" in table and "| lifecycle | ok |" in table
    assert "| snapshot copy at the budget's largest, per chunk |" in table
    assert "capacity of the 2-layer model" in table and "| graphs | failed |" in table
    printed = capsys.readouterr().out
    assert table.strip() in printed                                           # the table, printed at the end
    log = (tmp_path / "device_check.log").read_text()
    assert "eager_dit: ok in" in log and "lifecycle: ok in" in log


def test_stages_past_the_deadline_are_skipped(tmp_path):
    report = device_check.main([*TINY, "--deadline-s", "0.001", "--out", str(tmp_path)])
    saved = _saved(tmp_path)
    statuses = _statuses(saved)
    assert statuses.pop("setup") == statuses.pop("eager_dit") == "ok"           # they always run
    assert set(statuses.values()) == {"skipped"}
    for name in statuses:
        record = saved["stages"][name]
        assert record["reason"].startswith("deadline: needs ~") and record["estimate_s"] > 0
    assert report["modes"]["eager"]["dit_steady_s"] > 0
    assert "| memory | skipped |" in (tmp_path / "device_check.md").read_text()
