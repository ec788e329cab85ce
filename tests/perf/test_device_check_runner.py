"""The device check's run, decided without a device: the stages' order by risk and the mode each declares,
the serving flags set before every stage, figures written as they are measured and kept when the stage
fails later (or the command's timeout ends it), "not applicable" apart from passing, the watchdog's stack
dump on an overrun, the comm stage's collectives (over gloo), the report's references, and the
environment record. Stages of the check's own where they are cheap on CPU, else small stand-ins."""
import argparse
import json
import platform
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

from perf import device_check
from perf.device_check import SERVING_FLAGS, STAGES, Check, Stage, read_flags
from perf.device_check.comm import world_of_one
from perf.device_check.environment import REPO, environment, git_commit

TINY = ["--preset", "tiny", "--device", "cpu", "--steady", "1", "--peak-seconds", "0.1", "--deadline-s", "1000"]


def _run(tmp_path, stages, *extra) -> dict:
    report = device_check.main([*TINY, "--out", str(tmp_path), *extra], stages=tuple(stages))
    assert json.loads((tmp_path / "device_check.json").read_text()) == json.loads(json.dumps(report))
    return report


def test_stages_run_in_order_of_risk_with_graphs_after_memory_and_each_declares_its_regions():
    names = [s.name for s in STAGES]
    assert names[0] == "setup" and names[-1] == "lifecycle"          # lifecycle frees the model: last
    before_lifecycle = STAGES[:-1]
    assert [s.risk for s in before_lifecycle] == sorted(s.risk for s in before_lifecycle)
    graphs = names.index("graphs")
    assert all(names.index(n) < graphs for n in ("memory", "snapshots", "no_sync", "compiled", "comm"))
    assert {s.name: s.regions for s in STAGES if s.regions} == {
        "eager_dit": "eager", "eager_whole": "eager", "compiled": "compiled", "no_sync": "compiled",
        "rungs": "compiled", "snapshots": "compiled", "memory": "compiled", "graphs": "compiled+graphs",
        "interleaving": "compiled+graphs"}
    assert {s.name for s in STAGES if s.builds_mode} == {"compiled", "graphs"}
    assert max(s.risk for s in STAGES) == STAGES[names.index("graphs")].risk


def _disturbs_the_flags(c):
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = True
    c.keep(left="flags off")


def _reads_the_flags(c):
    c.keep(**{f"seen_{k}": v for k, v in read_flags().items()})


def test_every_stage_starts_with_the_serving_flags_whatever_the_one_before_left(tmp_path):
    before = read_flags()
    report = _run(tmp_path, [Stage("disturbs", "leaves the flags off", _disturbs_the_flags, lambda c: 0.0,
                                   needs_pipeline=False),
                             Stage("reads", "reads them", _reads_the_flags, lambda c: 0.0, needs_pipeline=False)])
    serving = {**SERVING_FLAGS, "float32_matmul_precision": "highest"}
    for name in ("disturbs", "reads"):
        assert report["stages"][name]["status"] == "ok" and report["stages"][name]["flags"] == serving
    assert report["stages"]["reads"]["figures"] == {f"seen_{k}": v for k, v in serving.items()}
    assert report["serving_flags"] == SERVING_FLAGS and report["environment"]["flags"] == before
    assert read_flags() == before                                # the run puts back what it found


def _fails_late(c):
    c.keep(first=1.5)
    # written before anything else happens: a kill here would keep it too
    on_disk = json.loads((Path(c.args.out) / "device_check.json").read_text())
    assert on_disk["stages"]["fails_late"]["figures"] == {"first": 1.5}
    c.keep(second=[1, 2])
    raise RuntimeError("the second half broke")


