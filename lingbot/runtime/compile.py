"""Regional torch.compile of the DiT: the two dense regions of every block, one compiled graph each.

A block is `attention_inputs` (modulated LN, q/k/v, RMSNorm, RoPE) -> the window attention (K/V slab
write and, under sequence parallelism, the all-to-alls) -> `attention_output` (output projection, camera
injector, cross-attention, FFN). The two regions are compiled; the attention between them is not (it is
one fused SDPA kernel plus a copy, and it holds the collectives). Their shapes do not depend on the window
length or the session, and the blocks share one class, so each region compiles once and all layers reuse
it: after the first chunk nothing recompiles (tests/lingbot/runtime/test_compile.py pins it).
Applied after parallelism and the move to the device (lingbot/builder.py).
"""
from __future__ import annotations

import logging
from typing import Optional

import torch

from ..models.dit import CausalWanModel

log = logging.getLogger(__name__)


def compile_default(device: torch.device | str) -> bool:
    """Whether to compile when the config does not say: on accelerators yes; on CPU no (measured slower
    end to end for the tiny preset once compile time is counted; perf/ab.py --switch compile)."""
    return str(device).split(":")[0] != "cpu"           # (torch.device("npu") needs torch_npu imported)


def compile_blocks(model: CausalWanModel, backend: str = "inductor", mode: Optional[str] = None) -> CausalWanModel:
    """Compile the two regions of every block in place (the module tree and its weights are unchanged)."""
    for block in model.blocks:
        block.attention_inputs = torch.compile(block.attention_inputs, backend=backend, mode=mode,
                                               fullgraph=True, dynamic=False)
        block.attention_output = torch.compile(block.attention_output, backend=backend, mode=mode,
                                               fullgraph=True, dynamic=False)
    log.info("compiled the 2 regions of %d blocks (backend %s)", len(model.blocks), backend)
    return model
