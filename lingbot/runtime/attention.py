"""Choosing the window attention's kernel once, at warm-up, on the device and at the shapes it will run.

The call is one chunk of queries against the visible window: q [1, H_local, L, 128], k/v [1, H_local, S, 128]
in the model's dtype, no mask. Candidates (those this machine has): PyTorch SDPA restricted to its cuDNN,
flash or memory-efficient backend (CUDA), FlashAttention 3 when its package (`flash_attn_interface`) is
installed, and SDPA as PyTorch dispatches it. Each candidate runs on a probe of the steady-state shape
in the layout this model's attention passes at its sequence-parallel degree (`kernel_inputs`: under
Ulysses q is a strided view into the all-to-all's buffer, not the SP-1 layout); one that fails or
disagrees with SDPA's math backend beyond the tolerance, on the first head or the last, is dropped, the
fastest of the rest is set on every layer's window attention, and the table is logged.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel

log = logging.getLogger(__name__)

Attend = Callable[[Tensor, Tensor, Tensor], Tensor]
# max |diff| against SDPA's math backend in fp32, relative to the reference's largest value
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 5e-3}
REFERENCE_QUERIES = 256      # the reference is checked on a slice: fp32 scores at full size are ~20 GiB at 14B


def _sdpa_with(backend: SDPBackend) -> Attend:
    def attend(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v)
    attend.__name__ = f"sdpa_{backend.name.lower()}"
    return attend


def _flash_attention_3() -> Optional[Attend]:
    try:
        from flash_attn_interface import flash_attn_func  # FlashAttention 3 (Hopper), when installed
    except ImportError:
        return None

    def attend(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        out = flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))   # [B, S, H, D] layout
        out = out[0] if isinstance(out, tuple) else out
        return out.transpose(1, 2)
    return attend


def candidates(device: torch.device) -> dict[str, Attend]:
    """The kernels worth trying on `device`, by name."""
    out: dict[str, Attend] = {"sdpa": F.scaled_dot_product_attention}
    if device.type == "cuda":
        for name, backend in (("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION), ("sdpa_flash", SDPBackend.FLASH_ATTENTION),
                              ("sdpa_efficient", SDPBackend.EFFICIENT_ATTENTION)):
            out[name] = _sdpa_with(backend)
        fa3 = _flash_attention_3()
        if fa3 is not None:
            out["flash_attention_3"] = fa3
    return out


@dataclass(frozen=True)
class Trial:
    name: str
    seconds: Optional[float]       # median per call; None when dropped
    error: Optional[str] = None


def _sync(device: torch.device) -> None:
    if device.type != "cpu":
        torch.accelerator.synchronize(device)


def choose(kernels: dict[str, Attend], q: Tensor, k: Tensor, v: Tensor, repeats: int = 5) -> tuple[str, list[Trial]]:
    """The fastest kernel that runs and agrees with SDPA's math backend on (q, k, v); every trial. q, k, v
    are [B, H, S, D] in the layout the model calls with (q a transposed view). The agreement is checked on
    the first and the last head (a kernel that misreads the heads' stride of a strided q is right on head 0
    and wrong on the others)."""
    heads = sorted({0, q.shape[1] - 1})
    with sdpa_kernel(SDPBackend.MATH):        # [B, 2, REFERENCE_QUERIES, D] (one head when H = 1), fp32
        reference = F.scaled_dot_product_attention(q[:, heads, :REFERENCE_QUERIES].float(), k[:, heads].float(),
                                                   v[:, heads].float())
    scale = max(reference.abs().max().item(), 1e-6)
    tolerance = TOLERANCE.get(q.dtype, 1e-2)
    trials = []
    for name, attend in kernels.items():
        try:
            out = attend(q, k, v)
            diff = (out[:, heads, :REFERENCE_QUERIES].float() - reference).abs().max().item() / scale
            if not diff <= tolerance:
                trials.append(Trial(name, None, f"relative max |diff| {diff:.2e} > {tolerance:g}"))
                continue
            times = []
            for _ in range(repeats):
                _sync(q.device)
                t0 = time.perf_counter()
                attend(q, k, v)
                _sync(q.device)
                times.append(time.perf_counter() - t0)
            trials.append(Trial(name, sorted(times)[len(times) // 2]))
        except Exception as e:                        # not available for this device / dtype / shape
            trials.append(Trial(name, None, f"{type(e).__name__}: {str(e).splitlines()[0][:100]}"))
    timed = [t for t in trials if t.seconds is not None]
    if not timed:
        raise RuntimeError(f"no attention kernel ran: {trials}")
    return min(timed, key=lambda t: t.seconds).name, trials


def window_attentions(model) -> list:
    """Every layer's WindowAttention (under Ulysses, the local one inside the parallel module)."""
    return [getattr(block.self_attn.attn, "local", block.self_attn.attn) for block in model.blocks]


