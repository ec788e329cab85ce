"""How a serving setting is declared (concerns.py declares them all): `setting(default, help, bounds)`, its
environment variable, the check of its bounds, and `SettingsConcern`, the base of each concern's section."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Optional

from lingbot.config import ConfigError

ENV_PREFIX = "LINGBOT_"


def setting(default: Any, help: str, *, at_least: Optional[float] = None, above: Optional[float] = None,
            why: str = "", secret: bool = False):
    """A setting: its default, what it means, its bounds (at_least: value >= bound, above: value > bound; a null
    value is not bounded; `why` ends the refusal's message) and whether it is a secret (left out of the repr,
    masked by describe())."""
    return field(default=default, repr=not secret,
                 metadata={"help": help, "at_least": at_least, "above": above, "why": why, "secret": secret})


def env_name(key: str) -> str:
    """The environment variable that overrides setting `key` (LINGBOT_DRAIN_LEAD_S for drain_lead_s)."""
    return ENV_PREFIX + key.upper()


def check_bounds(f: dataclasses.Field, value: Any) -> None:
    """ConfigError naming the setting where `value` is outside its declared bounds."""
    if value is None:
        return
    low, strict = (f.metadata["above"], True) if f.metadata["above"] is not None else (f.metadata["at_least"], False)
    if low is not None and (value < low or (strict and value == low)):
        raise ConfigError(f"{f.name} must be {'>' if strict else '>='} {low:g}{f.metadata['why']}, got {value}")


@dataclass(frozen=True)
class SettingsConcern:
    """One concern's settings, a section of ServeSettings. `check` validates what the declared bounds cannot
    (choices, relations between fields); it runs on the whole ServeSettings, after every bound holds."""

    def check(self) -> None:
        """Nothing beyond the bounds."""
