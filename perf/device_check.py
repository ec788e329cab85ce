"""The one prepared check for a lent GPU: what only a device can show, measured side by side in one run.

    python -m perf.device_check                                   # lingbot-world-v2-14b dims on cuda
    python -m perf.device_check --preset tiny --device cpu        # the same script end to end on any machine
        [--steady 3] [--json out.json] [--no-compile] [--no-graphs] [--peak-seconds 2]

It builds the preset with seeded random weights straight on the device in its dtype (no checkpoint; no
text encoder: a random text embedding stands in for UMT5's output), chooses the attention kernel at the
steady-state shape, then for eager, regional compile, and the compiled regions as CUDA graphs: warm-up
(every window length a session passes through), the steady DiT chunk (prepare, 4 probes, commit) and
the steady whole chunk (condition, DiT, VAE decode, uint8, the copy to the host), the DiT's achieved
FLOP/s from the cost model against the device's measured matmul peak, and memory (weights, peak, one
session measured against the budget model). Checks: compiled and graph latents within the stated
tolerance of eager (a GPU eager reference: TF32 convolutions and the CUDA RNG make CPU values irrelevant
here), graph replay bitwise equal to the compiled result, two sessions interleaved leave each other's
outputs intact, and no host synchronisation on the DiT step path (CUDA:
torch.cuda.set_sync_debug_mode("error")). Then the session snapshot (for resuming after a fault): the
whole chunk alone, with a synchronous copy of its snapshot to the host, and with the asynchronous one
(a side stream into pinned memory, overlapping the next chunk), and whether the asynchronous copy, made
while the next chunk ran, is bitwise the synchronous one. Prints a table and writes one JSON. The whole
run is sized for at most 8 minutes on one H200.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
import traceback
from collections.abc import Callable
from functools import partial

import numpy as np
import torch

from lingbot.builder import build_pipeline
from lingbot.camera import Controls
from lingbot.config import get_preset
from lingbot.runtime.attention import choose_for_steady_state
from lingbot.runtime.budget import session_footprint
from lingbot.runtime.compile import compile_blocks, uncompile_blocks
from lingbot.runtime.condition import LatentCondition
from lingbot.runtime.snapshot import HostCopier, take_snapshot
from perf.cost_model import matmul_peak, preset_chunk_flops

# compiled vs eager on the first chunk, relative to its largest value: bf16 fused kernels round differently
# (later chunks drift further through the chained K/V, so they are reported, not judged)
COMPILE_TOLERANCE = 2e-2
KEYS = Controls(keys=("w", "l", "i"))


def _sync(device: torch.device) -> None:
    if device.type != "cpu":
        torch.accelerator.synchronize(device)


def _timed(device: torch.device, fn: Callable) -> tuple[float, object]:
    _sync(device)
    t0 = time.perf_counter()
    out = fn()
    _sync(device)
    return time.perf_counter() - t0, out


def _allocated(device: torch.device) -> int:
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else 0


def _measure_mode(pipe, text, latents, image, warm: int, steady: int, device) -> dict:
    """Warm-up and steady chunk times of the DiT alone and of the whole chunk, and the DiT's latents (one
    session at a time: at 14B a session's slab is ~21 GiB)."""
    runner = pipe.runner
    before = _allocated(device)
    dit = runner.new_session(LatentCondition(latents), text_embedding=text, seed=0)
    dit_times, outs = [], []
    for _ in range(warm + steady):
        seconds, result = _timed(device, partial(dit.run_chunk, KEYS))
        dit_times.append(seconds)
        outs.append(result.latents)
    session_bytes = _allocated(device) - before          # slab, text K/V and caches (and the outputs kept)
    del dit
    whole = pipe.new_session(image, None, seed=0, text_embedding=text)
    whole_times = []
    for _ in range(warm + steady):
        seconds, _ = _timed(device, lambda: whole.step(KEYS).frames.cpu())
        whole_times.append(seconds)
    return {"warmup_s": sum(dit_times[:warm]) + sum(whole_times[:warm]), "first_chunk_s": dit_times[0],
            "dit_steady_s": statistics.median(dit_times[warm:]),
            "whole_steady_s": statistics.median(whole_times[warm:]),
            "session_bytes_measured": session_bytes, "latents": torch.cat(outs, dim=1).float().cpu()}


