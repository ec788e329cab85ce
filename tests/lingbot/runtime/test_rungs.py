"""The quality ladder's step rungs in the engine (lingbot/runtime/rungs.py): which probes a rung keeps, the sink
always at every step, and a skipped probe's noise still drawn, so the session's noise stream is every rung's."""
import pytest
import torch

from lingbot.camera import Controls
from lingbot.runtime.condition import LatentCondition
from lingbot.runtime.rungs import RUNGS, kept_steps, rung, rung_name
from tests.conftest import random_condition


def test_a_rung_keeps_the_first_and_last_probes_and_spreads_the_rest():
    assert kept_steps(4, None) == kept_steps(4, 4) == kept_steps(4, 9) == (0, 1, 2, 3)
    assert kept_steps(4, 3) == (0, 2, 3)                 # v2: 1000, 500, 250
    assert kept_steps(4, 2) == (0, 3)                    # v2: 1000, 250
    assert kept_steps(4, 1) == (0,)
    assert kept_steps(6, 3) == (0, 2, 5)                 # (2.5 rounds to even)
    with pytest.raises(ValueError, match="at least 1 denoising step, not 0"):
        kept_steps(4, 0)
    assert [r.name for r in RUNGS] == ["full", "steps3", "steps2", "tiny", "tiny_steps2"]


def test_a_rung_is_named_by_its_steps_and_decoder_and_the_other_way_round():
    assert [rung_name(s, None) for s in (None, 3, 2, 1)] == ["full", "steps3", "steps2", "steps1"]
    assert [rung_name(s, "tae") for s in (None, 2, 3)] == ["tiny", "tiny_steps2", "tiny_steps3"]
    assert all(rung_name(r.steps, r.decoder) == r.name for r in RUNGS)
    assert [rung(n).steps for n in ("full", "steps3", "steps2")] == [None, 3, 2]
    assert (rung("tiny").steps, rung("tiny").decoder) == (None, "tae")          # a decoder rung
    with pytest.raises(ValueError, match=r"'steps1' is not a rung: \['full', 'steps3', 'steps2', 'tiny', "
                                         r"'tiny_steps2'\]"):
        rung("steps1")


def test_the_sink_runs_every_step_and_a_skipped_probe_still_draws_its_noise(tiny, tiny_runner):
    """Two sessions alike, one asking for 2 steps at every chunk: chunks 0-2 (the sink) are the full
    session's bitwise; chunk 3 runs probes 0 and 3 only and differs, with the session's generator where the
    full one's is after it; chunk 4 at full steps in both differs only through chunk 3 (its K/V)."""
    assert tiny.transformer.sink_chunks == 3
    cond = random_condition(tiny)
    full, cheap = (tiny_runner.new_session(LatentCondition(cond), prompt="a quiet harbour", seed=4) for _ in range(2))
    for k in range(3):
        a, b = full.run_chunk(Controls(keys=("w", "", ""))), cheap.run_chunk(Controls(keys=("w", "", "")), steps=2)
        assert torch.equal(a.latents, b.latents) and a.steps == b.steps == (0, 1, 2, 3), k
    a, b = full.run_chunk(Controls(keys=("w", "", ""))), cheap.run_chunk(Controls(keys=("w", "", "")), steps=2)
    assert a.steps == (0, 1, 2, 3) and b.steps == (0, 3)
    assert sorted(k for k in b.timings if k.startswith("probe")) == ["probe_0", "probe_3"]
    assert not torch.equal(a.latents, b.latents)
    assert torch.equal(full.generator.get_state(), cheap.generator.get_state())
    # the same chunk at 3 steps from a rewound copy: probes 0, 2, 3; the noise stream again the same
    again = tiny_runner.new_session(LatentCondition(cond), prompt="a quiet harbour", seed=4)
    for _ in range(3):
        again.run_chunk(Controls(keys=("w", "", "")))
    c = again.run_chunk(Controls(keys=("w", "", "")), steps=3)
    assert c.steps == (0, 2, 3) and torch.equal(again.generator.get_state(), full.generator.get_state())
