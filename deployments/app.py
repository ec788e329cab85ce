"""The application builder: `serve run serve_config.yaml` / `serve deploy serve_config.yaml` call
build_app(args) with the config's `args` (see ServeSettings for every field)."""
from __future__ import annotations

from ray import serve
from ray.serve import Application

from lingbot.config import ConfigError

from .group.replica import WorldGroup
from .ingress.app import Ingress
from .settings import LIVE_SETTINGS, ServeSettings, env_overrides

# Serve's autoscaling window: its largest demand counts (max). Serve decides only once every handle's and
# replica's series fills the window, so its length is the reaction time to a burst (measured: 12 s -> ~12 s,
# 4 s -> 2.8 s, perf/burst.py); the metrics interval (deprecated in Serve, still what bounds the window and the
# record interval) goes down with it, and every process pushes each second (CLUSTER_ENV)
LOOK_BACK_S = 4.0
METRICS_INTERVAL_S = 1.0


def group_autoscaling(s: ServeSettings, capacity: int) -> dict:
    """Serve's autoscaling config of the WorldGroup deployment. The demand is every session holding or waiting
    for a lease (deployments/group/scaling.py); a short look-back and the 1 s metric pushes (deployments/local.py
    CLUSTER_ENV) let a burst ask for its groups within seconds."""
    return {"min_replicas": s.min_groups, "max_replicas": s.max_groups, "target_ongoing_requests": capacity,
            "look_back_period_s": LOOK_BACK_S, "metrics_interval_s": METRICS_INTERVAL_S, "aggregation_function": "max",
            "upscale_delay_s": 1.0, "downscale_delay_s": 120.0,
            "policy": {"policy_function": "deployments.group.scaling:GroupScaling",
                       "policy_kwargs": {"capacity": capacity, "spare_groups": s.resolved_spare_groups}}}


def ingress_scaling(s: ServeSettings) -> dict:
    """The ingress deployment's replicas: a fixed number (min_ingress_replicas = max_ingress_replicas, 1 by default),
    or Serve's own policy on the requests each holds (its WebSockets, nearly all) between the two, one more replica
    when they pass 3/4 of max_ingress_sessions each; a replica is removed only after 10 minutes below, and only
    once its sessions ended (ingress_grace_s)."""
    if s.min_ingress_replicas == s.max_ingress_replicas:
        return {"num_replicas": s.max_ingress_replicas}
    return {"autoscaling_config": {"min_replicas": s.min_ingress_replicas, "max_replicas": s.max_ingress_replicas,
                                   "target_ongoing_requests": max(1, s.max_ingress_sessions * 3 // 4),
                                   "upscale_delay_s": 2.0, "downscale_delay_s": 600.0,
                                   "look_back_period_s": LOOK_BACK_S, "metrics_interval_s": METRICS_INTERVAL_S}}


def ingress_grace_s(s: ServeSettings) -> float:
    """How long Serve lets a stopping ingress replica (scaled down, or replaced by a redeploy) keep its WebSockets:
    a session cannot move off the replica that holds its socket (its groups can: the drain), so the grace covers
    the longest a session may last from its connection (start_timeout_s, max_queue_wait_s, max_lifetime_s) and
    no replica with open sockets is removed; Serve stops it as soon as its last one ends."""
    return max(s.graceful_shutdown_timeout_s, s.start_timeout_s + s.max_queue_wait_s + s.max_lifetime_s)


def build_app(args: dict | None = None) -> Application:
    """serve_config.yaml's import_path (`serve run`, `serve deploy`): the app of its `args`. Serve takes a builder
    of exactly one parameter, and merges the file's `deployments:` (the WorldGroup's user_config) in itself."""
    return compose_app(args)


def compose_app(args: dict | None = None, user_config: dict | None = None) -> Application:
    """The app of serve_config.yaml's `args`; `user_config` is the WorldGroup's from the file's `deployments:` where
    the caller reads the file itself (deployments.local, `make serve`)."""
    s = ServeSettings.from_args(args)
    pinned = {key: getattr(s, key) for key in env_overrides() if key in LIVE_SETTINGS}
    settings = {key: value for key, value in s.to_dict().items() if key not in LIVE_SETTINGS}
    capacity = s.sessions_per_group()
    if capacity < 1:
        raise ConfigError(f"memory_budget_gib {s.memory_budget_gib} fits no session of {s.preset} at sp {s.sp}; "
                          f"raise it (or leave it unset on GPUs, to use the memory measured at start-up)")
    group = serve.deployment(
        WorldGroup, name="WorldGroup",
        ray_actor_options={"num_cpus": s.replica_cpus},
        placement_group_bundles=s.placement_bundles, placement_group_strategy="STRICT_PACK",
        max_ongoing_requests=capacity,
        autoscaling_config=group_autoscaling(s, capacity),
        graceful_shutdown_timeout_s=s.graceful_shutdown_timeout_s,
        health_check_period_s=10.0,
        user_config={**{key: getattr(s, key) for key in LIVE_SETTINGS}, **(user_config or {})},
    ).bind(settings, pinned)
    return serve.deployment(
        Ingress, name="Ingress", ray_actor_options={"num_cpus": s.ingress_cpus},
        # Serve routes every connection to it at once (the door refuses beyond max_ingress_sessions with
        # server_busy), with room for the health routes that no crowd of WebSockets may starve
        max_ongoing_requests=s.max_ingress_connections,
        **ingress_scaling(s),
        # a redeploy or a scale-down stops an ingress replica: it keeps its WebSockets (their sessions moving to
        # the new groups on a redeploy) until they end
        graceful_shutdown_timeout_s=ingress_grace_s(s),
    ).bind(group, settings)
