"""Regional torch.compile of the DiT: the two dense regions of every block, one compiled graph each.

A block is `attention_inputs` (modulated LN, q/k/v, RMSNorm, RoPE) -> the window attention (K/V slab
write and, under sequence parallelism, the all-to-alls) -> `attention_output` (output projection, camera
injector, cross-attention, FFN). The two regions are compiled; the attention between them is not (it is
one fused SDPA kernel plus a copy, and it holds the collectives). Their shapes do not depend on the window
length or the session, and the blocks share one class, so each region compiles once and all layers reuse
it: after the first chunk nothing recompiles (tests/lingbot/runtime/test_compile.py pins it).
Applied after parallelism and the move to the device (lingbot/builder.py).

CUDA graphs (`graphs=True`): the regions compile in inductor's "reduce-overhead" mode, which captures each
region as a CUDA graph at warm-up and replays it (CUDA graph trees; other devices run the compiled code
without graphs). Why this shape of graph: a graph bakes its addresses, and each session has its own K/V
slab; the attention that reads and writes the slab stays outside the graphs, so one set of graphs serves
every session, window length and layer, and needs no per-session copies. A region's outputs are consumed
within the same forward (the next layer copies its inputs into the graph's static buffers first); the
chunk's latents and frames are made by eager code after the last replay, so a later replay (another
session's chunk) never overwrites frames still being decoded or sent. Graph trees also raise if a graph
output is read after being overwritten, so a mistake shows instead of corrupting video.
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


def compile_blocks(model: CausalWanModel, backend: str = "inductor", mode: Optional[str] = None,
                   graphs: bool = False) -> CausalWanModel:
    """Compile the two regions of every block in place (the module tree and its weights are unchanged);
    `graphs`: as CUDA graphs (inductor's reduce-overhead mode)."""
    if graphs:
        mode = "reduce-overhead"
    uncompile_blocks(model)
    for block in model.blocks:
        block.attention_inputs = torch.compile(block.attention_inputs, backend=backend, mode=mode,
                                               fullgraph=True, dynamic=False)
        block.attention_output = torch.compile(block.attention_output, backend=backend, mode=mode,
                                               fullgraph=True, dynamic=False)
    if graphs:
        # every forward is one step of the graph trees: the previous forward's graph outputs are dead by then
        model.graph_step_hook = model.register_forward_pre_hook(_mark_graph_step)
    log.info("compiled the 2 regions of %d blocks (backend %s, mode %s)", len(model.blocks), backend, mode)
    return model


def _mark_graph_step(module, args) -> None:
    torch.compiler.cudagraph_mark_step_begin()


def blocks_compiled(model: CausalWanModel) -> bool:
    """Whether compile_blocks compiled this model's regions (and uncompile_blocks has not undone it)."""
    return any("attention_inputs" in block.__dict__ for block in model.blocks)


def uncompile_blocks(model: CausalWanModel) -> CausalWanModel:
    """Back to the eager regions (the class's methods)."""
    hook = model.__dict__.pop("graph_step_hook", None)
    if hook is not None:
        hook.remove()
    for block in model.blocks:
        block.__dict__.pop("attention_inputs", None)
        block.__dict__.pop("attention_output", None)
    return model
