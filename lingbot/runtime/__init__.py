"""The per-session runtime on one device (or one rank): the K/V slab window (kv_cache.py), the DMD sampler
(sampler.py), the chunk condition (condition.py), the DiT runner and its sessions (dit_runner.py), the
whole video pipeline (pipeline.py) and the memory budget that decides admission (budget.py)."""