def test_a_stage_that_fails_late_keeps_the_figures_it_measured_and_the_next_stage_runs(tmp_path):
    report = _run(tmp_path, [Stage("fails_late", "keeps two figures, then fails", _fails_late, lambda c: 0.0,
                                   needs_pipeline=False),
                             Stage("after", "runs", lambda c: c.keep(ran=True), lambda c: 0.0, needs_pipeline=False)])
    failed = report["stages"]["fails_late"]
    assert failed["status"] == "failed" and failed["error"] == "RuntimeError: the second half broke"
    assert failed["figures"] == {"first": 1.5, "second": [1, 2]} and "_fails_late" in failed["traceback"]
    assert report["stages"]["after"] == {**report["stages"]["after"], "status": "ok", "figures": {"ran": True}}
    assert "| fails_late | failed |" in (tmp_path / "device_check.md").read_text()


def test_nccl_and_nvml_are_not_applicable_on_cpu_rather_than_passing(tmp_path):
    comm = next(s for s in STAGES if s.name == "comm")
    report = _run(tmp_path, [comm])
    record = report["stages"]["comm"]
    assert record["status"] == "not applicable" and record["reason"] == "no NCCL or NVML on cpu"
    assert record["figures"] == {} and "error" not in record
    table = (tmp_path / "device_check.md").read_text()
    assert "| comm | not applicable |" in table
    assert "| NCCL and NVML | not applicable: no NCCL or NVML on cpu |" in table


def _sleeps_past_its_estimate(c):
    time.sleep(1.5)
    c.keep(slept=True)


def test_a_stage_past_its_estimate_leaves_every_threads_stack_in_the_log(tmp_path):
    report = _run(tmp_path, [Stage("slow", "sleeps", _sleeps_past_its_estimate, lambda c: 0.1, needs_pipeline=False)],
                  "--watchdog-slack-s", "0.3")
    assert report["stages"]["slow"]["status"] == "ok"                # the watchdog reports; it stops nothing
    log = (tmp_path / "device_check.log").read_text()
    dump = log[log.index("slow: sleeps ..."):]
    assert "most recent call first" in dump and "_sleeps_past_its_estimate" in dump


def _sleeps_within_its_allowance(c):
    time.sleep(0.6)                      # past its estimate, within twice it
    c.keep(slept=True)


def test_no_dump_within_twice_the_estimate(tmp_path):
    _run(tmp_path, [Stage("slowish", "sleeps", _sleeps_within_its_allowance, lambda c: 0.5, needs_pipeline=False)],
         "--watchdog-slack-s", "0.3")
    assert "most recent call first" not in (tmp_path / "device_check.log").read_text()


def test_the_report_records_its_environment(tmp_path):
    env = environment(torch.device("cpu"))
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True).stdout
    assert env["commit"] == head.strip() and env["commit_from"] == "git" and isinstance(env["dirty"], bool)
    assert env["python"] == platform.python_version() and env["torch"] == torch.__version__
    assert env["cudnn"] is None and env["gpu"] == "not applicable (cpu)" and env["flags"] == read_flags()
    assert {"cuda", "triton", "transformers", "nvidia-ml-py", "host_memory_bytes"} <= set(env)
    # a copy of the tree without git: the commit the command passes
    assert git_commit("abc123", repo=tmp_path) == {"commit": "abc123", "dirty": None, "commit_from": "--commit"}
    assert git_commit(None, repo=tmp_path)["commit"] is None


def test_a_mode_whose_stage_failed_or_was_skipped_is_not_built_by_a_later_stage():
    lines = []
    c = Check(argparse.Namespace(device="cpu", preset="tiny", steady=1), lines.append)
    c.unavailable = {"compiled", "compiled+graphs"}
    assert c.enter("compiled+graphs") == "eager" == c.mode and c.enter("eager") == "eager"
    assert lines == ["  no compiled+graphs regions (their stage failed or was skipped): running eager"]


def test_the_comm_stages_collectives_run_at_world_size_1_each_checked():
    """The calls the comm stage makes of NCCL on a GPU, here over gloo: Comm.init's groups and every collective
    with its result checked."""
    out = world_of_one(torch.device("cpu"))
    assert out["backend"] == "gloo" and not torch.distributed.is_initialized()      # destroyed after
    results = {name: r["result"] for name, r in out["collectives"].items()}
    assert results == dict.fromkeys(["all_to_all", "all_gather_uneven", "gather_to_root", "broadcast",
                                     "control all_reduce (gloo)", "start barrier (gloo)"], "ok")


