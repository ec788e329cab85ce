"""Serving settings: validation, environment overrides, placement and the resources the app requests."""
import pytest

from deployments.settings import ServeSettings
from lingbot.config import ConfigError


def test_settings_validation(monkeypatch):
    s = ServeSettings.from_args({"sp": 2, "rank_cpus": "0.25"})
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
    assert ServeSettings.from_args({"api_keys": "k1, k2"}).api_key_set == {"k1", "k2"}
    assert ServeSettings.from_args({}).api_key_set == frozenset()


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


def test_device_metrics_are_tagged_by_the_rank_that_measured_them():
    """Each rank measures its own device (whatever index the node gives it); the group tags by rank, and a
    rank without an accelerator (CPU) reports nothing."""
    from deployments.group import device_metric_tags
    from deployments.messages import DeviceStats
    from deployments.rank import RankWorker
    rank0, rank1 = DeviceStats(90.0, 5 << 30), DeviceStats(40.0, 7 << 30)
    assert device_metric_tags("g1", [rank0, rank1]) == [(rank0, {"group": "g1", "rank": "0"}),
                                                     (rank1, {"group": "g1", "rank": "1"})]
    assert device_metric_tags("g1", [None, rank1]) == [(rank1, {"group": "g1", "rank": "1"})]
    worker = RankWorker(ServeSettings.from_args({"sp": 1}).to_dict(), rank=0, world_size=1)
    assert worker.device.type == "cpu" and worker.device_stats().memory_used > 0       # CPU: the rank's process


def test_in_flight_chunks_default_by_device():
    assert ServeSettings.from_args({}).in_flight_chunks == 1
    assert ServeSettings.from_args({"max_in_flight_chunks": 3}).in_flight_chunks == 3
    gpu = {"preset": "lingbot-world-v2-14b", "model_path": "/m", "device": "cuda", "rank_devices": 1, "sp": 4}
    assert ServeSettings.from_args(gpu).in_flight_chunks == 2
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


def test_a_stopping_group_moves_its_sessions_to_a_group_with_room_or_before_its_grace_ends():
    from deployments.group import DRAIN_MARGIN_S, NEW_GROUP_SLACK_S, drain_due
    grace, t, rollout = 600.0, 100.0, 5000.0          # monotonic now; wall clock of the first stop seen
    old = ("RUNNING", rollout - 3600.0)                  # started an hour before the redeploy (maybe full)
    new = ("RUNNING", rollout - NEW_GROUP_SLACK_S + 1)   # started with the redeploy (seen a poll late)
    stopping = ("STOPPING", rollout - 3600.0)
    # a redeploy: b is old, c new; move once c runs, not to b
    assert drain_due("a", {"a": stopping, "b": old, "c": ("STARTING", 0.0)}, rollout, t, t + 29, grace) is None
    assert drain_due("a", {"a": stopping, "b": old, "c": new}, rollout, t, t, grace) == "new group"
    # the new one never comes up (it waits for the devices this one holds): after a while, to the old ones
    assert drain_due("a", {"a": stopping, "b": old, "c": ("STARTING", 0.0)}, rollout, t, t + 30, grace) == \
        "no new group"
    # a scale-down: only this one goes, nothing starts: the others take the sessions
    assert drain_due("a", {"a": stopping, "b": old}, rollout, t, t, grace) == "scale-down"
    # no other group at all: the sessions stay until the margin before the kill
    alone = {"a": stopping, "c": ("STARTING", 0.0)}
    assert drain_due("a", alone, rollout, t, t + grace - DRAIN_MARGIN_S - 0.1, grace) is None
    assert drain_due("a", alone, rollout, t, t + grace - DRAIN_MARGIN_S, grace) == "deadline"
    assert drain_due("a", {"a": stopping, "b": stopping}, rollout, t, t, 5.0) == "deadline"   # grace < margin
    with pytest.raises(ConfigError, match="drain_poll_s must be >= 0 \\(0 turns draining off\\), got -1"):
        ServeSettings.from_args({"drain_poll_s": -1})
    with pytest.raises(ConfigError, match=r"drain_lead_s must be >= 0, got -0\.5"):
        ServeSettings.from_args({"drain_lead_s": -0.5})
