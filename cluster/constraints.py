"""The container image's constraints, `python -m cluster.constraints [-o cluster/constraints.txt]`: every package
lingbot-serve needs at run time (its dependencies and theirs, `ray[serve]` with its extra), pinned to the version
installed here, where the tests pass. cluster/Dockerfile installs the package under them, so an image built later
gets the versions that were tested, not whatever PyPI holds that day. Left out: the packages built for an
accelerator (torch and what only it needs, triton, the nvidia-* runtime wheels, numpy): the base image or pip
picks the build for the image's accelerator (CUDA's torch from PyPI; an Ascend image's own torch with torch_npu,
which a CPU pin from here would replace)."""
from __future__ import annotations

import argparse
import re
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement

PACKAGE = "lingbot-serve"
OUT = Path(__file__).resolve().parent / "constraints.txt"
ACCELERATOR_BOUND = frozenset({"torch", "triton", "numpy"})     # and the nvidia-* runtime wheels


def accelerator_bound(key: str) -> bool:
    """Built for an accelerator: left to the image (nvidia-ml-py, a pure-Python binding of NVML, is not)."""
    return key in ACCELERATOR_BOUND or (key.startswith("nvidia-") and key != "nvidia-ml-py")


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
            if accelerator_bound(key):
                continue
            if key not in pins:
                pins[key] = metadata.version(req.name)
                todo.append((req.name, frozenset(req.extras)))
    return dict(sorted(pins.items()))


def render(pins: dict[str, str]) -> str:
    head = ("# lingbot-serve's run-time packages, pinned to the versions its tests passed with (python -m "
            "cluster.constraints);\n# cluster/Dockerfile installs the package under them (pip install -c). Not "
            "pinned: torch, triton, numpy\n# and nvidia-*, built for the image's accelerator.\n")
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
