"""What the stages of the device check share: the settings (tolerances, the figures the report compares
with, the a priori figures the estimates start from), the backend flags serving runs under, the device-memory
helpers (the timing ones are perf/timing.py's, as every benchmark's), and `Check`, the state one run carries
from stage to stage (the pipeline, its inputs, the figures measured so far, the DiT regions in place, the DiT
outputs of each mode)."""
from __future__ import annotations

import gc
from collections.abc import Callable
from contextlib import contextmanager
from typing import Optional

import torch

from lingbot.camera import Controls
from lingbot.config import get_preset
from lingbot.runtime.compile import compile_blocks, uncompile_blocks
from perf.cost_model import preset_chunk_flops

# compiled vs eager, relative to the eager output's largest value: one denoising step (chunk 0's first DiT
# forward, every layer once) and chunk 0's latents (4 steps and the commit). bf16 fused kernels round
# differently. Measured on CPU in bf16 (python -m perf.device_check.tolerance: the DiT at 14B's per-layer
# shape, narrowed): one step differs by 3e-3 to 4e-3 and chunk 0 by 2e-3 to 3e-3 at 2, 10, 20 and 40 layers
# alike (the residual stream is float32: the layers' rounding does not compound), so 2e-2, first set at the
# tiny preset's 2 layers, holds at 40 with 5x room; a wrong kernel is off by O(1).
STEP_TOLERANCE = 2e-2
KEYS = Controls(keys=("w", "l", "i"))
DEFAULT_DEADLINE_S = 480.0
LIFECYCLE_LAYERS = 2            # DiT blocks of the folder the lifecycle stage writes and loads
LIFECYCLE_MAX_SESSIONS = 1000   # a cap high enough that the capacity shows what the memory allows

# what the report compares with (never judged: each is a reference, not a goal)
DATASHEET_BF16_FLOPS = {"H200": 989e12, "H100": 989e12}    # dense bf16, NVIDIA's SXM datasheets
PEER_PRESET, PEER_DEVICE = "lingbot-world-v2-14b", "H200"
PEER_WHOLE_CHUNK_S = {"vLLM-Omni eager": 2.993, "vLLM-Omni compiled": 2.464}   # 1x H200, per whole chunk

# the backend flags a serving rank runs under, set before every stage: RankLifecycle.connect turns cuDNN's
# autotuner on (the VAE's convolutions: fixed shapes); TF32 is left at torch's defaults, so on CUDA float32
# matmuls are IEEE and float32 convolutions (the VAE's, which runs in float32) are TF32
SERVING_FLAGS = {"cudnn_benchmark": True, "matmul_tf32": False, "cudnn_tf32": True}
IEEE_FLOAT32 = {"matmul_tf32": False, "cudnn_tf32": False}   # a float32 reference that is float32

# a priori figures for the estimates, used until a stage has measured the real ones
EAGER_FRACTION = 0.3            # of the matmul peak, an eager DiT chunk
WHOLE_OVER_DIT = 1.5            # whole chunk (decode, frames) over the DiT chunk
COMPILE_S = {"cuda": 150.0}     # a regional compile and its first chunk; other devices: DEFAULT_COMPILE_S
DEFAULT_COMPILE_S = 60.0
WARM_COMPILE = 0.5              # a compile once the inductor and Triton caches are warm, of a cold one
HOST_COPY_BYTES_PER_S = {"cuda": 4e9}   # a synchronous device -> pageable host copy; others: the default
DEFAULT_HOST_COPY_BYTES_PER_S = 2e9
WRITE_BYTES_PER_S = 150e6       # random weights made on the host and written as safetensors
LOAD_BYTES_PER_S = 1e9          # a safetensors folder read to the device


# ---------------------------------------------------------------------------------------------------
# what the stages share
# ---------------------------------------------------------------------------------------------------
class InjectedFailure(RuntimeError):
    """Raised by --fail-stage: a stage that fails on purpose (tests of the guards)."""


class NotApplicable(Exception):
    """A stage with nothing to measure on this device (its status says so; it did not pass)."""


def read_flags() -> dict:
    flags = {"cudnn_benchmark": torch.backends.cudnn.benchmark, "matmul_tf32": torch.backends.cuda.matmul.allow_tf32,
             "cudnn_tf32": torch.backends.cudnn.allow_tf32}
    return {**flags, "float32_matmul_precision": torch.get_float32_matmul_precision()}


def set_flags(flags: dict) -> None:
    """The backend flags by read_flags' names (the legacy switches, as the rest of the project would use)."""
    if "cudnn_benchmark" in flags:
        torch.backends.cudnn.benchmark = flags["cudnn_benchmark"]
    if "matmul_tf32" in flags:
        torch.backends.cuda.matmul.allow_tf32 = flags["matmul_tf32"]
    if "cudnn_tf32" in flags:
        torch.backends.cudnn.allow_tf32 = flags["cudnn_tf32"]


@contextmanager
def flags_set(flags: dict):
    before = read_flags()
    set_flags(flags)
    try:
        yield
    finally:
        set_flags(before)


