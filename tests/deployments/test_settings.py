"""Serving settings: validation, environment overrides, placement and the resources the app requests."""
import dataclasses
import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from deployments import settings as settings_module
from deployments.settings import CONCERNS, KEYS, ServeSettings, env_overrides
from lingbot.config import ConfigError

ROOT = Path(__file__).resolve().parents[2]
# the flat keys and defaults before the settings were grouped by concern: serve_config.yaml, LINGBOT_<KEY>,
# ServeSettings(**flat), to_dict() and settings.<key> keep every one of them
FLAT_DEFAULTS = {
    "preset": "tiny", "model_path": None, "device": "cpu", "sp": 2, "pixel_mode": "root_uint8_p2p",
    "skip_fixed_point": True, "compile": None, "cuda_graphs": False, "replica_cpus": 0.05, "rank_cpus": 0.3,
    "rank_devices": 0.0, "muxer_cpus": 0.1, "muxer_gpus": 0.0, "ingress_cpus": 0.05, "max_sessions_per_group": 2,
    "memory_budget_gib": None, "min_groups": 1, "max_groups": 2, "graceful_shutdown_timeout_s": 600.0,
    "fps": 16.0, "pacing_lead_s": 1.5, "pacing": "adaptive", "pacing_margin_s": 0.1, "pacing_quantile": 0.9,
    "restart_stale_chunks": False, "admission_wait_s": 0.0, "resume_sessions": True, "resume_wait_s": 120.0,
    "max_resumes": 3, "snapshots": True, "drain_poll_s": 2.0, "drain_lead_s": 3.0, "retry_after_s": 10.0,
    "start_timeout_s": 10.0, "stall_timeout_s": 60.0, "idle_timeout_s": 300.0, "max_lifetime_s": 3600.0,
    "max_start_bytes": 4194304, "max_control_bytes": 131072, "max_queued_controls": 64, "max_messages_per_s": 50.0,
    "max_ingress_sessions": 64,
    "max_waiting_sessions": 32, "max_ingress_replicas": 1, "min_ingress_replicas": 1,
    "max_ingress_connections": 1024,
    "default_chunks": 8, "max_chunks": 100000, "group_start_timeout_s": 1800.0,
    "collective_timeout_s": 120.0, "chunk_timeout_s": 600.0, "metrics_interval_s": 5.0,
    "max_in_flight_chunks": None, "quality_ladder": "off", "quality_floor": "steps2",
    "encoder": "auto", "encoder_preset": "veryfast", "encoder_threads": 0,
    "api_keys": "", "allow_anonymous": False, "max_sessions_per_key": 8, "max_starts_per_minute_per_key": 60,
    "max_failed_keys_per_minute": 10,
    "max_connections_per_address": 16,
    "allowed_origins": "", "allowed_hosts": "localhost",
    "image_url_allowlist": "", "image_fetch_timeout_s": 10.0, "image_fetch_max_bytes": 20971520,
}
# the drain"s constants, settings now (today"s values)
DRAIN_DEFAULTS = {"drain_margin_s": 30.0, "drain_flush_timeout_s": 10.0, "drain_fill_max_s": 10.0,
                  "drain_wait_new_s": 30.0, "drain_new_group_slack_s": 10.0}
# keys added since the split, with their defaults (the DiT dtype override: null, the preset's)
NEW_DEFAULTS = {**DRAIN_DEFAULTS, "max_header_bytes": 16 * 2 ** 10, "dtype": None, "spare_groups": None,
                "decoder": None, "tae_path": None,
                "max_queue_wait_s": 600.0}
# snapshots sized for the host: every chunk (as before), the host budget measured on the node
NEW_DEFAULTS.update(snapshot_interval_chunks=1, snapshot_host_budget_gib=None)
# the door: a session's fps at most the deployment's; clients behind trusted proxies
NEW_DEFAULTS.update(max_fps=None, trusted_proxies="")
# spectators: viewers of shared sessions, their bounds and queues
NEW_DEFAULTS.update(max_viewers_per_session=100, max_viewers=1000, spectators_need_key=True, viewer_queue_chunks=4,
                    viewer_queue_bytes=16 * 2 ** 20, viewer_max_skips=3, viewer_keyframe_chunks=4)
