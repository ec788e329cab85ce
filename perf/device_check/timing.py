"""The device check's timing stages: setup (the matmul peak, the pipeline, the attention kernel), the DiT
and the whole chunk eager, compiled and as CUDA graphs (with one denoising step and the latents against
eager's), no host sync on the DiT step path, two sessions interleaved and the quality ladder's step rungs; and
the sessions they share (`_dit_chunks`, `_whole_chunks`, `_prime_conditions`), timed by perf/timing.py's loop,
as every benchmark's. Each keeps its figures as it measures them."""
from __future__ import annotations

import statistics
import time
import traceback
from functools import partial

import numpy as np
import torch

from lingbot.builder import build_pipeline
from lingbot.config import tae_dtype
from lingbot.io.weights import build_random_tae
from lingbot.runtime.attention import choose_for_steady_state
from lingbot.runtime.condition import LatentCondition
from lingbot.runtime.rungs import RUNGS, forward_ratio, rung_name
from lingbot.transfer import to_device
from perf.cost_model import matmul_peak
from perf.decode_time import time_steps
from perf.timing import prime_conditions, sync, time_chunks, whole_chunk

from .check import KEYS, STEP_TOLERANCE, Check, NotApplicable, _allocated


def _dit_chunks(c: Check, seed: int = 0) -> dict:
    """A DiT-only session through warm-up (every window length) and `steady` chunks; keeps its latents by
    mode (one session at a time: at 14B a session's K/V slab is ~21 GiB) and its figures as measured (the
    first chunk's, which holds any compile, at once)."""
    session = c.pipe.runner.new_session(LatentCondition(c.latents), text_embedding=c.text, seed=seed)
    outs = []

    def keep(index: int, seconds: float, result) -> None:
        outs.append(result.latents)
        if index == 0:
            c.progress(f"  {c.mode}: first DiT chunk {seconds:.2f} s")
            c.keep(regions=c.mode, dit_first_chunk_s=seconds)
    times = time_chunks(partial(session.run_chunk, KEYS), c.warm + c.steady, c.device, each=keep)
    c.latents_by_mode[c.mode] = torch.cat(outs, dim=1).float().cpu()
    steady = times.median(c.warm)
    c.seconds["dit"] = steady
    figures = {"dit_first_chunk_s": times.first, "dit_warmup_s": sum(times.seconds[:c.warm]), "dit_steady_s": steady,
               "dit_chunk_s": times.seconds,
               "dit_tflops": c.flops / steady / 1e12,
               "dit_fraction_of_peak": c.flops / steady / c.peak_flops if c.peak_flops else None}
    c.keep(**figures)
    return figures


def _first_step(c: Check, seed: int = 0) -> None:
    """Chunk 0's first DiT forward (one denoising step through every layer) of a fresh session, kept by mode:
    the comparison of modes at depth, before the chained steps and chunks add their own drift."""
    outputs = []
    hook = c.pipe.runner.model.register_forward_hook(lambda module, args, out: outputs.append(out.float().cpu()))
    try:
        session = c.pipe.runner.new_session(LatentCondition(c.latents), text_embedding=c.text, seed=seed)
        session.run_chunk(KEYS, should_stop=lambda: len(outputs) > 0)     # stops before the second step
    finally:
        hook.remove()
    c.step_by_mode[c.mode] = outputs[0]


def _prime_conditions(c: Check) -> dict:
    """The condition encoder of the check's first frame alone to its fixed point, into the pipeline's shared
    condition cache (perf/timing.py): every whole session after it replays the conditions and never encodes,
    as a served session of a first frame seen before does (the steady state the goals speak of). Its time per
    chunk is the encoder's cost until the fixed point."""
    if c.pipe.condition_cache is None or not c.pipe.skip_fixed_point:
        return {"condition_replayed": False, "condition_encode_s": []}
    fixed, times = prime_conditions(c.pipe, c.image)
    c.conditions_primed = True
    return {"condition_fixed_point_chunk": fixed, "condition_encode_s": times,
            "condition_encode_steady_s": statistics.median(times[1:]) if len(times) > 1 else None}


def _whole_chunks(c: Check, seed: int = 0) -> dict:
    """A whole session (conditions, DiT, decode, uint8 frames copied to the host, as a rank runs a chunk)
    through warm-up and `steady` chunks."""
    if not c.conditions_primed:
        c.keep(**_prime_conditions(c))
    session = c.pipe.new_session(c.image, None, seed=seed, text_embedding=c.text)
    times = time_chunks(partial(whole_chunk, session, KEYS), c.warm + c.steady, c.device)
    steady = times.median(c.warm)
    c.seconds["whole"] = steady
    figures = {"regions": c.mode, "whole_warmup_s": sum(times.seconds[:c.warm]), "whole_first_chunk_s": times.first,
               "whole_steady_s": steady, "whole_chunk_s": times.seconds,
               "condition_replayed": session.condition.replay is not None,
               "condition_encoded_chunks": session.condition.encoded_chunks}
    c.keep(**figures)
    return figures


