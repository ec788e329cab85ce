"""What a fixed mmap threshold costs a CPU rank's chunks: the tiny pipeline's steady chunk time in fresh processes
with glibc's own (dynamic) threshold and with it fixed as a serving rank fixes it (deployments/memory.py,
keep_large_blocks_mapped) or at larger values, alternating in one run; prints each threshold's median and its
ratio to glibc's own.

    python -m perf.malloc_threshold [--rounds 2] [--chunks 8] [--thresholds 131072,1048576,4194304]

A process that fixes the threshold maps every block at least that large on its own and unmaps it when freed, so
a chunk that allocates many such blocks (the VAE's activations at 112x64 are ~1 MiB) faults their pages in
anew each time; glibc's own threshold rises to the size of the blocks freed and then keeps them in its arenas.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

CHILD = """
import json, statistics, sys, time
threshold, chunks = int(sys.argv[1]), int(sys.argv[2])
if threshold:
    from deployments.memory import keep_large_blocks_mapped
    assert keep_large_blocks_mapped(threshold)                    # what a serving rank calls (at 128 KiB)
import torch
torch.set_num_threads(1)                                          # as a rank runs
from lingbot.builder import build_pipeline
from perf.pipeline_time import run_session
pipeline = build_pipeline("tiny", None, device="cpu")
run_session(pipeline, 2, True)                                    # warm
cpu = time.process_time()
rows, _ = run_session(pipeline, chunks, True)
print(json.dumps({"median_s": statistics.median(r["total"] for r in rows[1:]),
                  "cpu_s": time.process_time() - cpu}))
"""


def measure(threshold: int, chunks: int) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, str(threshold), str(chunks)], capture_output=True,
                         text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--chunks", type=int, default=8)
    p.add_argument("--thresholds", default="131072,1048576,4194304",
                   help="fixed thresholds in bytes, each against glibc's own (0)")
    args = p.parse_args(argv)
    sides = [0] + [int(t) for t in args.thresholds.split(",")]
    results: dict[int, list[dict]] = {t: [] for t in sides}
    for r in range(args.rounds):
        for t in sides:
            results[t].append(measure(t, args.chunks))
            print(f"round {r + 1}: threshold {t or 'glibc'}: {results[t][-1]['median_s'] * 1e3:.0f} ms",
                  file=sys.stderr)
    base = statistics.median(m["median_s"] for m in results[0])
    print(f"tiny steady chunk, 1 thread, {args.rounds} rounds of {args.chunks} chunks, medians:")
    for t in sides:
        med = statistics.median(m["median_s"] for m in results[t])
        name = "glibc's own" if t == 0 else f"fixed at {t // 1024} KiB"
        print(f"  {name:>20}: {med * 1e3:7.1f} ms  ({med / base:.2f}x glibc's own)")


if __name__ == "__main__":
    main()