def kernel_inputs(model, tokens: int, window_tokens: int, device: torch.device | str,
                  generator: Optional[torch.Generator] = None) -> tuple[Tensor, Tensor, Tensor]:
    """Random q [B, H_local, L, D] and k, v [B, H_local, S, D] (B = 1) in the model's dtype, with the strides
    the kernel gets from this model's window attention, not just its shapes (a kernel may refuse, copy or
    slow down on other strides):
    - q as the block's attention module hands it to WindowAttention, which transposes it to [B, H, L, D]:
      on one device the projections' [B, L, H, D] output (strides (L*H*D, H*D, D, 1)); under Ulysses a
      view into the fused all-to-all's received rows (`UlyssesWindowAttention.received_qkv`: strides
      (3*H/N*D, 3*H/N*D, D, 1) with B = 1), the same function the forward calls;
    - k, v the visible prefix of one layer's K/V slab [B, H, S, D] (at the steady state the whole window)."""
    device = torch.device(device)
    heads, dim, dtype = model.local_heads, model.config.attention_head_dim, model.dtype
    g = generator or torch.Generator(device=device).manual_seed(0)
    attention = model.blocks[0].self_attn.attn
    received = getattr(attention, "received_qkv", None)
    if received is None:
        q = torch.randn(1, tokens, heads, dim, generator=g, device=device).to(dtype)
    else:
        rows = torch.randn(tokens, 3 * heads * dim, generator=g, device=device).to(dtype)
        q = received(rows, tokens, 1, heads, dim)[0]
    k, v = (torch.randn(1, heads, window_tokens, dim, generator=g, device=device).to(dtype) for _ in range(2))
    return q.transpose(1, 2), k, v


def choose_for_model(model, tokens: int, window_tokens: int, device: torch.device | str,
                     kernels: Optional[dict[str, Attend]] = None) -> tuple[str, list[Trial]]:
    """Probe the steady-state shape of `model` in the layout its window attention passes (`kernel_inputs`:
    this device's heads, all `tokens` queries of a chunk against `window_tokens` keys), set the fastest
    kernel on every layer, log the table. `kernels`: the candidates (default: this device's)."""
    device = torch.device(device)
    kernels = kernels if kernels is not None else candidates(device)
    q, k, v = kernel_inputs(model, tokens, window_tokens, device)
    name, trials = choose(kernels, q, k, v)
    attend = kernels[name]
    for attention in window_attentions(model):
        attention.attend = attend
    log.info("attention kernel: %s for q %s strides %s (%s)", name, tuple(q.shape), q.stride(), ", ".join(
        f"{t.name} {t.seconds * 1e3:.3f} ms" if t.seconds is not None else f"{t.name} dropped: {t.error}"
        for t in trials))
    return name, trials


def choose_for_steady_state(model, preset, device: torch.device | str,
                            kernels: Optional[dict[str, Attend]] = None) -> tuple[str, list[Trial]]:
    """choose_for_model at `preset`'s steady-state shape: one chunk's queries against a full window."""
    chunk_tokens = preset.transformer.num_frames_per_block * preset.tokens_per_frame
    return choose_for_model(model, chunk_tokens, preset.transformer.window_chunks * chunk_tokens, device, kernels)
