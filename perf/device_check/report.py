"""The device check's report: the markdown tables for perf/README.md (`render_table`: the modes, the
checks, the stages) made from the JSON report, and `modes_of`, the per-mode figures the JSON keeps too."""
from __future__ import annotations

from typing import Optional

from .check import GOAL_DIT_FRACTION, GOAL_WHOLE_CHUNK_S

# ---------------------------------------------------------------------------------------------------
# the table
# ---------------------------------------------------------------------------------------------------
GIB = 2 ** 30
MODES = {"eager": ("eager_dit", "eager_whole"), "compiled": ("compiled",), "compiled+graphs": ("graphs",)}


def _figures(report: dict, stage: str) -> Optional[dict]:
    record = report["stages"].get(stage, {})
    return record.get("figures") if record.get("status") == "ok" else None


def modes_of(report: dict) -> dict:
    """mode -> the DiT and whole-chunk figures its stages measured (eager's come from two stages)."""
    modes = {}
    for mode, stages in MODES.items():
        merged = {}
        for stage in stages:
            merged.update(_figures(report, stage) or {})
        if merged:
            merged.pop("regions", None)
            modes[mode] = {k: v for k, v in merged.items() if not isinstance(v, list)}
    return modes


def _ms(seconds) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.1f}"


def _gib(nbytes) -> str:
    return "-" if nbytes is None else f"{nbytes / GIB:.3f}"


def _pct(x) -> str:
    return "-" if x is None else f"{x:+.1%}"


def render_table(report: dict) -> str:
    """The markdown for perf/README.md: a heading line, the modes, the checks, the stages."""
    lines = [f"Device check: {report['preset']} {report['size']} {report['dtype']} on {report['device']} "
             f"({report['device_name']}), torch {report['torch']}, {report['started_utc']}; "
             f"{report['elapsed_s']:.0f} s of a {report['deadline_s']:g} s deadline.", ""]
    setup = _figures(report, "setup")
    if setup:
        lines += [f"Build {setup['build_s']:.1f} s; weights {_gib(setup['weights_bytes'])} GiB; matmul peak "
                  f"{setup['matmul_peak_tflops']:.3g} TFLOP/s; steady DiT chunk {setup['dit_chunk_tflop']:.4g} TFLOP.",
                  ""]
    modes = report.get("modes") or modes_of(report)
    if modes:
        lines += ["| mode | DiT warm-up s | DiT 1st chunk s | DiT steady ms | whole steady ms | DiT TFLOP/s | of peak |"
                  " chunk 0 vs eager |",
                  "|---|---:|---:|---:|---:|---:|---:|---|"]
        for mode, m in modes.items():
            tflops = "-" if m.get("dit_tflops") is None else f"{m['dit_tflops']:.3g}"
            frac = "-" if m.get("dit_fraction_of_peak") is None else f"{m['dit_fraction_of_peak']:.1%}"
            warm = "-" if m.get("dit_warmup_s") is None else f"{m['dit_warmup_s']:.1f}"
            first = "-" if m.get("dit_first_chunk_s") is None else f"{m['dit_first_chunk_s']:.2f}"
            versus = "-"
            if "chunk0_relative_diff" in m:
                versus = (f"{m['chunk0_relative_diff']:.2e} ({'within' if m['within_tolerance'] else 'OUTSIDE'} "
                          f"{report['compile_tolerance']:g})")
            lines.append(f"| {mode} | {warm} | {first} | {_ms(m.get('dit_steady_s'))} | "
                         f"{_ms(m.get('whole_steady_s'))} | {tflops} | {frac} | {versus} |")
        lines.append("")
    lines += ["| check | result |", "|---|---|"] + [f"| {k} | {v} |" for k, v in _checks(report, modes)]
    lines += ["", "| stage | status | s | estimate s | note |", "|---|---|---:|---:|---|"]
    for name, r in report["stages"].items():
        note = r.get("reason") or (r.get("error", "").splitlines() or [""])[0][:160]
        seconds = "-" if r.get("seconds") is None else f"{r['seconds']:.1f}"
        estimate = "-" if r.get("estimate_s") is None else f"{r['estimate_s']:.0f}"
        lines.append(f"| {name} | {r['status']} | {seconds} | {estimate} | {note.replace('|', '/')} |")
    return "\n".join(lines) + "\n"