# recordings: off unless asked, kept a week and 10 GiB at most
NEW_DEFAULTS.update(record_sessions=False, recordings_dir="~/lingbot-recordings", recording_keep_s=7 * 86400.0,
                    recordings_max_bytes=10 * 2 ** 30, recording_spool_bytes=64 * 2 ** 20)
# worlds: saved in a folder, kept 30 days, 100 and 1 GiB a key, 4,000 chunks a world
NEW_DEFAULTS.update(worlds_dir="~/lingbot-worlds", world_keep_s=30 * 86400.0, max_worlds_per_key=100,
                    max_world_bytes_per_key=2 ** 30, max_world_chunks=4000, max_world_snapshot_bytes=256 * 2 ** 20)
# what a client that does not read may leave in the proxy
NEW_DEFAULTS.update(stall_max_bytes=64 * 2 ** 20)


def test_settings_validation(monkeypatch):
    s = ServeSettings.from_args({"sp": 2, "rank_cpus": "0.25"})
    assert s.decoder_names == ("tae", "wan") and ServeSettings(decoder="wan").decoder_names == ("wan",)
    assert ServeSettings(device="cuda", rank_devices=1).decoder_names == ("wan",)    # the Wan decoder on GPUs
    assert s.placement_bundles == [{"CPU": 0.05}, {"CPU": 0.25}, {"CPU": 0.25}, {"CPU": 0.1}]
    assert (s.rank_bundle(0), s.rank_bundle(1), s.muxer_bundle) == (1, 2, 3)
    with pytest.raises(ConfigError, match="sp 3 does not divide the 4 attention heads"):
        ServeSettings.from_args({"sp": 3})
    with pytest.raises(ConfigError, match="unknown serve settings \\['spp'\\]"):
        ServeSettings.from_args({"spp": 2})
    with pytest.raises(ConfigError, match="needs model_path"):
        ServeSettings.from_args({"preset": "lingbot-world-v2-14b", "device": "cuda", "rank_devices": 1})
    with pytest.raises(ConfigError, match="is not a valid int"):
        ServeSettings.from_args({"sp": "two"})
    monkeypatch.setenv("LINGBOT_SP", "4")                 # the environment overrides the config file
    assert ServeSettings.from_args({"sp": 2}).sp == 4


def test_api_key_set():
    first, second = "k1-0123456789abcdef", "k2-0123456789abcdef"
    assert ServeSettings.from_args({"api_keys": f"{first}, {second}"}).api_key_set == {first, second}
    assert ServeSettings.from_args({}).api_key_set == frozenset()
    with pytest.raises(ConfigError, match="1 of the api_keys are shorter than 16 characters"):
        ServeSettings(api_keys=f"{first}, short-key")            # (the message never holds a key)


def test_accelerators_are_requested_by_kind():
    """CPU ranks ask for CPUs only; CUDA ranks for GPUs (num_gpus, so Ray sets CUDA_VISIBLE_DEVICES); NPU
    ranks for Ray's separate NPU resource, never for GPUs."""
    cpu = ServeSettings.from_args({"sp": 2})
    assert cpu.rank_accelerators == {} and cpu.rank_actor_options() == {"num_cpus": 0.3}
    big = {"preset": "lingbot-world-v2-14b", "model_path": "/models/x", "sp": 4, "rank_cpus": 4, "rank_devices": 1}
    cuda = ServeSettings.from_args({**big, "device": "cuda"})
    assert cuda.placement_bundles == [{"CPU": 0.05}] + [{"CPU": 4.0, "GPU": 1.0}] * 4 + [{"CPU": 0.1}]
    assert cuda.rank_actor_options() == {"num_cpus": 4.0, "num_gpus": 1.0, "runtime_env": {"env_vars": {
        "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True", "NCCL_DEBUG": "WARN"}}}
    npu = ServeSettings.from_args({**big, "device": "npu"})
    assert npu.placement_bundles == [{"CPU": 0.05}] + [{"CPU": 4.0, "NPU": 1.0}] * 4 + [{"CPU": 0.1}]
    assert npu.rank_actor_options() == {"num_cpus": 4.0, "resources": {"NPU": 1.0}}
    assert not any("GPU" in bundle for bundle in npu.placement_bundles)
    with pytest.raises(ConfigError, match="device npu needs rank_devices > 0"):
        ServeSettings.from_args({**big, "device": "npu", "rank_devices": 0})
    with pytest.raises(ConfigError, match="device cpu takes no accelerators"):
        ServeSettings.from_args({"rank_devices": 1})


