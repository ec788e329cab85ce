"""The application builder: `serve run serve_config.yaml` / `serve deploy serve_config.yaml` call
build_app(args) with the config's `args` (see ServeSettings for every field)."""
from __future__ import annotations

from ray import serve
from ray.serve import Application

from .group import WorldGroup
from .ingress import Ingress
from .settings import ServeSettings


def group_capacity(s: ServeSettings) -> int:
    """Sessions per group from the config alone (the same numbers the ranks compute at start-up)."""
    from lingbot.budget import sessions_that_fit
    from lingbot.config import ConfigError, get_preset
    capacity = sessions_that_fit(get_preset(s.preset), s.sp, int(s.memory_budget_gib * 2 ** 30),
                                 s.max_sessions_per_group)
    if capacity < 1:
        raise ConfigError(f"memory_budget_gib {s.memory_budget_gib} fits no session of {s.preset} at sp {s.sp}")
    return capacity


def build_app(args: dict | None = None) -> Application:
    s = ServeSettings.from_args(args)
    settings = s.to_dict()
    capacity = group_capacity(s)
    group = serve.deployment(
        WorldGroup, name="WorldGroup",
        ray_actor_options={"num_cpus": s.replica_cpus},
        placement_group_bundles=s.placement_bundles, placement_group_strategy="STRICT_PACK",
        max_ongoing_requests=capacity,
        autoscaling_config={"min_replicas": s.min_groups, "max_replicas": s.max_groups,
                            "target_ongoing_requests": capacity,
                            "upscale_delay_s": 2.0, "downscale_delay_s": 120.0},
        graceful_shutdown_timeout_s=s.graceful_shutdown_timeout_s,
        health_check_period_s=10.0,
    ).bind(settings)
    return serve.deployment(
        Ingress, name="Ingress", ray_actor_options={"num_cpus": s.ingress_cpus},
        max_ongoing_requests=s.max_ingress_sessions,
    ).bind(group, settings)