def _interleaved_check(pipe, text, latents, chunks: int, device) -> bool:
    """With the last mode's regions (graphs when built): session A alone, then A again interleaved chunk by
    chunk with a session B; A's latents must be the same bitwise (no replay overwrote what A still used)."""
    def session(seed):
        return pipe.runner.new_session(LatentCondition(latents), text_embedding=text, seed=seed)
    alone = session(5)
    reference = [alone.run_chunk(KEYS).latents.clone() for _ in range(chunks)]
    del alone                                        # at 14B a session's slab is ~21 GiB: two at a time
    a, b = session(5), session(6)
    again = []
    for _ in range(chunks):
        again.append(a.run_chunk(KEYS).latents)
        b.run_chunk(KEYS)
    _sync(device)
    return all(torch.equal(x, y) for x, y in zip(reference, again))


def _no_sync_check(pipe, text, latents, warm: int, device) -> str:
    """A DiT chunk after `warm` chunks with every host synchronisation an error (CUDA); 'ok' or where."""
    session = pipe.runner.new_session(LatentCondition(latents), text_embedding=text, seed=1)
    for _ in range(warm):
        session.run_chunk(KEYS)
    if device.type != "cuda":
        return "n/a (CPU: tests/lingbot/runtime/test_dit_runner.py forbids host reads instead)"
    torch.cuda.set_sync_debug_mode("error")
    try:
        session.run_chunk(KEYS)
        return "ok"
    except RuntimeError as e:
        where = traceback.extract_tb(e.__traceback__)[-1]
        return f"synced: {str(e).splitlines()[0][:120]} at {where.filename}:{where.lineno}"
    finally:
        torch.cuda.set_sync_debug_mode(0)


def _snapshot_tensors(snapshot) -> list:
    slot, state = snapshot
    return slot.tensors() + state.tensors()


def _snapshot_check(pipe, text, image, steady: int, device) -> dict:
    """The steady whole chunk (as a rank runs it: frames to the host) with no snapshot, a synchronous one and
    an asynchronous one after each (median of `steady` each); then one asynchronous snapshot copied while
    the next chunk runs, against a synchronous snapshot of the same moment."""
    session = pipe.new_session(image, None, seed=0, text_embedding=text)
    for _ in range(2):
        session.step(KEYS)
    sync_copier, async_copier = HostCopier("cpu"), HostCopier(device)

    def period(after) -> float:
        times = []
        for _ in range(steady):
            t0 = time.perf_counter()
            session.step(KEYS).frames.cpu()
            after()
            times.append(time.perf_counter() - t0)
        _sync(device)
        return statistics.median(times)

    alone = period(lambda: None)
    synchronous = period(lambda: take_snapshot(session, copier=sync_copier))
    asynchronous = period(lambda: take_snapshot(session, copier=async_copier, key="check"))
    reference = take_snapshot(session, copier=sync_copier)
    copied = take_snapshot(session, copier=async_copier, key="check")
    session.step(KEYS)                                  # the next chunk runs while the copy goes on
    if async_copier.last is not None:
        async_copier.last.synchronize()
    pairs = list(zip(_snapshot_tensors(reference), _snapshot_tensors(copied)))
    exact = len(pairs) == len(_snapshot_tensors(reference)) and all(torch.equal(a, b) for a, b in pairs)
    return {"bytes": reference[0].nbytes() + reference[1].nbytes(), "asynchronous": async_copier.asynchronous,
            "chunk_s": alone, "chunk_sync_snapshot_s": synchronous, "chunk_async_snapshot_s": asynchronous,
            "async_bitwise": exact}