def _relative(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got - ref).abs().max() / ref.abs().max()).item()


def _versus(c: Check, mode: str) -> None:
    """`mode`'s DiT outputs against eager's, kept: one denoising step and chunk 0's latents (each against
    STEP_TOLERANCE), all chunks' (reported: later chunks drift further through the chained K/V); for
    graphs, bitwise against the compiled regions' (where those ran)."""
    out = {}
    if "eager" in c.step_by_mode and mode in c.step_by_mode:
        step = _relative(c.step_by_mode[mode], c.step_by_mode["eager"])
        out.update(step_relative_diff=step, within_tolerance=step <= STEP_TOLERANCE)
    got = c.latents_by_mode.get(mode)
    if "eager" in c.latents_by_mode and got is not None:
        ref = c.latents_by_mode["eager"]
        first = c.preset.transformer.num_frames_per_block                 # chunk 0's latent frames
        chunk0 = _relative(got[:, :first], ref[:, :first])
        out.update(vs_eager_max_abs=(got - ref).abs().max().item(), chunk0_relative_diff=chunk0,
                   chunk0_within_tolerance=chunk0 <= STEP_TOLERANCE)
    if mode == "compiled+graphs" and "compiled" in c.latents_by_mode and got is not None:
        out["graphs_vs_compiled_bitwise"] = torch.equal(got, c.latents_by_mode["compiled"])
    c.keep(**out)


# ---------------------------------------------------------------------------------------------------
# the stages
# ---------------------------------------------------------------------------------------------------
def stage_setup(c: Check) -> None:
    # large matmuls on a GPU: small ones stay far from its peak and would flatter the achieved fraction
    c.peak_flops = matmul_peak(str(c.device), c.preset.dtype, n=8192 if c.device.type == "cuda" else 2048,
                               seconds=c.args.peak_seconds)
    c.keep(matmul_peak_tflops=c.peak_flops / 1e12, dit_chunk_tflop=c.flops / 1e12)
    cfg = c.preset.transformer
    t0 = time.perf_counter()
    c.pipe = build_pipeline(c.preset, device=c.device, compile=False, text_encoder=False, seed=0)
    sync(c.device)
    build_s = time.perf_counter() - t0
    c.weights_bytes = _allocated(c.device) or sum(p.numel() * p.element_size()
                                                  for p in c.pipe.runner.model.parameters())
    c.keep(build_s=build_s, weights_bytes=c.weights_bytes)
    g = torch.Generator().manual_seed(0)
    # stand-ins: a text encoder output [1, T, text_dim] and image latents [16, F, h, w] for every chunk run
    c.text = (torch.randn(1, c.preset.text.max_length, cfg.text_dim, generator=g) * 0.1).to(
        c.device, c.preset.torch_dtype)
    c.latents = torch.randn(16, cfg.num_frames_per_block * (c.warm + c.steady), *c.preset.latent_hw,
                            generator=g).to(c.device)
    c.image = np.random.RandomState(0).randint(0, 256, (c.preset.height, c.preset.width, 3), dtype=np.uint8)
    kernel, trials = choose_for_steady_state(c.pipe.runner.model, c.preset, c.device)
    c.keep(attention_kernel=kernel,
           attention_trials=[{"name": t.name, "ms": None if t.seconds is None else t.seconds * 1e3,
                              "dropped": t.error} for t in trials])


def stage_eager_dit(c: Check) -> None:
    _dit_chunks(c)
    _first_step(c)


def stage_eager_whole(c: Check) -> None:
    _whole_chunks(c)


def _compiled(c: Check) -> None:
    """The regions the runner put in place (compiled, or as CUDA graphs), compiled at their first chunk."""
    t0 = time.perf_counter()
    figures = _dit_chunks(c)
    # compiles (and graph captures) land in the first chunk; later window lengths reuse them
    c.seconds["compile"] = max(0.0, figures["dit_first_chunk_s"] - figures["dit_steady_s"])
    _first_step(c)
    _versus(c, c.mode)
    _whole_chunks(c)
    c.keep(compile_and_warmup_s=time.perf_counter() - t0)


def stage_compiled(c: Check) -> None:
    _compiled(c)


def stage_graphs(c: Check) -> None:
    """On CUDA the regions as CUDA graphs; elsewhere inductor runs the same mode without graphs."""
    _compiled(c)


