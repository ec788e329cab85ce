"""Sequence parallelism: process groups, Ulysses DiT, width-sharded VAE decode, the tiny decoder on the root,
pixel output modes, and the text and condition encoders run once per group (rank 0, then a broadcast).

Applied to the models after they are built (`apply_sequence_parallel` for the DiT, `shard_decoder` for
the VAE decode, `root_decoder` for the tiny decoder, `share_text_encoder` and `share_condition_encoder`);
no model file calls a collective."""
from .comm import Comm, ParallelError, backend_for_device
from .root_decode import root_decoder
from .ulysses import apply_sequence_parallel
from .vae_shard import shard_decoder

__all__ = ["Comm", "ParallelError", "apply_sequence_parallel", "backend_for_device", "root_decoder", "shard_decoder"]
