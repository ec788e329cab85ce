"""The groups the deployment asks for: the policy Serve's autoscaler runs, called through Ray's own wrapper
(bounds, delays) with Ray's own AutoscalingContext, as the controller calls it."""
import pytest
from ray.serve._private.autoscaling_state import _resolve_policy_callable
from ray.serve._private.common import DeploymentID
from ray.serve.autoscaling_policy import _apply_autoscaling_config
from ray.serve.config import AutoscalingConfig, AutoscalingContext

from deployments.app import group_autoscaling
from deployments.group.scaling import GroupScaling, wanted_groups
from deployments.settings import ServeSettings
from lingbot.config import ConfigError


def context(config: AutoscalingConfig, sessions: float, replicas: int, metrics=None) -> AutoscalingContext:
    return AutoscalingContext(
        deployment_id=DeploymentID("WorldGroup", "lingbot"), deployment_name="WorldGroup", app_name="lingbot",
        current_num_replicas=replicas, target_num_replicas=replicas, running_replicas=[],
        total_num_requests=sessions, total_queued_requests=None, aggregated_metrics=metrics, raw_metrics=None,
        capacity_adjusted_min_replicas=config.min_replicas, capacity_adjusted_max_replicas=config.max_replicas,
        policy_state={}, last_scale_up_time=None, last_scale_down_time=None, current_time=None, config=config)


def decide(settings: ServeSettings, sessions: float, replicas: int, metrics=None) -> int:
    """One control-loop decision on the app's own autoscaling config (no delay: the decision itself)."""
    config = AutoscalingConfig(**{**group_autoscaling(settings, settings.sessions_per_group()),
                                  "upscale_delay_s": 0.0, "downscale_delay_s": 0.0})
    policy = _apply_autoscaling_config(_resolve_policy_callable(config.policy))
    groups, _ = policy(context(config, sessions, replicas, metrics))
    return min(max(groups, config.min_replicas), config.max_replicas)


def test_a_burst_asks_for_a_group_per_capacity_of_sessions_up_to_max_groups():
    s = ServeSettings(max_sessions_per_group=2, min_groups=1, max_groups=4)
    # running + queued sessions (a waiting session's lease call is queued at the handle) -> groups
    assert [decide(s, n, replicas=1) for n in (0, 1, 2, 3, 4, 5, 8, 20)] == [1, 1, 1, 2, 2, 3, 4, 4]
    assert decide(s, 4, replicas=2) == 2 and decide(s, 1, replicas=3) == 1      # and down when they end


def test_spare_groups_keep_free_groups_beyond_the_sessions():
    s = ServeSettings(max_sessions_per_group=2, min_groups=1, max_groups=8, spare_groups=1)
    assert [decide(s, n, replicas=2) for n in (0, 1, 2, 3, 4)] == [1, 2, 2, 3, 3]
    assert ServeSettings(device="cuda", rank_devices=1).resolved_spare_groups == 1    # the default on accelerators
    assert ServeSettings().resolved_spare_groups == 0                                  # and on cpu


def test_demand_is_counted_at_the_groups_top_rung_capacity_they_report():
    """A group that holds 1 session at real time at full (the ladder carries the second on a cheaper rung)
    reports it: 2 sessions ask for 2 groups, where its configured 2 would ask for 1. The smallest report counts,
    never above the configured cap nor below 1; no report: the configured cap."""
    from ray.serve._private.common import ReplicaID
    s = ServeSettings(max_sessions_per_group=2, min_groups=1, max_groups=4)
    a, b = (ReplicaID(f"r{i}", DeploymentID("WorldGroup", "lingbot")) for i in range(2))
    assert decide(s, 2, replicas=1) == 1 and decide(s, 2, replicas=1, metrics={}) == 1
    assert decide(s, 2, replicas=1, metrics={"top_capacity": {a: 1.0}}) == 2
    assert decide(s, 3, replicas=2, metrics={"top_capacity": {a: 2.0, b: 1.4}}) == 3
    assert decide(s, 4, replicas=2, metrics={"top_capacity": {a: 7.0, b: 5.0}}) == 2      # the cap: 2
    assert decide(s, 3, replicas=2, metrics={"top_capacity": {a: 0.0}}) == 3               # at least 1


def test_the_policy_refuses_nonsense_at_deploy_time():
    assert wanted_groups(4.000001, 2, 0) == 2              # a float sum of metrics that is 4 is 2 groups
    with pytest.raises(ValueError, match="capacity 0 must be >= 1"):
        GroupScaling(capacity=0)
    with pytest.raises(ValueError, match="spare_groups -1"):
        GroupScaling(capacity=2, spare_groups=-1)


def test_the_ingress_adds_a_replica_per_three_quarters_of_its_sessions_up_to_its_bound():
    """max_ingress_replicas 4, 64 sessions a replica: Serve's own policy on the WebSockets held asks for a replica
    per 48 (ceil), at most 4; with the default 1 there is no autoscaling (one replica), nor with min_ingress_replicas
    equal to the max (that many); a min above the max is refused."""
    from deployments.app import ingress_scaling
    assert ingress_scaling(ServeSettings()) == {"num_replicas": 1}
    assert ingress_scaling(ServeSettings(min_ingress_replicas=2, max_ingress_replicas=2)) == {"num_replicas": 2}
    assert ingress_scaling(ServeSettings(min_ingress_replicas=2, max_ingress_replicas=3))["autoscaling_config"][
        "min_replicas"] == 2
    with pytest.raises(ConfigError, match=r"min_ingress_replicas \(3\) must be at most max_ingress_replicas \(2\)"):
        ServeSettings(min_ingress_replicas=3, max_ingress_replicas=2)
    s = ServeSettings(max_ingress_replicas=4)
    config = AutoscalingConfig(**{**ingress_scaling(s)["autoscaling_config"], "upscale_delay_s": 0.0,
                                  "downscale_delay_s": 0.0})
    policy = _apply_autoscaling_config(_resolve_policy_callable(config.policy))

    def replicas(held: int, now: int) -> int:
        ctx = context(config, held, now)
        return min(max(policy(ctx)[0], config.min_replicas), config.max_replicas)
    assert [replicas(n, 1) for n in (10, 48, 49, 130, 400)] == [1, 1, 2, 3, 4]


def test_a_stopping_ingress_replica_keeps_its_websockets_for_as_long_as_a_session_may_last():
    """Scaled down or replaced, an ingress replica is stopped only once its sessions ended: its grace covers the
    start, the longest wait and the longest life (the groups' grace where that is longer)."""
    from deployments.app import ingress_grace_s
    assert ingress_grace_s(ServeSettings()) == 10.0 + 600.0 + 3600.0
    assert ingress_grace_s(ServeSettings(max_lifetime_s=60, max_queue_wait_s=30, start_timeout_s=5)) == 600.0
    assert ingress_grace_s(ServeSettings(max_lifetime_s=7200, graceful_shutdown_timeout_s=30)) == 10.0 + 600.0 + 7200.0
