"""The container image's constraints, `python -m cluster.constraints [-o cluster/constraints.txt]`: every package
lingbot-serve needs at run time (its dependencies and theirs, `ray[serve]` with its extra), pinned to the version
installed here, where the tests pass. cluster/Dockerfile installs the package under them, so an image built later
gets the versions that were tested, not whatever PyPI holds that day. A local version label (torch's `+cpu`) is
dropped: the image takes the same release built for its accelerator."""
from __future__ import annotations

import argparse
import re
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement

PACKAGE = "lingbot-serve"
OUT = Path(__file__).resolve().parent / "constraints.txt"


def _key(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def closure(package: str = PACKAGE) -> dict[str, str]:
    """{normalized name: version} of `package`'s run-time requirements, transitively (extras as requested)."""
    pins: dict[str, str] = {}
    todo = [(package, frozenset())]
    while todo:
        name, extras = todo.pop()
        dist = metadata.distribution(name)
        for text in dist.requires or []:
            req = Requirement(text)
            if req.marker is not None and not any(req.marker.evaluate({"extra": e}) for e in extras or {""}):
                continue
            key = _key(req.name)
            if key not in pins:
                pins[key] = metadata.version(req.name).split("+")[0]
                todo.append((req.name, frozenset(req.extras)))
    return dict(sorted(pins.items()))


def render(pins: dict[str, str]) -> str:
    head = ("# lingbot-serve's run-time packages, pinned to the versions its tests passed with (python -m "
            "cluster.constraints);\n# cluster/Dockerfile installs the package under them (pip install -c).\n")
    return head + "".join(f"{name}=={version}\n" for name, version in pins.items())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-o", "--output", default=str(OUT))
    args = ap.parse_args(argv)
    pins = closure()
    Path(args.output).write_text(render(pins))
    print(f"wrote {args.output}: {len(pins)} packages")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