def test_in_flight_chunks_default_by_device():
    assert ServeSettings.from_args({}).resolved_max_in_flight_chunks == 1
    assert ServeSettings.from_args({"max_in_flight_chunks": 3}).resolved_max_in_flight_chunks == 3
    gpu = {"preset": "lingbot-world-v2-14b", "model_path": "/m", "device": "cuda", "rank_devices": 1, "sp": 4}
    assert ServeSettings.from_args(gpu).resolved_max_in_flight_chunks == 2
    with pytest.raises(ConfigError, match="max_in_flight_chunks must be >= 1"):
        ServeSettings.from_args({"max_in_flight_chunks": 0})
    with pytest.raises(ConfigError, match="encoder 'vp9' is not one of"):
        ServeSettings.from_args({"encoder": "vp9"})


def test_sessions_per_group_from_the_budget():
    assert ServeSettings.from_args({}).budget_bytes == 2 ** 30                    # the CPU rule: 1 GiB per rank
    assert ServeSettings.from_args({}).sessions_per_group() == 2                 # capped by max_sessions_per_group
    assert ServeSettings.from_args({"memory_budget_gib": 0.0001}).sessions_per_group() == 0
    gpu = {"preset": "lingbot-world-v2-14b", "model_path": "/m", "device": "cuda", "rank_devices": 1, "sp": 4,
           "max_sessions_per_group": 3}
    assert ServeSettings.from_args(gpu).budget_bytes is None                     # measured after warm-up
    assert ServeSettings.from_args(gpu).sessions_per_group() == 3
    assert ServeSettings.from_args({**gpu, "memory_budget_gib": 60}).budget_bytes == 60 * 2 ** 30


def test_the_dtype_override_is_the_preset_the_budget_counts(monkeypatch):
    """`dtype` replaces the preset's DiT dtype (aliases read canonical), not the VAE's; the CPU budget rule
    counts sessions of the preset as overridden (bf16 K/V: half the bytes, more sessions in a budget)."""
    from lingbot.runtime.budget import session_footprint
    monkeypatch.delenv("LINGBOT_DTYPE", raising=False)
    plain, bf16 = ServeSettings.from_args({}), ServeSettings.from_args({"dtype": "bf16"})
    assert plain.model_preset.dtype == "float32" and bf16.dtype == "bf16"
    assert (bf16.model_preset.dtype, bf16.model_preset.vae_dtype) == ("bfloat16", "float32")
    fp32_bytes = session_footprint(plain.model_preset, 2).total
    assert session_footprint(bf16.model_preset, 2).total < fp32_bytes
    budget = {"memory_budget_gib": 8 * fp32_bytes / 2 ** 30, "max_sessions_per_group": 1000}
    assert ServeSettings.from_args({**budget, "dtype": "bfloat16"}).sessions_per_group() > \
        ServeSettings.from_args(budget).sessions_per_group()
    monkeypatch.setenv("LINGBOT_DTYPE", "bfloat16")
    assert ServeSettings.from_args({}).model_preset.dtype == "bfloat16"


def test_drain_settings_are_validated():
    with pytest.raises(ConfigError, match="drain_poll_s must be >= 0 \\(0 turns draining off\\), got -1"):
        ServeSettings.from_args({"drain_poll_s": -1})
    with pytest.raises(ConfigError, match=r"drain_lead_s must be >= 0, got -0\.5"):
        ServeSettings.from_args({"drain_lead_s": -0.5})


