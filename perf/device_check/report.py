"""The device check's report: the markdown tables for perf/README.md (`render_table`: the environment, the
modes against the measured peak, the datasheet's and the peers', the checks, the stages) made from the JSON
report, and `modes_of`, the per-mode figures the JSON keeps too. Nothing here judges a goal: each figure
stands beside its references."""
from __future__ import annotations

from functools import partial
from typing import Optional

from .check import DATASHEET_BF16_FLOPS, PEER_DEVICE, PEER_PRESET, PEER_WHOLE_CHUNK_S

# ---------------------------------------------------------------------------------------------------
# the table
# ---------------------------------------------------------------------------------------------------
GIB = 2 ** 30
MODES = {"eager": ("eager_dit", "eager_whole"), "compiled": ("compiled",), "compiled+graphs": ("graphs",)}


def _figures(report: dict, stage: str) -> Optional[dict]:
    """The figures a stage kept, also one that failed after them (None: none kept)."""
    return report["stages"].get(stage, {}).get("figures") or None


def modes_of(report: dict) -> dict:
    """mode -> the DiT and whole-chunk figures its stages measured (eager's come from two stages), with
    `partial` where one of them failed after keeping some, and the references: the DiT's rate against the
    datasheet's peak (beside the measured one's), the whole chunk over the peers' (14B on one H200)."""
    datasheet = datasheet_flops(report["device_name"])
    peers = PEER_WHOLE_CHUNK_S if peers_apply(report) else {}
    modes = {}
    for mode, stages in MODES.items():
        merged, partial = {}, False
        for stage in stages:
            figures = _figures(report, stage) or {}
            merged.update(figures)
            partial |= bool(figures) and report["stages"][stage]["status"] != "ok"
        if not merged:
            continue
        merged.pop("regions", None)
        m = {**{k: v for k, v in merged.items() if not isinstance(v, list)}, "partial": partial}
        if datasheet and m.get("dit_tflops") is not None:
            m["dit_fraction_of_datasheet"] = m["dit_tflops"] * 1e12 / datasheet
        if m.get("whole_steady_s") is not None:
            m.update({f"whole_over {peer}": m["whole_steady_s"] / s for peer, s in peers.items()})
        modes[mode] = m
    return modes


def datasheet_flops(device_name: str) -> Optional[float]:
    return next((f for key, f in DATASHEET_BF16_FLOPS.items() if key in device_name), None)


def peers_apply(report: dict) -> bool:
    """The peers' figures are for the 14B preset at its size on one H200."""
    return report["preset"] == PEER_PRESET and PEER_DEVICE in report["device_name"]


def _ms(seconds) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.1f}"


def _gib(nbytes) -> str:
    return "-" if nbytes is None else f"{nbytes / GIB:.3f}"


def _pct(x) -> str:
    return "-" if x is None else f"{x:+.1%}"


def _header(report: dict) -> list[str]:
    env = report.get("environment", {})
    commit = env.get("commit") or "unknown"
    commit = f"{commit[:12]}{' (modified)' if env.get('dirty') else ''}"
    gpu = env.get("gpu")
    flags = ", ".join(f"{k} {v}" for k, v in report.get("serving_flags", {}).items())
    lines = [f"Device check: {report['preset']} {report['size']} {report['dtype']} on {report['device']} "
             f"({report['device_name']}), {report['started_utc']}; {report['elapsed_s']:.0f} s of a "
             f"{report['deadline_s']:g} s deadline; commit {commit}.", "",
             f"Python {env.get('python')}, torch {env.get('torch')}, CUDA {env.get('cuda')}, cuDNN {env.get('cudnn')}, "
             f"Triton {env.get('triton')}, transformers {env.get('transformers')}, nvidia-ml-py "
             f"{env.get('nvidia-ml-py')}; stages run with {flags}."]
    if isinstance(gpu, dict):
        after = report.get("environment_after", {}).get("gpu")
        after = after if isinstance(after, dict) else {}
        lines.append(f"Driver {gpu.get('driver_version')}; clocks SM {gpu.get('clocks.sm')} MHz at the start, "
                     f"{after.get('clocks.sm', '-')} at the end (max {gpu.get('clocks.max.sm')}), memory "
                     f"{gpu.get('clocks.mem')} MHz; power limit {gpu.get('power.limit')} W.")
    elif gpu:
        lines.append(f"GPU: {gpu}.")
    return lines + [""]


