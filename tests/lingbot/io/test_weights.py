"""Strict loading of diffusers-layout transformer folders, and the random-checkpoint writer."""
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from lingbot.builder import build_dit_runner
from lingbot.config import ConfigError, TransformerConfig, get_preset
from lingbot.io.weights import (
    INDEX_NAME,
    WeightsError,
    load_transformer,
    read_state_dict,
    save_transformer,
    write_random_checkpoint,
)


def _shards(folder):
    return sorted(p.name for p in folder.glob("*.safetensors"))


def test_round_trip_is_bitwise(tmp_path, tiny_model):
    folder = save_transformer(tiny_model, tmp_path / "transformer", max_shard_bytes=2 ** 20)
    assert len(_shards(folder)) > 1 and (folder / INDEX_NAME).exists()       # the sharded path is exercised
    loaded = load_transformer(folder, dtype=torch.float32)
    assert loaded.config == tiny_model.config
    ours, theirs = tiny_model.state_dict(), loaded.state_dict()
    assert ours.keys() == theirs.keys()
    for k in ours:
        assert torch.equal(ours[k], theirs[k]), k


def _rewrite_shard(folder, edit):
    index = json.loads((folder / INDEX_NAME).read_text())
    name = _shards(folder)[0]
    shard = load_file(folder / name)
    edit(shard, index, name)
    save_file(shard, folder / name)
    (folder / INDEX_NAME).write_text(json.dumps(index))


def test_missing_key_is_named(tmp_path, tiny_model):
    folder = save_transformer(tiny_model, tmp_path / "t", max_shard_bytes=2 ** 20)
    victim = sorted(load_file(folder / _shards(folder)[0]))[0]

    def drop(shard, index, name):
        del shard[victim]
        del index["weight_map"][victim]
    _rewrite_shard(folder, drop)
    with pytest.raises(WeightsError, match=f"missing key '{victim}'"):
        load_transformer(folder)


def test_unknown_key_is_named(tmp_path, tiny_model):
    folder = save_transformer(tiny_model, tmp_path / "t", max_shard_bytes=2 ** 20)

    def add(shard, index, name):
        shard["blocks.0.self_attn.extra_bias"] = torch.zeros(3)
        index["weight_map"]["blocks.0.self_attn.extra_bias"] = name
    _rewrite_shard(folder, add)
    with pytest.raises(WeightsError, match=r"unknown key 'blocks\.0\.self_attn\.extra_bias'"):
        load_transformer(folder)


def test_wrong_shape_is_named(tmp_path, tiny_model):
    folder = save_transformer(tiny_model, tmp_path / "t")
    state = read_state_dict(folder)
    state["head.head.bias"] = torch.zeros(7)
    save_file(state, folder / "diffusion_pytorch_model.safetensors")
    with pytest.raises(WeightsError, match=r"key 'head.head.bias' has shape \[7\].*expects \[64\]"):
        load_transformer(folder)


def test_config_json_round_trip_and_bad_keys(tmp_path):
    cfg = TransformerConfig()
    assert len(cfg.to_json_dict()) == 21                       # the 20 keys + _class_name
    assert TransformerConfig.from_json_dict(cfg.to_json_dict()) == cfg
    with pytest.raises(ConfigError, match=r"unknown keys \['num_heads'\]"):
        TransformerConfig.from_json_dict({**cfg.to_json_dict(), "num_heads": 40})
    d = cfg.to_json_dict()
    del d["sink_size"]
    with pytest.raises(ConfigError, match=r"missing keys \['sink_size'\]"):
        TransformerConfig.from_json_dict(d)


def test_engine_from_written_folder_equals_in_memory_engine(tmp_path, tiny, tiny_runner):
    from lingbot.runtime.condition import LatentCondition
    from tests.conftest import random_condition
    folder = write_random_checkpoint(tiny, tmp_path / "tiny-ckpt", max_shard_bytes=2 ** 20)
    for part in ("transformer/config.json", "text_encoder/config.json", "tokenizer/tokenizer.json",
                 "model_index.json"):
        assert (folder / part).exists(), part
    disk = build_dit_runner("tiny", model_path=folder)
    cond = random_condition(tiny)
    a = disk.new_session(LatentCondition(cond), prompt="a red barn", seed=1).generate(2)
    b = tiny_runner.new_session(LatentCondition(cond), prompt="a red barn", seed=1).generate(2)
    assert torch.equal(a, b)