def test_the_flat_keys_stay_and_round_trip(monkeypatch):
    for key in [*FLAT_DEFAULTS, *NEW_DEFAULTS]:
        monkeypatch.delenv("LINGBOT_" + key.upper(), raising=False)
    s = ServeSettings.from_args({})
    assert s.to_dict() == {**FLAT_DEFAULTS, **NEW_DEFAULTS} == ServeSettings().to_dict()
    assert ServeSettings(**s.to_dict()) == s and ServeSettings.from_args(s.to_dict()) == s
    custom = ServeSettings.from_args({"sp": 4, "pacing": "fixed", "pacing_lead_s": 2, "drain_margin_s": 45,
                                      "encoder_preset": "fast", "api_keys": "k-0123456789abcdef"})
    assert (custom.sp, custom.pacing, custom.pacing_lead_s, custom.drain_margin_s) == (4, "fixed", 2.0, 45.0)
    assert custom.h264_settings.preset == "fast" and custom.api_key_set == {"k-0123456789abcdef"}
    assert ServeSettings(**custom.to_dict()) == custom and custom.to_dict()["pacing_lead_s"] == 2.0
    assert pickle.loads(pickle.dumps(custom)) == custom and hash(custom) == hash(ServeSettings(**custom.to_dict()))
    assert dataclasses.replace(custom, sp=2).sp == 2 and dataclasses.replace(custom, sp=2).drain_margin_s == 45.0
    with pytest.raises(dataclasses.FrozenInstanceError):
        custom.sp = 2
    with pytest.raises(TypeError, match="unexpected keyword argument 'spp'"):
        ServeSettings(spp=2)
    monkeypatch.setenv("LINGBOT_DRAIN_MARGIN_S", "40")          # a new key is overridden like every other
    assert ServeSettings.from_args({"drain_margin_s": 45}).drain_margin_s == 40.0
    assert env_overrides() == {"drain_margin_s": "40"}


def test_each_setting_is_declared_once_and_read_in_one_form():
    """Each flat key is one field, declared by its concern (default, meaning, bounds) and inherited by
    ServeSettings in the concerns' order; the concerns are sections, never attributes of the settings (one form is
    read: settings.<key>)."""
    declared = {f.name: f for f in dataclasses.fields(ServeSettings)}
    assert list(declared) == list(KEYS) and len(KEYS) == len(FLAT_DEFAULTS) + len(NEW_DEFAULTS)
    for key, (concern, f) in KEYS.items():
        assert declared[key] is f and f in dataclasses.fields(CONCERNS[concern]), key
        assert issubclass(ServeSettings, CONCERNS[concern]) and f.metadata["help"].strip(), key
    assert ServeSettings.__annotations__ == {} and KEYS["spare_groups"][1].type == "Optional[int]"
    assert not any(hasattr(ServeSettings(), concern) for concern in CONCERNS)
    s = ServeSettings.from_args({})
    assert (s.drain_margin_s, s.drain_flush_timeout_s, s.drain_fill_max_s, s.drain_wait_new_s,
            s.drain_new_group_slack_s) == (30.0, 10.0, 10.0, 30.0, 10.0)
    assert s.h264_settings.preset == "veryfast"
    a, b = "a-0123456789abcdef", "b-0123456789abcdef"
    door = ServeSettings(api_keys=f"{a}, {b}", allowed_origins="https://x.example/, ,https://y.example",
                         allowed_hosts="World.Example.com., localhost")
    assert door.api_key_set == {a, b} and door.allowed_origin_set == {"https://x.example", "https://y.example"}
    assert door.allowed_host_set == {"world.example.com", "localhost"}


def test_names_never_released_are_gone():
    """The shims of names no release had (the by-device properties' old names, the concerns' old table name) are
    gone, not deprecated."""
    s = ServeSettings(device="cuda", rank_devices=1, max_in_flight_chunks=3)
    assert (s.resolved_spare_groups, s.resolved_max_in_flight_chunks) == (1, 3)
    for old in ("headroom_groups", "in_flight_chunks"):
        assert not hasattr(s, old), old
    assert not hasattr(settings_module, "GROUPS")


