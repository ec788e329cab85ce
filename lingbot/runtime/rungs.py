"""The quality ladder's rungs: named, deterministic configurations of one chunk, cheaper than the session's
own (docs/architecture.md, "Rungs").

A rung runs fewer of the sampler's denoising probes, or decodes with the tiny decoder. The probes it keeps
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


def step_rung(steps: Optional[int]) -> str:
    """The name of the step rung of `steps` denoising forwards (None: all of them, `full`)."""
    if steps is None:
        return FULL.name
    return next((r.name for r in RUNGS if r.steps == steps and r.decoder is None), f"steps{steps}")


def rung_steps(name: str) -> Optional[int]:
    """The denoising forwards of the step rung `name` (None: all of them)."""
    for r in RUNGS:
        if r.name == name and r.decoder is None:
            return r.steps
    raise ValueError(f"{name!r} is not a step rung: {[r.name for r in RUNGS if r.decoder is None]}")