def test_real_preset_needs_a_folder():
    with pytest.raises(ConfigError, match="give the model folder"):
        build_dit_runner(get_preset("lingbot-world-v2-14b"))
    with pytest.raises(ConfigError, match="unknown preset 'huge'"):
        get_preset("huge")


def test_flow_shift_default_comes_from_the_scheduler_config(tmp_path, tiny):
    import json

    from lingbot.io.weights import SCHEDULER_CONFIG, read_flow_shift
    folder = write_random_checkpoint(tiny, tmp_path / "ckpt")
    assert read_flow_shift(folder) == 5.0                        # written with the preset's shift
    config = folder / SCHEDULER_CONFIG
    config.write_text(json.dumps({"shift": 7}))
    runner = build_dit_runner("tiny", model_path=folder)
    assert runner.preset.sampler.shift == 7.0
    assert runner.schedule(None)[0].config.shift == 7.0          # the session default
    assert runner.schedule(3.0)[0].config.shift == 3.0           # a request's flow_shift still wins
    config.write_text(json.dumps({"flow_shift": 2.5}))
    assert read_flow_shift(folder) == 2.5
    config.write_text(json.dumps({"shift": -1}))
    with pytest.raises(WeightsError, match="shift -1 must be a positive number"):
        read_flow_shift(folder)
    config.unlink()
    assert read_flow_shift(folder) is None


def test_the_text_encoder_loads_in_the_dtype_asked_for(tmp_path, tiny, tiny_text_encoder, monkeypatch, caplog):
    """A UMT5 checkpoint (transformers' own config and safetensors, at the tiny preset's dims) loaded through
    the project's loader in bf16 has bf16 parameters: the weights written, rounded once. The random builder
    gives the same weights in the same dtype, and a runner's encoder has the DiT's dtype. A transformers
    that ignores from_pretrained(dtype=...) (older than 4.56) is cast, with a warning naming the fix."""
    from transformers import UMT5EncoderModel

    from lingbot.io.weights import build_random_text_encoder, load_text_encoder, save_text_encoder
    save_text_encoder(tiny_text_encoder, tmp_path)
    written = dict(tiny_text_encoder.model.named_parameters())
    assert {p.dtype for p in written.values()} == {torch.float32}
    loaded = load_text_encoder(tmp_path, dtype=torch.bfloat16)
    assert {p.dtype for p in loaded.model.parameters()} == {torch.bfloat16}
    assert all(torch.equal(p, written[name].to(torch.bfloat16)) for name, p in loaded.model.named_parameters())
    assert load_text_encoder(tmp_path).model.dtype == torch.float32                      # None: as stored
    built = build_random_text_encoder(tiny.text, tiny.weights_seed, torch.bfloat16)
    assert all(torch.equal(p, written[name].to(torch.bfloat16)) for name, p in built.model.named_parameters())
    runner = build_dit_runner("tiny", dtype="bfloat16")
    assert runner.text_encoder.model.dtype == torch.bfloat16 == runner.model.dtype
    assert runner.preset.dtype == "bfloat16" and runner.preset.vae_dtype == "float32"

    original = UMT5EncoderModel.from_pretrained                   # as transformers < 4.56: dtype= ignored
    monkeypatch.setattr(UMT5EncoderModel, "from_pretrained",
                        lambda path, **kwargs: original(path, local_files_only=True))
    with caplog.at_level("WARNING", logger="lingbot.io.weights"):
        old = load_text_encoder(tmp_path, dtype=torch.bfloat16)
    assert {p.dtype for p in old.model.parameters()} == {torch.bfloat16}
    assert "not the torch.bfloat16 asked for" in caplog.text and "transformers>=4.56" in caplog.text