@pytest.mark.parametrize("make, message", [
    (lambda: ServeSettings(sp=0), "sp must be >= 1, got 0"),
    (lambda: ServeSettings(device="tpu"), "device 'tpu' must be cpu, cuda or npu"),
    (lambda: ServeSettings(pixel_mode="x"), "pixel_mode 'x' is not one of"),
    (lambda: ServeSettings(cuda_graphs=True), "cuda_graphs needs device cuda, not cpu"),
    (lambda: ServeSettings(decoder="tae,vae"), r"decoder 'tae,vae' must name decoders of \['wan', 'tae'\]"),
    (lambda: ServeSettings(decoder="wan,wan"), "each once"),
    (lambda: ServeSettings(preset="lingbot-world-v2-14b", model_path="/m", decoder="tae"),
     "decoder tae with a checkpoint needs tae_path"),
    (lambda: ServeSettings(dtype="int8"), r"dtype 'int8' is not one of \[.*'bfloat16'.*\]; null keeps the "
                                          r"preset's \(float32\)"),
    (lambda: ServeSettings(rank_cpus=-1), "rank_cpus must be >= 0, got -1"),
    (lambda: ServeSettings(min_groups=3), r"need 1 <= min_groups \(3\) <= max_groups \(2\)"),
    (lambda: ServeSettings(max_sessions_per_group=0), "max_sessions_per_group must be >= 1"),
    (lambda: ServeSettings(admission_wait_s=-1), "admission_wait_s must be >= 0, got -1"),
    (lambda: ServeSettings(max_queue_wait_s=0), "max_queue_wait_s must be > 0, got 0"),
    (lambda: ServeSettings(spare_groups=-1), "spare_groups must be >= 0, got -1"),
    (lambda: ServeSettings(memory_budget_gib=0), "memory_budget_gib must be > 0, got 0"),
    (lambda: ServeSettings(pacing="eager"), "pacing 'eager' must be fixed or adaptive"),
    (lambda: ServeSettings(pacing_quantile=1.5), r"pacing_quantile must be in \(0, 1\], got 1.5"),
    (lambda: ServeSettings(pacing_margin_s=-1), "pacing_margin_s must be >= 0, got -1"),
    (lambda: ServeSettings(pacing_lead_s=0), "pacing_lead_s must be > 0, got 0"),
    (lambda: ServeSettings(fps=-1), "fps must be > 0, got -1"),
    (lambda: ServeSettings(max_fps=12), r"max_fps must be between fps \(16\) and 120, got 12"),
    (lambda: ServeSettings(max_fps=121), r"max_fps must be between fps \(16\) and 120, got 121"),
    (lambda: ServeSettings(max_in_flight_chunks=0), "max_in_flight_chunks must be >= 1, got 0"),
    (lambda: ServeSettings(resume_wait_s=0), "resume_wait_s must be > 0, got 0"),
    (lambda: ServeSettings(drain_poll_s=-1), r"drain_poll_s must be >= 0 \(0 turns draining off\), got -1"),
    (lambda: ServeSettings(drain_lead_s=-0.5), r"drain_lead_s must be >= 0, got -0\.5"),
    (lambda: ServeSettings(drain_margin_s=0), "drain_margin_s must be > 0, got 0"),
    (lambda: ServeSettings(drain_flush_timeout_s=0), "drain_flush_timeout_s must be > 0, got 0"),
    (lambda: ServeSettings(drain_fill_max_s=-1), "drain_fill_max_s must be > 0, got -1"),
    (lambda: ServeSettings(drain_wait_new_s=0), "drain_wait_new_s must be > 0, got 0"),
    (lambda: ServeSettings(drain_new_group_slack_s=-1), "drain_new_group_slack_s must be >= 0, got -1"),
    (lambda: ServeSettings(encoder="vp9"), "encoder 'vp9' is not one of"),
    (lambda: ServeSettings(encoder_threads=-1), "encoder_threads must be >= 0, got -1"),
    (lambda: ServeSettings(image_url_allowlist="ftp://x/"), "image_url_allowlist entry 'ftp://x/' must be"),
    (lambda: ServeSettings(max_sessions_per_key=-1), "max_sessions_per_key must be >= 0, got -1"),
    (lambda: ServeSettings(image_fetch_max_bytes=0), "image_fetch_max_bytes must be > 0, got 0"),
    (lambda: ServeSettings(stall_timeout_s=0), "stall_timeout_s must be > 0, got 0"),
    (lambda: ServeSettings(max_queued_controls=0), "max_queued_controls must be >= 1, got 0"),
    (lambda: ServeSettings(max_messages_per_s=0), "max_messages_per_s must be > 0, got 0"),
    (lambda: ServeSettings(default_chunks=9, max_chunks=8), r"default_chunks \(9\) must be <= max_chunks \(8\)"),
    (lambda: ServeSettings(chunk_timeout_s=0), "chunk_timeout_s must be > 0, got 0"),
    # across concerns: the device against the placement's accelerators
    (lambda: ServeSettings(muxer_gpus=1), "muxer_gpus is for NVENC on CUDA nodes; set it to 0 for device cpu"),
    (lambda: ServeSettings(device="cuda"), "device cuda needs rank_devices > 0"),
    # the flat keys reach the same checks
    (lambda: ServeSettings.from_args({"drain_wait_new_s": 0}), "drain_wait_new_s must be > 0, got 0.0"),
    (lambda: ServeSettings.from_args({"pacing": "eager"}), "pacing 'eager' must be fixed or adaptive"),
])
def test_each_setting_is_checked_with_a_message_that_names_it(make, message):
    with pytest.raises(ConfigError, match=message):
        make()


