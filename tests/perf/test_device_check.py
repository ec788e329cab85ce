"""perf/device_check/ end to end on CPU with the tiny preset, so the GPU script cannot rot; and its guards:
a stage that fails keeps every other stage's figures, a stage past the deadline is skipped and says so."""
import json

from perf import device_check

TINY = ["--preset", "tiny", "--device", "cpu", "--steady", "1", "--peak-seconds", "0.3"]


def _saved(folder) -> dict:
    assert not list(folder.glob("*.tmp"))                  # every write renamed into place
    return json.loads((folder / "device_check.json").read_text())


def _statuses(report) -> dict:
    return {name: r["status"] for name, r in report["stages"].items()}


def test_device_check_runs_end_to_end_on_cpu_and_a_failed_stage_keeps_every_other(tmp_path, capsys):
    """One whole run (the suite's time: the script compiles twice), with one stage made to fail: every other
    stage runs and keeps its figures, the failed one keeps its error and traceback."""
    # no deadline here: every stage must run however slow the machine (the deadline has its own test below)
    report = device_check.main([*TINY, "--deadline-s", "100000", "--fail-stage", "no_sync", "--out", str(tmp_path)])
    saved = _saved(tmp_path)
    assert saved == json.loads(json.dumps(report))
    assert _statuses(report) == {**dict.fromkeys(device_check.STAGE_NAMES, "ok"), "no_sync": "failed"}
    failed = saved["stages"]["no_sync"]
    assert failed["error"].startswith("InjectedFailure: stage no_sync failed on purpose")
    assert failed["traceback"].startswith("Traceback") and "_fail_on_purpose" in failed["traceback"]
    assert "figures" not in failed and failed["seconds"] >= 0
    figures = {name: r["figures"] for name, r in report["stages"].items() if name != "no_sync"}
    assert list(report["modes"]) == ["eager", "compiled", "compiled+graphs"]    # on CPU: compiled, no graphs
    for mode in report["modes"].values():
        assert {"dit_steady_s", "whole_steady_s", "dit_fraction_of_peak"} <= set(mode)
    for name in ("compiled", "compiled+graphs"):
        assert report["modes"][name]["within_tolerance"] and report["modes"][name]["vs_eager_max_abs"] < 1e-5
    assert figures["graphs"]["graphs_vs_compiled_bitwise"] and figures["interleaving"]["intact"]
    # the whole chunks replay the first frame's conditions (primed to the fixed point), in every mode
    whole = figures["eager_whole"]
    assert whole["condition_fixed_point_chunk"] is not None and whole["condition_encode_s"]
    for name in ("eager_whole", "compiled", "graphs"):
        assert figures[name]["condition_replayed"] and figures[name]["condition_encoded_chunks"] == 0
    tiny = figures["tiny_decoder"]
    assert tiny["dtype"] == "float32" and tiny["chunk_s"] > 0 and tiny["vs_fp32_max_abs"] == 0.0     # fp32 on CPU
    assert tiny["cache_bytes"] > 0 and "tiny decoder at 112x64 (float32)" in (tmp_path / "device_check.md").read_text()
    snapshot = figures["snapshots"]
    assert snapshot["async_bitwise"] and not snapshot["asynchronous"] and snapshot["bytes"] > 0
    assert {"chunk_s", "chunk_sync_snapshot_s", "chunk_async_snapshot_s", "sync_cost", "async_cost", "copy_sync_s",
            "copy_async_s", "budget_copy_s", "budget_copy_fraction_of_chunk"} <= set(snapshot)
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
    # the rank lifecycle from a safetensors folder: every window length warmed up, the CPU budget rule
    life = figures["lifecycle"]
    assert life["checkpoint_bytes"] > 0 and life["warmup"]["chunks"] == 7 and life["memory"] is None
    assert life["capacity"] > 0 and not life["compiled"]
    table = (tmp_path / "device_check.md").read_text()
    assert table.startswith("Device check: tiny 112x64 float32 on cpu") and "| compiled+graphs |" in table
    assert "| snapshot copy alone, device idle |" in table and "| lifecycle | ok |" in table
    assert "| snapshot copy at the budget's largest, per chunk |" in table
    assert "| no_sync | failed |" in table and "InjectedFailure" in table
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
