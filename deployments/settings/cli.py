"""The settings command, `python -m deployments.settings [--config serve_config.yaml] [--json]`: every serve
setting by concern, its value, default and meaning."""
from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Optional

from lingbot.config import ConfigError

from .concerns import CONCERNS
from .serve import ServeSettings


def _show(value: Any) -> str:
    return json.dumps(value)        # null, true, "auto", "": as unambiguous as YAML


def format_table(rows: list[dict]) -> str:
    """describe()'s rows as one table per concern: key, value (* where not the default), default, meaning."""
    widths = [max(len(r["name"]) for r in rows), max(len(_show(r["value"])) for r in rows) + 1,
              max(len(_show(r["default"])) for r in rows)]
    lines: list[str] = []
    for concern, cls in CONCERNS.items():
        lines += [f"[{concern}] {' '.join(cls.__doc__.split())}",
                  _row(widths, "setting", " value", "default", "meaning")]
        for r in rows:
            if r["concern"] == concern:
                changed = "*" if r["value"] != r["default"] else " "
                lines.append(_row(widths, r["name"], changed + _show(r["value"]), _show(r["default"]), r["help"]))
        lines.append("")
    return "\n".join(lines).rstrip("\n")


def _row(widths: list[int], *cells: str) -> str:
    return "  " + "  ".join(f"{c:<{w}}" for c, w in zip(cells, widths)) + "  " + cells[-1]


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m deployments.settings",
        description="Every serve setting by concern: its flat key (serve_config.yaml args, LINGBOT_<KEY>), value, "
                    "default and meaning. Values are what the app would run with here: the config's args (the "
                    "defaults without --config), overridden by LINGBOT_<KEY> environment variables.")
    parser.add_argument("--config", help="a Serve config (serve_config.yaml): show its first application's args")
    parser.add_argument("--json", action="store_true", help="describe()'s rows as JSON")
    args = parser.parse_args(argv)
    config_args: dict = {}
    if args.config:
        import yaml
        with open(args.config) as f:
            config = yaml.safe_load(f) or {}
        apps = config.get("applications") or []
        if not apps:
            parser.error(f"{args.config} has no applications")
        config_args = apps[0].get("args") or {}
    try:
        settings = ServeSettings.from_args(config_args)
    except ConfigError as e:
        print(f"invalid settings: {e}", file=sys.stderr)
        return 2
    rows = settings.describe()
    print(json.dumps(rows, indent=2) if args.json else format_table(rows))
    return 0

