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


def _packed_rows_only(q, k, v):
    """A kernel that reads q as [B, L, H, D] rows (as FlashAttention's layout is): it refuses any other."""
    if not q.transpose(1, 2).is_contiguous():
        raise RuntimeError(f"q must be [B, L, H, D] rows, got strides {q.stride()}")
    return F.scaled_dot_product_attention(q, k, v)


def test_the_kernel_is_checked_on_the_layout_each_degree_passes(tiny):
    """The probe's q has the strides the window attention passes at the model's degree: the projections'
    rows on one device, a view into the all-to-all's buffer under Ulysses (the forward's own function makes
    it); a kernel that only takes the first is kept at SP-1 and dropped at SP-2. (tests/lingbot/parallel/
    test_group_once.py checks these strides against the ones a real SP-2 chunk passes.)"""
    from lingbot.runtime.attention import kernel_inputs
    tokens, window = 168, 6 * 168
    kernels = {"sdpa": F.scaled_dot_product_attention, "packed_rows_only": _packed_rows_only}
    one = build_random_transformer(tiny.transformer, 0)
    two = apply_sequence_parallel(build_random_transformer(tiny.transformer, 0), Comm(rank=0, world_size=2))
    heads, dim = tiny.transformer.num_attention_heads, tiny.transformer.attention_head_dim
    q1, k1, _ = kernel_inputs(one, tokens, window, "cpu")
    q2, k2, _ = kernel_inputs(two, tokens, window, "cpu")
    assert q1.shape == (1, heads, tokens, dim) and q1.stride() == (tokens * heads * dim, dim, heads * dim, 1)
    hn = heads // 2
    assert q2.shape == (1, hn, tokens, dim) and q2.stride() == (3 * hn * dim, dim, 3 * hn * dim, 1)
    assert k1.shape == (1, heads, window, dim) and k2.shape == (1, hn, window, dim)
    name1, trials1 = choose_for_model(one, tokens, window, "cpu", kernels=kernels)
    name2, trials2 = choose_for_model(two, tokens, window, "cpu", kernels=kernels)
    assert {t.name: t.error for t in trials1}["packed_rows_only"] is None            # runs at SP-1
    dropped = {t.name: t.error for t in trials2}["packed_rows_only"]
    assert name2 == "sdpa" and "q must be [B, L, H, D] rows" in dropped              # refused at SP-2
    assert name1 in kernels and all(a.attend is F.scaled_dot_product_attention for a in window_attentions(two))


def test_a_kernel_wrong_on_the_last_head_only_is_dropped():
    """Head 0 alone would pass a kernel that misreads the heads' stride; the last head catches it."""
    def last_head_wrong(q, k, v):
        out = F.scaled_dot_product_attention(q, k, v)
        out[:, -1] = out[:, 0]                              # e.g. every head read at head 0's offset
        return out

    def first_head_wrong(q, k, v):
        out = F.scaled_dot_product_attention(q, k, v)
        out[:, 0] = out[:, -1]
        return out

    q, k, v = _probe()                                     # 2 heads
    kernels = {"sdpa": F.scaled_dot_product_attention, "last": last_head_wrong, "first": first_head_wrong}
    name, trials = choose(kernels, q, k, v, repeats=1)
    by_name = {t.name: t for t in trials}
    assert name == "sdpa" and by_name["sdpa"].error is None
    for bad in ("last", "first"):
        assert by_name[bad].seconds is None and by_name[bad].error.startswith("relative max |diff|")
    name, trials = choose(kernels, q[:, :1], k[:, :1], v[:, :1], repeats=1)      # one head: first is last
    assert {t.name for t in trials if t.seconds is not None} == {"sdpa", "last", "first"}