def _checks(report: dict, modes: dict) -> list[tuple[str, str]]:
    rows = []
    setup = _figures(report, "setup")
    if setup:
        trials = ", ".join(f"{t['name']} {t['ms']:.3f} ms" if t["ms"] is not None else f"{t['name']} dropped"
                           for t in setup["attention_trials"])
        rows.append(("attention kernel", f"{setup['attention_kernel']} ({trials})"))
    whole = _figures(report, "eager_whole") or _figures(report, "compiled") or _figures(report, "graphs")
    if whole and whole.get("condition_encode_s"):
        steady = whole.get("condition_encode_steady_s")
        rows.append(("condition encoder until its fixed point",
                     f"fixed point at chunk {whole.get('condition_fixed_point_chunk')}; "
                     f"{_ms(steady)} ms per chunk after chunk 0 (the whole chunks above replay it: "
                     f"{whole['condition_replayed']})"))
    for mode, m in modes.items():
        if "vs_eager_max_abs" in m:
            rows.append((f"{mode} vs eager latents, all chunks", f"max abs diff {m['vs_eager_max_abs']:.2e}"))
    graphs = _figures(report, "graphs")
    if graphs and "graphs_vs_compiled_bitwise" in graphs:
        rows.append(("graph replay vs compiled latents, bitwise", str(graphs["graphs_vs_compiled_bitwise"])))
    tiny = _figures(report, "tiny_decoder")
    if tiny:
        rows.append((f"tiny decoder at {tiny['size']} ({tiny['dtype']})",
                     f"{_ms(tiny['chunk_s'])} ms per steady chunk ({tiny['gflop_per_chunk']:.4g} GFLOP, "
                     f"{tiny['tflops']:.3g} TFLOP/s); peak {_gib(tiny['peak_bytes'])} GiB; cache "
                     f"{_gib(tiny['cache_bytes'])} GiB a session; vs fp32 max {tiny['vs_fp32_max_abs']:.3g}, "
                     f"mean {tiny['vs_fp32_mean_abs']:.3g} (pixels in [-1, 1])"))
    no_sync = _figures(report, "no_sync")
    if no_sync:
        rows.append((f"no host sync on the DiT step path ({no_sync['regions']})", no_sync["result"]))
    inter = _figures(report, "interleaving")
    if inter:
        rows.append((f"two sessions interleaved ({inter['regions']}): outputs intact", str(inter["intact"])))
    snap = _figures(report, "snapshots")
    if snap:
        how = "side stream, pinned" if snap["asynchronous"] else "no side stream on this device: a plain copy"
        rows.append((f"snapshot per chunk ({snap['regions']})",
                     f"{_gib(snap['bytes'])} GiB: K/V slot {_gib(snap['slot_bytes'])} GiB, state "
                     f"{_gib(snap['state_bytes'])} GiB (budget model {_gib(snap['budget_slot_bytes'])} + "
                     f"{_gib(snap['budget_state_bytes'])} GiB at its largest); whole chunk "
                     f"{_ms(snap['chunk_s'])} ms alone, {_ms(snap['chunk_sync_snapshot_s'])} ms with a synchronous "
                     f"copy ({_pct(snap['sync_cost'])}), {_ms(snap['chunk_async_snapshot_s'])} ms with the "
                     f"asynchronous one ({_pct(snap['async_cost'])}; {how})"))
        rows.append(("snapshot copy alone, device idle",
                     f"synchronous {_ms(snap['copy_sync_s'])} ms ({snap['copy_sync_gb_per_s']:.1f} GB/s); asynchronous "
                     f"{_ms(snap['copy_async_s'])} ms ({snap['copy_async_gb_per_s']:.1f} GB/s), queued in "
                     f"{_ms(snap['copy_async_queue_s'])} ms; copied during the next chunk, bitwise: "
                     f"{snap['async_bitwise']}"))
        rows.append(("snapshot copy at the budget's largest, per chunk",
                     f"{_gib(snap['budget_model_bytes'])} GiB in {_ms(snap['budget_copy_s'])} ms at the rate above "
                     f"({snap['budget_copy_fraction_of_chunk']:.1%} of the chunk alone); the keeper holds "
                     f"{_gib(snap['budget_held_bytes'])} GiB per session"))
    mem = _figures(report, "memory")
    if mem:
        dit, whole_s, budget = mem["dit_session"], mem["whole_session"], mem["budget_model"]
        rows.append(("one DiT session (K/V window + text K/V)",
                     f"owns {_gib(dit['owned_bytes'])} GiB, allocator {_gib(dit['allocated_bytes'])} GiB; "
                     f"budget model {_gib(dit['budget_bytes'])} GiB"))
        rows.append((f"one whole session, max over {whole_s['chunks']} chunks",
                     f"owns {_gib(whole_s['max_owned_bytes'])} GiB, allocator {_gib(whole_s['max_allocated_bytes'])} "
                     f"GiB; budget model {_gib(whole_s['budget_bytes'])} GiB, of it held between chunks "
                     f"{_gib(whole_s['budget_held_bytes'])} GiB"))
        parts = ", ".join(f"{k} {_gib(v)} / {_gib(budget.get(k))}" for k, v in whole_s["parts_max"].items())
        rows.append(("whole session by part, GiB measured / budget model",
                     parts + " (camera modulation: made and dropped within each chunk)"))
    life = _figures(report, "lifecycle")
    if life:
        w, memory = life["warmup"], life["memory"]
        mem_text = "no device memory to measure (the budget rule)" if memory is None else (
            f"free {_gib(memory['free'])} of {_gib(memory['total'])} GiB, peak {_gib(memory['peak'])} GiB")
        rows.append((f"RankLifecycle, {life['layers']} layers at these dims, from safetensors",
                     f"wrote {_gib(life['checkpoint_bytes'])} GiB in {life['write_s']:.1f} s; connect + load "
                     f"{life['connect_and_load_s']:.1f} s; warm-up {w['chunks']} chunks in {w['seconds']:.1f} s "
                     f"(first {w['first_chunk_s']:.2f} s, compiled: {life['compiled']}); kernel "
                     f"{life['attention_kernel']}; {mem_text}; capacity {life['capacity']} sessions "
                     f"(cap {life['capacity_cap']})"))
    if report["preset"] == "lingbot-world-v2-14b" and modes:
        wholes = {k: m["whole_steady_s"] for k, m in modes.items() if m.get("whole_steady_s") is not None}
        fracs = {k: m["dit_fraction_of_peak"] for k, m in modes.items() if m.get("dit_fraction_of_peak") is not None}
        if wholes:
            best = min(wholes, key=wholes.get)
            met = "met" if wholes[best] <= GOAL_WHOLE_CHUNK_S else "not met"
            rows.append((f"goal: whole steady chunk <= {GOAL_WHOLE_CHUNK_S * 1e3:.0f} ms",
                         f"{_ms(wholes[best])} ms ({best}): {met}"))
        if fracs:
            best = max(fracs, key=fracs.get)
            rows.append((f"goal: DiT >= {GOAL_DIT_FRACTION:.0%} of the matmul peak",
                         f"{fracs[best]:.1%} ({best}): {'met' if fracs[best] >= GOAL_DIT_FRACTION else 'not met'}"))
    return [(k, v.replace("|", "/")) for k, v in rows]
