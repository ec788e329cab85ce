"""Serving settings: one typed, validated, frozen object (ServeSettings) built from serve_config.yaml's `args`
and overridden by LINGBOT_<KEY> environment variables (the only place that reads them). Every error names the bad
value and the fix.

Each setting is declared once (concerns.py): its flat key, type, default, meaning and bounds, in the concern it
belongs to (model, placement, capacity, pace, continuity, drain, encoding, access, limits, health), whose own checks
sit beside it. ServeSettings inherits every concern's fields and is the one form read everywhere
(`settings.drain_lead_s`).

    python -m deployments.settings                              # every setting: value, default, meaning
    python -m deployments.settings --config serve_config.yaml   # the values of that config's first app
    python -m deployments.settings --json
"""
from .cli import format_table, main
from .concerns import CONCERNS, KEYS, parse_allowlist
from .declare import ENV_PREFIX, env_name, setting
from .serve import ACCELERATOR_RESOURCE, LIVE_SETTINGS, ServeSettings, env_overrides, live_settings

__all__ = ["ACCELERATOR_RESOURCE", "CONCERNS", "ENV_PREFIX", "KEYS", "LIVE_SETTINGS", "ServeSettings", "env_name",
           "env_overrides", "format_table", "live_settings", "main", "parse_allowlist", "setting"]
