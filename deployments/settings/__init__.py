"""Serving settings: one typed, validated object built from serve_config.yaml's `args` (and the only
place that reads environment variables). Every error names the bad value and the fix.

ServeSettings composes one small frozen dataclass per concern (model, placement, capacity, pace,
continuity, drain, encoding, door, limits, health), each validating its own fields; what spans concerns
(the device against the placement's accelerators) ServeSettings checks. The config stays flat: each field
has one flat key (`drain_lead_s` is `settings.drain.lead_s`), which serve_config.yaml, LINGBOT_<KEY>,
ServeSettings(**flat), to_dict() and `settings.<key>` all use.

    python -m deployments.settings                              # every setting: value, default, meaning
    python -m deployments.settings --config serve_config.yaml   # the values of that config's first app
    python -m deployments.settings --json
"""
from .cli import format_table, main
from .groups import (
    GROUPS,
    KEYS,
    CapacitySettings,
    ContinuitySettings,
    DoorSettings,
    DrainSettings,
    EncoderSettings,
    HealthSettings,
    ModelSettings,
    PacingSettings,
    PlacementSettings,
    SessionLimits,
    setting,
)
from .serve import ACCELERATOR_RESOURCE, ENV_PREFIX, ServeSettings

__all__ = ["ACCELERATOR_RESOURCE", "ENV_PREFIX", "GROUPS", "KEYS", "CapacitySettings", "ContinuitySettings",
           "DoorSettings", "DrainSettings", "EncoderSettings", "HealthSettings", "ModelSettings", "PacingSettings",
           "PlacementSettings", "ServeSettings", "SessionLimits", "format_table", "main", "setting"]
