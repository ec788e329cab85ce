"""Prompt encoding: the UMT5 encoder (transformers) and its tokenizer, padded to 512 with pad rows zeroed.

The real checkpoint ships `tokenizer/` and `text_encoder/` (loaded by lingbot/io/weights.py); the tiny
preset builds a tiny UMT5 config with random weights and a byte-level tokenizer locally, so nothing is
ever downloaded.
"""
from __future__ import annotations

import torch
from torch import Tensor

from ..transfer import to_device


class TextEncoder:
    """tokenizer + UMT5EncoderModel -> [B, max_length, d_model] with pad positions zeroed."""

    def __init__(self, tokenizer, model, max_length: int = 512):
        self.tokenizer = tokenizer
        self.model = model.eval().requires_grad_(False)
        self.max_length = max_length

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dim(self) -> int:
        return self.model.config.d_model

    @torch.no_grad()
    def encode(self, prompts: list[str]) -> Tensor:
        batch = self.tokenizer(prompts, padding="max_length", truncation=True, max_length=self.max_length,
                               add_special_tokens=True, return_attention_mask=True, return_tensors="pt")
        ids = to_device(batch["input_ids"], self.device)                                # [B, T] int64
        mask = to_device(batch["attention_mask"], self.device)
        hidden = self.model(input_ids=ids, attention_mask=mask).last_hidden_state      # [B, T, d_model]
        return hidden * mask[..., None].to(hidden.dtype)                                # pad rows -> 0
