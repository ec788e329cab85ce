"""`lingbot` command line: thin entry points over the library (STYLE.md §14)."""
from __future__ import annotations

import argparse
import logging
import sys

from .config import PRESETS, ConfigError

log = logging.getLogger("lingbot")


def cmd_presets(args) -> None:
    for name, p in PRESETS.items():
        t = p.transformer
        print(f"{name:>22}: {p.width}x{p.height} {p.dtype}, dim {t.dim} ({t.num_attention_heads}x"
              f"{t.attention_head_dim}), {t.num_layers} layers, timesteps {list(p.sampler.timesteps)} "
              f"shift {p.sampler.shift} - {p.description}")


def cmd_write_checkpoint(args) -> None:
    from .checkpoint import write_random_checkpoint
    from .config import get_preset
    folder = write_random_checkpoint(get_preset(args.preset), args.output, seed=args.seed)
    print(f"wrote {args.preset} with random weights to {folder}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lingbot", description="LingBot-World engine commands")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("presets", help="list the model presets")
    p.set_defaults(func=cmd_presets)
    p = sub.add_parser("write-checkpoint", help="write a preset with random weights in the real folder layout")
    p.add_argument("output", help="folder to write (transformer/, text_encoder/, tokenizer/, model_index.json)")
    p.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    p.add_argument("--seed", type=int, default=None, help="weights seed (default: the preset's)")
    p.set_defaults(func=cmd_write_checkpoint)
    return parser


def main(argv=None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except (ConfigError, ValueError, FileNotFoundError) as e:
        print(f"lingbot: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
