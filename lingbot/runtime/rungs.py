"""The quality ladder's rungs: named, deterministic configurations of one chunk, cheaper than the session's
own (docs/architecture.md, "Rungs").

A rung runs fewer of the sampler's denoising probes, or decodes with the tiny decoder instead of the Wan
decoder (a decoder rung: for a session whose own decoder is the Wan one, where both are loaded; switching
decoders is exact, lingbot/runtime/decoding.py). The probes it keeps
(`kept_steps`): the first (the only one that starts from pure noise) and, from two probes on, the last (the
lowest timestep, the finest detail the distilled model was trained to finish at), and the rest evenly
between by index; a rung of one probe keeps the first alone. The model was distilled on its schedule's
timesteps (v2: 1000, 750, 500, 250; v1: 1000, 821, 642, 321) and predicts the clean latents at each of them,
so a subset re-noises the last prediction straight to the next timestep it keeps: 3 probes of v2 keep 1000,
500, 250; 2 keep 1000, 250. The commit forward (t = 0)
and the K/V it writes are the same on every rung. A probe that is skipped still draws its re-noise from the
session's generator, so what comes after a chunk does not depend on its rung except through its latents.
The sink (the first chunks, attended by every later chunk for the session's life) always runs every probe.
Quality cannot be judged on random weights; the rungs are ordered by cost (perf/README.md, "Rungs").
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


def kept_steps(num_steps: int, steps: Optional[int]) -> tuple[int, ...]:
    """The probe indices a rung of `steps` denoising forwards runs out of the schedule's `num_steps` (None or
    at least num_steps: all of them): the first, the last, and the rest evenly between by index."""
    if steps is None or steps >= num_steps:
        return tuple(range(num_steps))
    if steps < 1:
        raise ValueError(f"a rung runs at least 1 denoising step, not {steps}")
    if steps == 1:
        return (0,)
    return tuple(sorted({round(i * (num_steps - 1) / (steps - 1)) for i in range(steps)}))


@dataclass(frozen=True)
class Rung:
    """One configuration of a chunk: `steps` denoising forwards (None: all the model's) and `decoder` (None:
    the session's own)."""
    name: str
    steps: Optional[int] = None
    decoder: Optional[str] = None


def forward_ratio(num_steps: int, steps: Optional[int]) -> float:
    """A step rung's DiT cost against the full one's, counted in forwards (its probes and the commit): 4/5 and
    3/5 of v2's; the camera prepare makes the real ratios a little higher (perf/rungs.py: 0.81, 0.61 at 14B)."""
    return (len(kept_steps(num_steps, steps)) + 1) / (num_steps + 1)


FULL = Rung("full")
RUNGS = (FULL, Rung("steps3", steps=3), Rung("steps2", steps=2), Rung("tiny", decoder="tae"),
         Rung("tiny_steps2", steps=2, decoder="tae"))


# The served ladder's order: each rung one change cheaper than the one above (a probe fewer, a probe fewer, the
# tiny decoder), so the one decoder switch is between rungs of the same steps: a climb's warm-up (one Wan decode
# a chunk on tiny_steps2) costs what steps2 costs. `tiny` (every step, the tiny decoder) is what a session gets
# by asking for the tiny decoder as its own.
LADDER = ("full", "steps3", "steps2", "tiny_steps2")

# Seeds of a rung's cost before a group measured it: the Wan decode's share of a full chunk (about 225 of
# 715-783 ms at 14B on SP-4, vLLM-Omni's served path) and the tiny decoder's FLOPs against the Wan
# decoder's (1.63 vs 40.7 TFLOP a steady 480x832 chunk: docs/architecture.md, "The tiny decoder").
WAN_DECODE_SHARE = 0.3
TINY_DECODE_RATIO = 1.63 / 40.7


def rung_name(steps: Optional[int], decoder: Optional[str]) -> str:
    """The name of the rung of `steps` denoising forwards (None: all) decoded by `decoder` (None: the session's
    own, "tae": the tiny one): full, steps3, steps2, tiny, tiny_steps2 (and steps1, tiny_steps3... beyond RUNGS)."""
    if steps is None and decoder is None:
        return FULL.name
    return "_".join([*(["tiny"] if decoder == "tae" else []), *([] if steps is None else [f"steps{steps}"])])


def rung(name: str) -> Rung:
    """The rung called `name` (ValueError for another)."""
    for r in RUNGS:
        if r.name == name:
            return r
    raise ValueError(f"{name!r} is not a rung: {[r.name for r in RUNGS]}")


def rung_ratio(num_steps: int, r: Rung, decode_share: float = 0.0) -> float:
    """A rung's cost against the full one's: its DiT forwards' share (forward_ratio) of the chunk's DiT part,
    and of its decode part the tiny decoder's FLOP ratio for a decoder rung; `decode_share` 0 (no decoder
    rungs) gives the forward counts' ratio alone."""
    decode = TINY_DECODE_RATIO if r.decoder == "tae" else 1.0
    return (1 - decode_share) * forward_ratio(num_steps, r.steps) + decode_share * decode


def rung_decoders(own: str, loaded: tuple[str, ...]) -> tuple[str, ...]:
    """The decoders other than its own that a session's chunks may run on: the decoder rungs' where they are
    loaded (the tiny one for a Wan session with both loaded); empty: it never switches (and keeps no ring)."""
    return tuple(dict.fromkeys(r.decoder for r in RUNGS if r.decoder not in (None, own) and r.decoder in loaded))