def run(args) -> dict:
    device = torch.device(args.device)
    preset = get_preset(args.preset)
    cfg = preset.transformer
    warm, steady = cfg.window_chunks + 1, args.steady
    torch.set_grad_enabled(False)
    t0 = time.perf_counter()
    pipe = build_pipeline(preset, device=device, compile=False, text_encoder=False, seed=0)
    _sync(device)
    build_s = time.perf_counter() - t0
    weights_bytes = _allocated(device) or sum(p.numel() * p.element_size() for p in pipe.runner.model.parameters())
    g = torch.Generator().manual_seed(0)
    text = (torch.randn(1, preset.text.max_length, cfg.text_dim, generator=g) * 0.1).to(device, preset.torch_dtype)
    latents = torch.randn(16, cfg.num_frames_per_block * (warm + steady), *preset.latent_hw, generator=g).to(device)
    image = np.random.RandomState(0).randint(0, 256, (preset.height, preset.width, 3), dtype=np.uint8)
    kernel, trials = choose_for_steady_state(pipe.runner.model, preset, device)

    modes = {"eager": _measure_mode(pipe, text, latents, image, warm, steady, device)}
    for name, wanted, graphs in (("compiled", args.compile, False), ("compiled+graphs", args.graphs, True)):
        if not wanted:
            continue
        uncompile_blocks(pipe.runner.model)
        torch._dynamo.reset()
        t = time.perf_counter()
        compile_blocks(pipe.runner.model, graphs=graphs)
        modes[name] = _measure_mode(pipe, text, latents, image, warm, steady, device)
        modes[name]["compile_and_warmup_s"] = time.perf_counter() - t
    interleaved = _interleaved_check(pipe, text, latents, 3, device)
    peak_bytes = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
    no_sync = _no_sync_check(pipe, text, latents, 2, device)
    snapshot = _snapshot_check(pipe, text, image, steady, device)

    flops = preset_chunk_flops(preset, warm).total                   # a steady chunk's DiT FLOPs
    # large matmuls on a GPU: small ones stay far from its peak and would flatter the achieved fraction
    peak_flops = matmul_peak(str(device), preset.dtype, n=8192 if device.type == "cuda" else 2048,
                             seconds=args.peak_seconds)
    budget_session = session_footprint(preset).total
    report = {
        "check": "lingbot_device_check", "preset": preset.name, "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.machine(),
        "torch": torch.__version__, "size": f"{preset.width}x{preset.height}", "dtype": preset.dtype,
        "build_s": build_s, "weights_bytes": weights_bytes, "peak_bytes": peak_bytes,
        "matmul_peak_tflops": peak_flops / 1e12, "dit_chunk_tflop": flops / 1e12,
        "session_bytes_budget_model": budget_session, "no_sync_on_step_path": no_sync, "modes": {},
        "snapshot": snapshot,
        "attention_kernel": kernel,
        "attention_trials": [{"name": t.name, "ms": None if t.seconds is None else t.seconds * 1e3,
                              "dropped": t.error} for t in trials],
    }
    for name, m in modes.items():
        report["modes"][name] = {k: v for k, v in m.items() if k != "latents"}
        report["modes"][name]["dit_tflops"] = flops / m["dit_steady_s"] / 1e12
        report["modes"][name]["dit_fraction_of_peak"] = flops / m["dit_steady_s"] / peak_flops
    report["compile_tolerance"] = COMPILE_TOLERANCE
    for name in ("compiled", "compiled+graphs"):
        if name in modes:
            ref, got = modes["eager"]["latents"], modes[name]["latents"]
            first = cfg.num_frames_per_block                          # chunk 0's latent frames
            relative = ((got[:, :first] - ref[:, :first]).abs().max() / ref[:, :first].abs().max()).item()
            report["modes"][name]["vs_eager_max_abs"] = (got - ref).abs().max().item()   # all chunks, reported
            report["modes"][name]["chunk0_relative_diff"] = relative
            report["modes"][name]["within_tolerance"] = relative <= COMPILE_TOLERANCE
    if "compiled" in modes and "compiled+graphs" in modes:
        report["graphs_vs_compiled_bitwise"] = torch.equal(modes["compiled"]["latents"],
                                                           modes["compiled+graphs"]["latents"])
    report["interleaved_sessions_intact"] = interleaved
    report["last_mode"] = list(modes)[-1]
    return report


