"""Sequence parallelism: process groups, Ulysses DiT, width-sharded VAE decode, pixel output modes.

Applied to models after they are built; no model file calls a collective (STYLE.md §3)."""
from .comm import Comm, ParallelError, backend_for_device, split_range, split_sizes
from .ulysses import apply_sequence_parallel

__all__ = ["Comm", "ParallelError", "apply_sequence_parallel", "backend_for_device", "split_range", "split_sizes"]