def test_describe_covers_every_setting_with_its_meaning():
    s = ServeSettings.from_args({"sp": 1, "drain_margin_s": 45})
    rows = s.describe()
    assert [r["name"] for r in rows] == list(s.to_dict())
    defaults = ServeSettings().to_dict()
    for r in rows:
        assert r["concern"] in CONCERNS and r["help"].strip() and r["env"] == "LINGBOT_" + r["name"].upper(), r
        assert r["value"] == getattr(s, r["name"]) and r["default"] == defaults[r["name"]], r
    by_name = {r["name"]: r for r in rows}
    assert by_name["drain_margin_s"] == {
        "concern": "drain", "name": "drain_margin_s", "env": "LINGBOT_DRAIN_MARGIN_S", "value": 45.0,
        "default": 30.0, "help": "a stopping group moves its sessions at the latest this long before Serve kills "
                                 "it (graceful_shutdown_timeout_s)"}


def test_settings_command_prints_every_setting(tmp_path, capsys, monkeypatch):
    config = yaml.safe_load((ROOT / "serve_config.yaml").read_text())
    config["applications"][0]["args"].update(sp=1, drain_margin_s=45)
    path = tmp_path / "serve_config.yaml"
    path.write_text(yaml.safe_dump(config))
    monkeypatch.delenv("LINGBOT_SP", raising=False)
    assert settings_module.main(["--config", str(path)]) == 0
    out = capsys.readouterr().out
    lines = {line.split()[0]: line for line in out.splitlines() if line.startswith("  ")}
    assert set(ServeSettings().to_dict()) <= set(lines)
    for concern in CONCERNS:
        assert f"[{concern}]" in out
    assert lines["drain_margin_s"].split()[1:3] == ["*45.0", "30.0"]     # * where the config changed it
    assert lines["sp"].split()[1:3] == ["*1", "2"] and lines["fps"].split()[1:3] == ["16.0", "16.0"]
    path.write_text(yaml.safe_dump({"applications": [{"args": {"sp": 3}}]}))
    assert settings_module.main(["--config", str(path)]) == 2
    assert "sp 3 does not divide" in capsys.readouterr().err
    # the module runs as a command; --json gives describe()'s rows
    env = {k: v for k, v in os.environ.items() if not k.startswith("LINGBOT_")}
    done = subprocess.run([sys.executable, "-m", "deployments.settings", "--json"], cwd=ROOT, env=env,
                          capture_output=True, text=True, check=True)
    assert json.loads(done.stdout) == ServeSettings().describe()