def _report(device_name: str) -> dict:
    """A report as a 14B run would write it, cut to the figures the mode table reads."""
    stage = lambda figures: {"status": "ok", "figures": figures}
    return {"preset": "lingbot-world-v2-14b", "size": "832x480", "dtype": "bfloat16", "device": "cuda",
            "device_name": device_name, "started_utc": "2026-12-02T00:00:00+00:00", "elapsed_s": 400.0,
            "deadline_s": 490.0, "step_tolerance": 2e-2, "serving_flags": SERVING_FLAGS,
            "stages": {"setup": stage({"matmul_peak_tflops": 790.0, "dit_chunk_tflop": 1147.4}),
                       "eager_dit": stage({"regions": "eager", "dit_steady_s": 2.0, "dit_tflops": 573.7}),
                       "eager_whole": stage({"regions": "eager", "whole_steady_s": 2.5}),
                       "graphs": {"status": "failed", "figures": {"regions": "compiled+graphs", "dit_steady_s": 1.6,
                                                                  "dit_tflops": 717.1}}}}


def test_each_mode_stands_beside_the_measured_peak_the_datasheets_and_the_peers_without_a_verdict():
    report = _report("NVIDIA H200")
    modes = device_check.modes_of(report)
    assert modes["eager"]["whole_over vLLM-Omni eager"] == 2.5 / 2.993 and not modes["eager"]["partial"]
    assert modes["eager"]["dit_fraction_of_datasheet"] == 573.7e12 / 989e12
    assert modes["compiled+graphs"]["partial"] and "whole_over vLLM-Omni eager" not in modes["compiled+graphs"]
    table = device_check.render_table(report)
    assert ("Matmul peak measured 790 TFLOP/s; steady DiT chunk 1147 TFLOP; the DiT's floor 1452 ms at the "
            "measured peak, 1160 ms at the datasheet's 989 TFLOP/s.") in table
    assert ("| mode | DiT warm-up s | DiT 1st chunk s | DiT steady ms | DiT TFLOP/s | of measured peak | of datasheet "
            "peak | whole steady ms | whole vs vLLM-Omni eager (2993 ms) | whole vs vLLM-Omni compiled (2464 ms) | "
            "one step vs eager | chunk 0 vs eager |") in table
    assert "| eager | - | - | 2000.0 | 573.7 | 72.6% | 58.0% | 2500.0 | 0.84x | 1.01x | - | - |" in table
    assert "| compiled+graphs (stage failed: partial) | - | - | 1600.0 | 717.1 | 90.8% | 72.5% | - | - | - |" in table
    assert "goal" not in table and " met" not in table
    # another device: no peers, no datasheet figure it does not know
    other = device_check.render_table(_report("NVIDIA A100-SXM4-80GB"))
    assert "vLLM-Omni" not in other and "| eager | - | - | 2000.0 | 573.7 | 72.6% | - | 2500.0 | - | - |" in other


def test_the_commands_timeout_leaves_the_figures_so_far_and_every_threads_stack(tmp_path):
    """As the GPU command's `timeout` ends it: SIGTERM mid-stage. The JSON is whole, the stage that was
    running says so, what earlier stages measured is there, and the log holds the stacks."""
    proc = subprocess.Popen([sys.executable, "-m", "perf.device_check", *TINY, "--out", str(tmp_path)], cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            saved = tmp_path / "device_check.json"
            if saved.exists() and json.loads(saved.read_text())["stages"]["eager_dit"]["status"] == "running":
                break
            assert proc.poll() is None, proc.stderr.read().decode()
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == -signal.SIGTERM
    finally:
        proc.kill()
    report = json.loads((tmp_path / "device_check.json").read_text())
    assert report["stages"]["setup"]["status"] == "ok" and report["stages"]["setup"]["figures"]["build_s"] > 0
    assert report["stages"]["eager_dit"]["status"] == "running" and report["stages"]["lifecycle"]["status"] == "pending"
    log = (tmp_path / "device_check.log").read_text()
    assert "most recent call first" in log[log.index("eager_dit: eager DiT chunk and one step ..."):]
