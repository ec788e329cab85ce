"""Serving settings: one typed, validated object built from serve_config.yaml's `args` (and the only
place that reads environment variables). Every error names the bad value and the fix.

ServeSettings declares every flat key as a typed field (`settings.drain_lead_s`): what serve_config.yaml,
LINGBOT_<KEY>, ServeSettings(**flat) and to_dict() use. The keys belong to concerns (model, placement,
capacity, pace, continuity, drain, encoding, door, limits, health; concerns.py), one small frozen dataclass
each, which gives every key its default and meaning and validates its fields: ServeSettings builds them
(`settings.drain.lead_s` is drain_lead_s) and checks what spans concerns (the device against the
placement's accelerators).

    python -m deployments.settings                              # every setting: value, default, meaning
    python -m deployments.settings --config serve_config.yaml   # the values of that config's first app
    python -m deployments.settings --json
"""
import warnings

from .cli import format_table, main
from .concerns import (
    CONCERNS,
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
    SettingsConcern,
    parse_allowlist,
    setting,
)
from .serve import ACCELERATOR_RESOURCE, ENV_PREFIX, ServeSettings

__all__ = ["ACCELERATOR_RESOURCE", "CONCERNS", "ENV_PREFIX", "KEYS", "CapacitySettings", "ContinuitySettings",
           "DoorSettings", "DrainSettings", "EncoderSettings", "HealthSettings", "ModelSettings", "PacingSettings",
           "PlacementSettings", "ServeSettings", "SessionLimits", "SettingsConcern", "format_table", "main",
           "parse_allowlist", "setting"]


def __getattr__(name: str):
    if name == "GROUPS":                 # the concerns' old name (a "group" is a model group everywhere else)
        warnings.warn("deployments.settings.GROUPS is deprecated: use CONCERNS", DeprecationWarning, stacklevel=2)
        return CONCERNS
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