def test_api_keys_are_masked_wherever_settings_are_printed(capsys, monkeypatch):
    """The keys never appear in describe(), the settings command (a terminal, a CI log) or a repr (a log line,
    a traceback); their count does."""
    monkeypatch.setenv("LINGBOT_API_KEYS", "k-secret-1-0123456, k-secret-2-0123456")
    s = ServeSettings.from_args({})
    assert s.api_key_set == {"k-secret-1-0123456", "k-secret-2-0123456"}
    (row,) = [r for r in s.describe() if r["name"] == "api_keys"]
    assert (row["value"], row["default"]) == ("<2 keys, masked>", "")
    for argv in ([], ["--json"]):
        assert settings_module.main(argv) == 0
        out = capsys.readouterr().out
        assert "k-secret" not in out and "<2 keys, masked>" in out
    assert [r["value"] for r in ServeSettings().describe() if r["name"] == "api_keys"] == [""]
    assert "k-secret" not in repr(s)


def test_the_quality_ladder_settings_are_checked():
    import pytest

    from lingbot.config import ConfigError
    assert ServeSettings(quality_ladder="auto", quality_floor="steps3").quality_floor == "steps3"
    with pytest.raises(ConfigError, match="quality_ladder 'on' must be off or auto"):
        ServeSettings(quality_ladder="on")
    with pytest.raises(ConfigError, match=r"quality_floor 'full' must be one of \['steps3', 'steps2', "
                                          r"'tiny_steps2'\]"):
        ServeSettings(quality_floor="full")
    with pytest.raises(ConfigError, match=r"quality_floor 'tiny' must be one of"):
        ServeSettings(quality_floor="tiny")               # a session's own tiny decoder, not a floor
    assert ServeSettings(quality_floor="tiny_steps2").quality_rungs == ("full", "steps3", "steps2",
                                                                        "tiny_steps2")   # cpu: tae,wan loaded
    with pytest.raises(ConfigError, match=r"quality_floor 'tiny_steps2' is a decoder rung: it needs both decoders"):
        ServeSettings(quality_floor="tiny_steps2", device="cuda", rank_devices=1)         # cuda: wan alone


def test_the_environment_wins_over_the_files_user_config_too(monkeypatch):
    """One precedence for every setting: LINGBOT_QUALITY_LADDER=auto with serve_config.yaml's WorldGroup
    user_config `quality_ladder: "off"` serves with the ladder on, and says which value it overrode; without the
    variable the file's value holds; a key the group does not take live is refused, naming the ones it does."""
    from deployments.local import group_user_config, lingbot_app
    from deployments.settings import live_settings
    config = yaml.safe_load((ROOT / "serve_config.yaml").read_text())
    user_config = group_user_config(lingbot_app(config))
    assert user_config == {"quality_ladder": "off"}
    assert live_settings(user_config, {}) == ({"quality_ladder": "off"}, [])
    assert live_settings(user_config, {"quality_ladder": "auto"}) == ({"quality_ladder": "auto"}, [
        "quality_ladder 'auto' from LINGBOT_QUALITY_LADDER overrides the user_config's 'off'"])
    assert live_settings({"quality_ladder": "auto"}, {"quality_ladder": "auto"}) == ({"quality_ladder": "auto"}, [])
    assert live_settings({}, {"quality_ladder": "auto"}) == ({"quality_ladder": "auto"}, [])
    with pytest.raises(ConfigError, match=r"WorldGroup user_config takes quality_ladder only, not \['sp'\]"):
        live_settings({"sp": 4}, {})
    assert group_user_config({"args": {}}) is None
    # what the app pins: the variable, read where the app is built, as the WorldGroup's second argument
    import inspect

    from deployments.app import build_app, compose_app
    assert len(inspect.signature(build_app).parameters) == 1     # what Serve's import_path takes (serve deploy)
    monkeypatch.setenv("LINGBOT_QUALITY_LADDER", "auto")

    def world_group(app):                       # the Ingress is bound to (WorldGroup, settings)
        return app._bound_deployment.init_args[0]._bound_deployment

    group = world_group(compose_app({}, user_config))
    assert group.name == "WorldGroup" and group.init_args[1] == {"quality_ladder": "auto"}
    assert group.user_config == {"quality_ladder": "off"}     # the file's, overridden in the group (reconfigure)
    monkeypatch.delenv("LINGBOT_QUALITY_LADDER")
    assert world_group(compose_app({}, user_config)).init_args[1] == {}
    assert world_group(build_app({})).init_args[1] == {} and world_group(build_app({})).user_config == {
        "quality_ladder": "off"}