def print_table(report: dict) -> None:
    gib = 2 ** 30
    print(f"device check: {report['preset']} {report['size']} {report['dtype']} on {report['device']} "
          f"({report['device_name']}), torch {report['torch']}")
    print(f"  build {report['build_s']:.1f} s; weights {report['weights_bytes'] / gib:.2f} GiB; "
          f"peak {report['peak_bytes'] / gib:.2f} GiB; matmul peak {report['matmul_peak_tflops']:.1f} TFLOP/s; "
          f"steady DiT chunk {report['dit_chunk_tflop']:.1f} TFLOP")
    print(f"  {'mode':<10} {'warm-up s':>10} {'1st chunk s':>12} {'DiT ms':>9} {'whole ms':>9} {'DiT TFLOP/s':>12} "
          f"{'of peak':>8}")
    for name, m in report["modes"].items():
        print(f"  {name:<10} {m['warmup_s']:>10.1f} {m['first_chunk_s']:>12.2f} {m['dit_steady_s'] * 1e3:>9.1f} "
              f"{m['whole_steady_s'] * 1e3:>9.1f} {m['dit_tflops']:>12.2f} {m['dit_fraction_of_peak']:>8.1%}")
    eager = report["modes"]["eager"]
    print(f"  one session measured {eager['session_bytes_measured'] / gib:.3f} GiB "
          f"vs budget model {report['session_bytes_budget_model'] / gib:.3f} GiB"
          + ("" if eager["session_bytes_measured"] else " (no device allocator on CPU)"))
    for name, m in report["modes"].items():
        if "vs_eager_max_abs" in m:
            ok = "within" if m["within_tolerance"] else "OUTSIDE"
            print(f"  {name} vs eager latents: chunk 0 relative {m['chunk0_relative_diff']:.2e} ({ok} "
                  f"{report['compile_tolerance']:g}); all chunks max |diff| {m['vs_eager_max_abs']:.2e}")
    if "graphs_vs_compiled_bitwise" in report:
        print(f"  graph replay vs compiled latents bitwise equal: {report['graphs_vs_compiled_bitwise']}")
    print(f"  two sessions interleaved ({report['last_mode']}): outputs intact: "
          f"{report['interleaved_sessions_intact']}")
    print(f"  attention kernel: {report['attention_kernel']} ("
          + ", ".join(f"{t['name']} {t['ms']:.3f} ms" if t["ms"] is not None else f"{t['name']} dropped"
                      for t in report["attention_trials"]) + ")")
    print(f"  no host sync on the step path: {report['no_sync_on_step_path']}")
    snap = report["snapshot"]
    how = "side stream, pinned" if snap["asynchronous"] else "no side stream on this device: a plain copy"
    print(f"  snapshot {snap['bytes'] / gib:.3f} GiB per chunk: whole chunk {snap['chunk_s'] * 1e3:.1f} ms alone, "
          f"{snap['chunk_sync_snapshot_s'] * 1e3:.1f} ms with a synchronous copy, "
          f"{snap['chunk_async_snapshot_s'] * 1e3:.1f} ms with the asynchronous one ({how}); "
          f"copied during the next chunk, bitwise: {snap['async_bitwise']}")


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="lingbot-world-v2-14b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--steady", type=int, default=3, help="steady chunks timed per measurement")
    ap.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--graphs", action=argparse.BooleanOptionalAction, default=True,
                    help="also compiled regions as CUDA graphs (on CPU: compiled without graphs)")
    ap.add_argument("--peak-seconds", type=float, default=2.0, help="how long the matmul peak is measured")
    ap.add_argument("--json", default="device_check.json", help="where the JSON goes")
    args = ap.parse_args(argv)
    if args.steady < 1:
        ap.error("--steady must be >= 1")
    report = run(args)
    print_table(report)
    with open(args.json, "w") as f:
        json.dump(report, f, indent=2)
    print(f"wrote {args.json}")
    return report


if __name__ == "__main__":
    main()