def _allocated(device: torch.device) -> Optional[int]:
    """Live tensor bytes on the device (None where there is no device allocator to ask)."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    return torch.cuda.memory_allocated(device)


def _free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _quietly(fn: Callable, *args):
    """fn(*args), or None when it raises: bookkeeping between stages (peak memory, freeing caches) must not
    stop the run after a stage left the device in an error state; the stage's own error says why."""
    try:
        return fn(*args)
    except Exception:
        return None


MODES = ("eager", "compiled", "compiled+graphs")    # the DiT regions, from the least to the most at risk


class Check:
    """What the stages share: the settings, the pipeline and its inputs, the figures measured so far (the
    estimates of later stages use them), the DiT outputs each mode made (for the comparisons), and the
    running stage's figures, kept one by one as they are measured (`keep`)."""

    def __init__(self, args, progress: Callable[[str], None]):
        self.args = args
        self.progress = progress
        self.device = torch.device(args.device)
        self.preset = get_preset(args.preset)
        self.warm = self.preset.transformer.window_chunks + 1      # every window length, then the first steady
        self.steady = args.steady
        self.flops = preset_chunk_flops(self.preset, self.warm).total   # a steady chunk's DiT FLOPs
        self.peak_flops: Optional[float] = None
        self.host_memory_bytes: Optional[int] = None            # the run sets it (--host-gib, else the OS's)
        self.weights_bytes: Optional[int] = None
        self.pipe = None
        self.text = self.latents = self.image = None
        self.conditions_primed = False
        self.mode = "eager"                                    # the DiT regions in place now
        self.unavailable: set[str] = set()                      # modes whose own stage failed or was skipped
        self.latents_by_mode: dict[str, torch.Tensor] = {}      # mode -> DiT latents [16, F, h, w] fp32, host
        self.step_by_mode: dict[str, torch.Tensor] = {}         # mode -> chunk 0's first DiT output, fp32, host
        self.seconds: dict[str, float] = {}                     # measured: "dit", "whole" (regions in place), "compile"
        self.stage: Optional[str] = None                        # the running stage, its figures and their saver
        self.figures: dict = {}
        self._save: Callable[[], None] = lambda: None
        self.fail_at: dict[str, Optional[str]] = dict(getattr(args, "fail_stage", None) or {})

    # ---- the running stage's figures ----------------------------------------------------------
    def begin(self, stage: str, figures: dict, save: Callable[[], None]) -> None:
        self.stage, self.figures, self._save = stage, figures, save
        if stage in self.fail_at and self.fail_at[stage] is None:
            raise InjectedFailure(f"stage {stage} failed on purpose (--fail-stage {stage})")

    def keep(self, **figures) -> None:
        """Figures of the running stage, written to the report at once: a failure later in the stage keeps them."""
        self.figures.update(figures)
        self._save()
        after = self.fail_at.get(self.stage)
        if after is not None and after in figures:
            raise InjectedFailure(f"stage {self.stage} failed on purpose after {after} (--fail-stage "
                                  f"{self.stage}@{after})")

    # ---- estimates ----------------------------------------------------------------------------
    def chunk_s(self) -> tuple[float, float]:
        """(DiT chunk, whole chunk) seconds with the regions in place: the last measured, else from the FLOPs
        at EAGER_FRACTION of the matmul peak."""
        dit = self.seconds.get("dit")
        if dit is None:
            dit = self.flops / (EAGER_FRACTION * (self.peak_flops or 1e12))
        return dit, self.seconds.get("whole", WHOLE_OVER_DIT * dit)

    def compile_s(self) -> float:
        return self.seconds.get("compile", COMPILE_S.get(self.device.type, DEFAULT_COMPILE_S))

    # ---- the DiT regions ----------------------------------------------------------------------
    def enter(self, mode: str) -> str:
        """Put the regions of `mode` in place (each stage sets the mode it measures, whatever the stage before
        it left); a mode whose own stage failed or was skipped is not built here: the most capable one below
        it that is available stands in. Returns the mode in place. A compile happens at the first chunk after
        this."""
        wanted = mode
        while mode in self.unavailable and mode != "eager":
            mode = MODES[MODES.index(mode) - 1]
        if mode != self.mode:
            self.to_eager()
            if mode != "eager":
                compile_blocks(self.pipe.runner.model, graphs=mode == "compiled+graphs")
                self.mode = mode
        if mode != wanted:
            self.progress(f"  no {wanted} regions (their stage failed or was skipped): running {mode}")
        return self.mode

    def to_eager(self) -> None:
        """Back to the eager regions, compiled code and graphs dropped (before a compile, after a failed one)."""
        if self.pipe is not None:
            uncompile_blocks(self.pipe.runner.model)
        torch._dynamo.reset()
        self.mode = "eager"

    def mode_failed(self, mode: str) -> None:
        """After the stage that builds `mode` (compiled, graphs) failed: not built again, the eager regions back."""
        self.unavailable.add(mode)
        self.to_eager()