def render_table(report: dict) -> str:
    """The markdown for perf/README.md: the environment, the modes, the checks, the stages."""
    lines = _header(report)
    setup = _figures(report, "setup") or {}
    datasheet = datasheet_flops(report["device_name"])
    peak = setup.get("matmul_peak_tflops")
    flop = setup.get("dit_chunk_tflop")
    if peak:
        floor = f"; the DiT's floor {flop / peak * 1e3:.0f} ms at the measured peak" if flop else ""
        if flop and datasheet:
            floor += f", {flop * 1e12 / datasheet * 1e3:.0f} ms at the datasheet's {datasheet / 1e12:.0f} TFLOP/s"
        lines += [f"Matmul peak measured {peak:.4g} TFLOP/s; steady DiT chunk "
                  f"{'-' if flop is None else f'{flop:.4g}'} TFLOP{floor}."]
    if "build_s" in setup:
        lines += [f"Build {setup['build_s']:.1f} s; weights {_gib(setup['weights_bytes'])} GiB."]
    lines.append("")
    modes = report.get("modes") or modes_of(report)
    peers = PEER_WHOLE_CHUNK_S if peers_apply(report) else {}
    if modes:
        head = ["mode", "DiT warm-up s", "DiT 1st chunk s", "DiT steady ms", "DiT TFLOP/s", "of measured peak",
                "of datasheet peak", "whole steady ms", *(f"whole vs {p} ({s * 1e3:.0f} ms)" for p, s in peers.items()),
                "one step vs eager", "chunk 0 vs eager"]
        lines += ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 3) + "---|---|"]
        for mode, m in modes.items():
            steady, whole = m.get("dit_steady_s"), m.get("whole_steady_s")
            tflops = None if steady is None or flop is None else flop / steady
            step = "-"
            if "step_relative_diff" in m:
                step = (f"{m['step_relative_diff']:.2e} ({'within' if m['within_tolerance'] else 'OUTSIDE'} "
                        f"{report['step_tolerance']:g})")
            chunk0 = "-"
            if "chunk0_relative_diff" in m:
                chunk0 = (f"{m['chunk0_relative_diff']:.2e} ({'within' if m['chunk0_within_tolerance'] else 'OUTSIDE'} "
                          f"{report['step_tolerance']:g})")
            row = [mode + (" (stage failed: partial)" if m.get("partial") else ""), _num(m.get("dit_warmup_s"), ".1f"),
                   _num(m.get("dit_first_chunk_s"), ".2f"), _ms(steady), _num(tflops, ".4g"),
                   _share(None if tflops is None or not peak else tflops / peak),
                   _share(None if tflops is None or not datasheet else tflops * 1e12 / datasheet), _ms(whole),
                   *("-" if whole is None else f"{whole / s:.2f}x" for s in peers.values()), step, chunk0]
            lines.append("| " + " | ".join(row) + " |")
        lines.append("")
    lines += ["| check | result |", "|---|---|"] + [f"| {k} | {v} |" for k, v in _checks(report, modes)]
    lines += ["", "| stage | status | s | estimate s | regions | note |", "|---|---|---:|---:|---|---|"]
    for name, r in report["stages"].items():
        note = r.get("reason") or (r.get("error", "").splitlines() or [""])[0][:160]
        seconds = "-" if r.get("seconds") is None else f"{r['seconds']:.1f}"
        estimate = "-" if r.get("estimate_s") is None else f"{r['estimate_s']:.0f}"
        lines.append(f"| {name} | {r['status']} | {seconds} | {estimate} | {r.get('regions', '-')} | "
                     f"{note.replace('|', '/')} |")
    return "\n".join(lines) + "\n"


