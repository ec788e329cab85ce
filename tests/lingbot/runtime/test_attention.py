"""Choosing the attention kernel: what runs and agrees with SDPA's math backend, the fastest of those;
set on every layer, also under sequence parallelism."""
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend

from lingbot.io.weights import build_random_transformer
from lingbot.parallel import Comm, apply_sequence_parallel
from lingbot.runtime.attention import _sdpa_with, candidates, choose, choose_for_model, window_attentions


def _probe(dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    return (torch.randn(1, 2, n, 32, generator=g).to(dtype) for n in (48, 96, 96))


def test_failing_and_wrong_kernels_are_dropped_and_the_fastest_correct_one_wins():
    def broken(q, k, v):
        raise RuntimeError("no kernel for this shape")

    def wrong(q, k, v):
        return torch.zeros_like(q)

    def slow(q, k, v):
        import time
        time.sleep(0.02)
        return F.scaled_dot_product_attention(q, k, v)

    kernels = {"sdpa": F.scaled_dot_product_attention, "math": _sdpa_with(SDPBackend.MATH), "broken": broken,
               "wrong": wrong, "slow": slow}
    name, trials = choose(kernels, *_probe(), repeats=3)
    by_name = {t.name: t for t in trials}
    assert name in ("sdpa", "math")                        # both well under the 20 ms of "slow"
    assert by_name["broken"].seconds is None and "RuntimeError: no kernel" in by_name["broken"].error
    assert by_name["wrong"].seconds is None and "relative max |diff|" in by_name["wrong"].error
    assert by_name["slow"].seconds >= 0.02


def test_the_choice_is_set_on_every_layer_also_under_sequence_parallelism(tiny):
    assert list(candidates(torch.device("cpu"))) == ["sdpa"]          # CUDA adds cuDNN / flash / efficient / FA3
    model = build_random_transformer(tiny.transformer, 0)
    apply_sequence_parallel(model, Comm(rank=0, world_size=2))     # the layout only: no collective runs here
    for attention in window_attentions(model):
        attention.attend = None
    name, trials = choose_for_model(model, tokens=168, window_tokens=6 * 168, device="cpu")
    assert name == "sdpa" and [t.name for t in trials] == ["sdpa"]
    assert all(a.attend is F.scaled_dot_product_attention for a in window_attentions(model))
    assert len(window_attentions(model)) == tiny.transformer.num_layers
