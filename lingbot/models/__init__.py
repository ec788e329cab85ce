"""The networks, math only: the causal camera DiT (dit.py), the Wan 2.1 VAE (vae.py), the tiny decoder for
its latents (tae.py) and the UMT5 prompt encoder (text_encoder.py). No process groups, sessions or files
here: caches are passed in, weights are loaded by lingbot/io/weights.py and parallelism is applied by
lingbot/parallel/."""