def stage_no_sync(c: Check, warm: int = 2) -> None:
    """A DiT chunk after `warm` chunks, and a host-to-device copy through to_device, with every host
    synchronisation an error (CUDA); 'ok' or where."""
    if c.device.type != "cuda":
        raise NotApplicable("no sync debug mode off CUDA (tests/lingbot/runtime/test_dit_runner.py forbids "
                            "host reads on CPU instead)")
    session = c.pipe.runner.new_session(LatentCondition(c.latents), text_embedding=c.text, seed=1)
    for _ in range(warm):
        session.run_chunk(KEYS)
    torch.cuda.set_sync_debug_mode("error")
    try:
        # the one way host data reaches the device on the chunk path: pinned and asynchronous
        copied = to_device(np.linspace(0, 1, 16), c.device, torch.float32)
        session.run_chunk(KEYS)
        result = "ok" if copied.device.type == "cuda" else f"to_device gave {copied.device}"
    except RuntimeError as e:
        where = traceback.extract_tb(e.__traceback__)[-1]
        result = f"synced: {str(e).splitlines()[0][:120]} at {where.filename}:{where.lineno}"
    finally:
        torch.cuda.set_sync_debug_mode(0)
    c.keep(regions=c.mode, result=result)


def stage_interleaving(c: Check, chunks: int = 3) -> None:
    """With the regions in place (graphs when built): session A alone, then A again interleaved chunk by
    chunk with a session B; A's latents must be the same bitwise (no replay overwrote what A still used)."""
    def session(seed):
        return c.pipe.runner.new_session(LatentCondition(c.latents), text_embedding=c.text, seed=seed)
    alone = session(5)
    reference = [alone.run_chunk(KEYS).latents.clone() for _ in range(chunks)]
    del alone                                        # at 14B a session's slab is ~21 GiB: two at a time
    a, b = session(5), session(6)
    again = []
    for _ in range(chunks):
        again.append(a.run_chunk(KEYS).latents)
        b.run_chunk(KEYS)
    sync(c.device)
    c.keep(regions=c.mode, chunks=chunks, intact=all(torch.equal(x, y) for x, y in zip(reference, again)))


def stage_rungs(c: Check) -> None:
    """The quality ladder's rungs (lingbot/runtime/rungs.py): the step rungs timed on one DiT session past its
    sink, `steady` chunks at each rung in turn, their medians and their ratio to full's beside the cost model's
    forward ratio (perf/rungs.py has the modelled TFLOP); then a steady chunk's decode by each decoder (the Wan
    decoder of the pipeline, the tiny one in its serving dtype), so each rung's whole chunk, the decoder rungs'
    included, and the Wan decode's share of a full chunk (the ladder's seed, WAN_DECODE_SHARE) are measured, and
    what a climb back to the Wan decoder would cost at once (its history's chunks and the chunk's own)."""
    cfg = c.preset.transformer
    warm = max(c.warm, cfg.sink_chunks)                # the sink runs every step whatever the rung
    rungs = [r for r in RUNGS if r.decoder is None]
    frames = cfg.num_frames_per_block * (warm + c.steady * len(rungs))
    latents = c.latents.repeat(1, -(-frames // c.latents.shape[1]), 1, 1)[:, :frames]
    session = c.pipe.runner.new_session(LatentCondition(latents), text_embedding=c.text, seed=2)
    for _ in range(warm):
        session.run_chunk(KEYS)
    steady = {}
    for rung in rungs:
        steady[rung.name] = time_chunks(partial(session.run_chunk, KEYS, steps=rung.steps), c.steady,
                                        c.device).median(0)
        c.progress(f"  {c.mode}: rung {rung.name} {steady[rung.name]:.2f} s a DiT chunk")
    c.keep(regions=c.mode, rung_steady_s=steady,
           rung_ratio={name: s / steady["full"] for name, s in steady.items()},
           rung_forward_ratio={r.name: forward_ratio(len(c.preset.sampler.timesteps), r.steps) for r in rungs})
    decode = decode_chunk_s(c)
    whole = {r.name: steady[rung_name(r.steps, None)] + decode[r.decoder or "wan"] for r in RUNGS}
    warm_chunks = -(-c.pipe.vae.history_frames() // cfg.num_frames_per_block)
    c.progress(f"  {c.mode}: a chunk's decode: wan {decode['wan']:.3f} s, tae {decode['tae']:.4f} s")
    c.keep(decode_chunk_s=decode, rung_chunk_s=whole, rung_chunk_ratio={n: t / whole["full"] for n, t in whole.items()},
           wan_decode_share=decode["wan"] / whole["full"], climb_at_once_decode_s=(warm_chunks + 1) * decode["wan"])


def decode_chunk_s(c: Check) -> dict[str, float]:
    """Seconds of a steady chunk's decode (its latent frames, after the stream's first) by each decoder."""
    frames = c.preset.transformer.num_frames_per_block
    tae = build_random_tae(c.preset.tae, c.preset.weights_seed or 0, tae_dtype(c.device), c.device)
    out = {}
    for name, model in (("wan", c.pipe.vae), ("tae", tae)):
        times, _ = time_steps(model, c.preset.latent_hw, frames * c.steady, c.device)
        out[name] = frames * statistics.median(times)
    return out
