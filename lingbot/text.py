"""Prompt encoding: the UMT5 encoder (transformers) and its tokenizer, padded to 512 with pad rows zeroed.

The real checkpoint ships `tokenizer/` and `text_encoder/`; the tiny preset builds a tiny UMT5 config
with random weights and a byte-level tokenizer locally, so nothing is ever downloaded.
"""
from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch import Tensor

from .config import TextEncoderConfig

log = logging.getLogger(__name__)

PAD, EOS, UNK = "<pad>", "</s>", "<unk>"


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

    @classmethod
    def from_folder(cls, root: str | Path, device="cpu", dtype: torch.dtype | None = None,
                    max_length: int = 512) -> "TextEncoder":
        """Load `root/tokenizer` and `root/text_encoder` (the diffusers layout) from local disk only."""
        from transformers import AutoTokenizer, UMT5EncoderModel
        root = Path(root)
        for part in ("tokenizer", "text_encoder"):
            if not (root / part).is_dir():
                raise FileNotFoundError(f"{root / part} is missing: a model folder needs tokenizer/ and text_encoder/")
        tokenizer = AutoTokenizer.from_pretrained(root / "tokenizer", local_files_only=True)
        kwargs = {"local_files_only": True}
        if dtype is not None:
            kwargs["dtype"] = dtype
        model = UMT5EncoderModel.from_pretrained(root / "text_encoder", **kwargs).to(device)
        return cls(tokenizer, model, max_length)

    @torch.no_grad()
    def encode(self, prompts: list[str]) -> Tensor:
        batch = self.tokenizer(prompts, padding="max_length", truncation=True, max_length=self.max_length,
                               add_special_tokens=True, return_attention_mask=True, return_tensors="pt")
        ids = batch["input_ids"].to(self.device)
        mask = batch["attention_mask"].to(self.device)
        hidden = self.model(input_ids=ids, attention_mask=mask).last_hidden_state      # [B, T, d_model]
        return hidden * mask[..., None].to(hidden.dtype)                                # pad rows -> 0


def build_byte_tokenizer(max_length: int = 512):
    """A T5-style tokenizer over raw bytes (<pad>=0, </s>=1, <unk>=2, bytes 3..258), EOS appended."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    byte_chars = sorted(alphabet)
    vocab = {PAD: 0, EOS: 1, UNK: 2}
    for i, ch in enumerate(byte_chars):
        vocab[ch] = 3 + i
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.TemplateProcessing(single=f"$A {EOS}", special_tokens=[(EOS, 1)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=PAD, eos_token=EOS, unk_token=UNK,
                                   model_max_length=max_length)


def build_random_text_encoder(config: TextEncoderConfig, seed: int) -> TextEncoder:
    """A UMT5 encoder of the given small dims with seeded random weights and the byte tokenizer."""
    from transformers import UMT5Config, UMT5EncoderModel
    umt5 = UMT5Config(vocab_size=config.vocab_size, d_model=config.d_model, d_kv=config.d_kv, d_ff=config.d_ff,
                      num_layers=config.num_layers, num_heads=config.num_heads, feed_forward_proj="gated-gelu",
                      relative_attention_num_buckets=32, relative_attention_max_distance=128,
                      pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = UMT5EncoderModel(umt5)
    return TextEncoder(build_byte_tokenizer(config.max_length), model, config.max_length)


def save_text_encoder(encoder: TextEncoder, root: str | Path) -> None:
    """Write `root/tokenizer` and `root/text_encoder` in the layout of the real checkpoint."""
    root = Path(root)
    encoder.tokenizer.save_pretrained(root / "tokenizer")
    encoder.model.save_pretrained(root / "text_encoder", safe_serialization=True)