def _num(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def _share(x) -> str:
    return "-" if x is None else f"{x:.1%}"


def _checks(report: dict, modes: dict) -> list[tuple[str, str]]:
    rows = []
    setup = _figures(report, "setup") or {}
    if "attention_trials" in setup:
        trials = ", ".join(f"{t['name']} {t['ms']:.3f} ms" if t["ms"] is not None else f"{t['name']} dropped"
                           for t in setup["attention_trials"])
        rows.append(("attention kernel (checked on the first and the last head)",
                     f"{setup['attention_kernel']} ({trials})"))
    whole = next((f for f in map(partial(_figures, report), ("eager_whole", "compiled", "graphs"))
                  if f and f.get("condition_encode_s")), None)
    if whole:
        rows.append(("condition encoder until its fixed point",
                     f"fixed point at chunk {whole.get('condition_fixed_point_chunk')}; "
                     f"{_ms(whole.get('condition_encode_steady_s'))} ms per chunk after chunk 0 (the whole chunks "
                     f"above replay it: {whole.get('condition_replayed')})"))
    for mode, m in modes.items():
        if "vs_eager_max_abs" in m:
            rows.append((f"{mode} vs eager latents, all chunks", f"max abs diff {m['vs_eager_max_abs']:.2e}"))
    graphs = _figures(report, "graphs") or {}
    if "graphs_vs_compiled_bitwise" in graphs:
        rows.append(("graph replay vs compiled latents, bitwise", str(graphs["graphs_vs_compiled_bitwise"])))
    tiny = _figures(report, "tiny_decoder") or {}
    if "chunk_s" in tiny:
        against = ("" if "vs_fp32_max_abs" not in tiny else f"; vs IEEE fp32 max {tiny['vs_fp32_max_abs']:.3g}, "
                   f"mean {tiny['vs_fp32_mean_abs']:.3g} (pixels in [-1, 1])")
        rows.append((f"tiny decoder at {tiny['size']} ({tiny['dtype']})",
                     f"{_ms(tiny['chunk_s'])} ms per steady chunk ({tiny['gflop_per_chunk']:.4g} GFLOP, "
                     f"{tiny['tflops']:.3g} TFLOP/s); adds {_gib(tiny['peak_growth_bytes'])} GiB to the peak; "
                     f"cache {_gib(tiny['cache_bytes'])} GiB a session{against}"))
    tf32 = _figures(report, "tf32") or {}
    if "condition_tf32_max" in tf32:
        where = "TF32 on this device" if tf32["tf32_applies"] else "no TF32 on this device: IEEE both ways"
        rows.append(("condition encoder, float32 as served vs IEEE (relative max / rms)",
                     f"{tf32['condition_tf32_max']:.2e} / {tf32['condition_tf32_rms']:.2e} over "
                     f"{tf32['condition_chunks']} chunks; the bf16 rounding at the DiT's input "
                     f"{tf32['condition_rounding_max']:.2e} / {tf32['condition_rounding_rms']:.2e}: "
                     f"{'within' if tf32['condition_tf32_within_rounding'] else 'OUTSIDE'} it ({where})"))
    if "decoder_tf32_max_levels" in tf32:
        rows.append(("Wan decoder, float32 as served vs IEEE",
                     f"max {tf32['decoder_tf32_max_levels']:.3g} of 255 levels"))
    no_sync = _figures(report, "no_sync") or {}
    if "result" in no_sync:
        rows.append((f"no host sync on the DiT step path ({no_sync['regions']})", no_sync["result"]))
    inter = _figures(report, "interleaving") or {}
    if "intact" in inter:
        rows.append((f"two sessions interleaved ({inter['regions']}): outputs intact", str(inter["intact"])))
    rows += _snapshot_rows(report)
    rows += _memory_rows(report)
    rows += _comm_rows(report)
    life = _figures(report, "lifecycle") or {}
    if "capacity" in life:
        w, memory = life["warmup"], life["memory"]
        mem_text = "no device memory to measure (the budget rule)" if memory is None else (
            f"free {_gib(memory['free'])} of {_gib(memory['total'])} GiB, peak {_gib(memory['peak'])} GiB")
        rows.append((f"RankLifecycle, {life['layers']} layers at these dims, from safetensors",
                     f"wrote {_gib(life['checkpoint_bytes'])} GiB in {life['write_s']:.1f} s; connect + load "
                     f"{life['connect_and_load_s']:.1f} s; warm-up {w['chunks']} chunks in {w['seconds']:.1f} s "
                     f"(first {w['first_chunk_s']:.2f} s, compiled: {life['compiled']}); kernel "
                     f"{life['attention_kernel']}; {mem_text}; capacity of the {life['layers']}-layer model "
                     f"{life['capacity']} sessions (cap {life['capacity_cap']}), not the preset's"))
    return [(k, v.replace("|", "/")) for k, v in rows]


def _snapshot_rows(report: dict) -> list[tuple[str, str]]:
    snap = _figures(report, "snapshots") or {}
    rows = []
    if "host_plan" in snap:
        rows.append((f"snapshots on this host ({_gib(snap['host_memory_bytes'])} GiB, SP-1)", snap["host_plan"]))
    if "chunk_s" in snap:
        how = "side stream, pinned" if snap["asynchronous"] else "no side stream on this device: a plain copy"
        rows.append((f"whole chunk with its snapshot ({snap['regions']})",
                     f"{_ms(snap['chunk_s'])} ms alone, {_ms(snap['chunk_sync_snapshot_s'])} ms with a synchronous "
                     f"copy ({_pct(snap['sync_cost'])}), {_ms(snap['chunk_async_snapshot_s'])} ms with the "
                     f"asynchronous one ({_pct(snap['async_cost'])}; {how})"))
    if "bytes" in snap:
        rows.append(("snapshot per chunk", f"{_gib(snap['bytes'])} GiB: K/V slot {_gib(snap['slot_bytes'])} GiB, state "
                                           f"{_gib(snap['state_bytes'])} GiB (budget model "
                                           f"{_gib(snap['budget_slot_bytes'])} + {_gib(snap['budget_state_bytes'])} "
                                           f"GiB at its largest)"))
        rows.append(("snapshot copy alone, device idle",
                     f"synchronous {_ms(snap['copy_sync_s'])} ms ({snap['copy_sync_gb_per_s']:.1f} GB/s); asynchronous "
                     f"{_ms(snap['copy_async_s'])} ms ({snap['copy_async_gb_per_s']:.1f} GB/s), queued in "
                     f"{_ms(snap['copy_async_queue_s'])} ms; copied during the next chunk, bitwise: "
                     f"{snap['async_bitwise']}"))
        rows.append(("snapshot copy at the budget's largest, per chunk",
                     f"{_gib(snap['budget_model_bytes'])} GiB in {_ms(snap['budget_copy_s'])} ms at the rate above "
                     f"({snap['budget_copy_fraction_of_chunk']:.1%} of the chunk alone); the keeper holds "
                     f"{_gib(snap['budget_held_bytes'])} GiB per session"))
    return rows


def _memory_rows(report: dict) -> list[tuple[str, str]]:
    mem = _figures(report, "memory") or {}
    rows = []
    if "dit_session" in mem:
        dit = mem["dit_session"]
        rows.append((f"one DiT session (K/V window + text K/V; {mem['regions']})",
                     f"owns {_gib(dit['owned_bytes'])} GiB, allocator {_gib(dit['allocated_bytes'])} GiB; "
                     f"budget model {_gib(dit['budget_bytes'])} GiB"))
    if "whole_session" in mem:
        whole, budget = mem["whole_session"], mem["budget_model"]
        rows.append((f"one whole session, max over {whole['chunks']} chunks",
                     f"owns {_gib(whole['max_owned_bytes'])} GiB, allocator {_gib(whole['max_allocated_bytes'])} "
                     f"GiB; budget model {_gib(whole['budget_bytes'])} GiB, of it held between chunks "
                     f"{_gib(whole['budget_held_bytes'])} GiB"))
        parts = ", ".join(f"{k} {_gib(v)} / {_gib(budget.get(k))}" for k, v in whole["parts_max"].items())
        rows.append(("whole session by part, GiB measured / budget model",
                     parts + " (camera modulation: made and dropped within each chunk)"))
    return rows


def _comm_rows(report: dict) -> list[tuple[str, str]]:
    record = report["stages"].get("comm", {})
    comm = record.get("figures") or {}
    if record.get("status") == "not applicable":
        return [("NCCL and NVML", f"not applicable: {record['reason']}")]
    rows = []
    if "nvml" in comm:
        util = "-" if comm["utilization"] is None else f"{comm['utilization']:.0f}%"
        rows.append(("NVML read (as a rank's device metrics)",
                     f"{comm['nvml']}: utilisation {util}, memory used {_gib(comm['memory_used_bytes'])} of "
                     f"{_gib(comm['memory_total_bytes'])} GiB (pynvml: {comm['pynvml']})"))
    if "collectives" in comm:
        calls = ", ".join(f"{name} {r['result']}" + (f" {r['ms']:.2f} ms" if "ms" in r else "")
                          for name, r in comm["collectives"].items())
        rows.append((f"NCCL {comm['nccl_version']} at world size 1",
                     f"Comm.init {comm['init_s']:.1f} s ({comm['backend']}); {calls}"))
    return rows
