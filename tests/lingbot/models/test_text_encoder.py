"""The prompt path: tokenizer built locally, UMT5 output padded to 512 with pad rows zeroed."""
import torch


def test_encode_pads_to_512_and_zeroes_pad_rows(tiny_text_encoder):
    out = tiny_text_encoder.encode(["hi", "a longer prompt"])
    assert out.shape == (2, 512, 64)
    # "hi" -> 2 byte tokens + </s>: rows 0..2 are real, the rest are zero
    assert out[0, :3].abs().sum(-1).min() > 0
    assert torch.count_nonzero(out[0, 3:]) == 0
    assert out[1, :16].abs().sum(-1).min() > 0 and torch.count_nonzero(out[1, 16:]) == 0


def test_tokenizer_is_byte_level_with_eos(tiny_text_encoder):
    ids = tiny_text_encoder.tokenizer("hé")["input_ids"]
    assert len(ids) == 4 and ids[-1] == 1          # 'h' + two UTF-8 bytes of 'é' + </s>
    assert all(3 <= i < 259 for i in ids[:-1])


def test_long_prompts_are_truncated(tiny_text_encoder):
    out = tiny_text_encoder.encode(["x" * 2000])
    assert out.shape == (1, 512, 64) and out.abs().sum(-1).min() > 0
