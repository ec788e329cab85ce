"""Dependency floors: the libraries that read client input (Pillow, msgpack) have floors past their known holes,
Ray is pinned to the minor version the code and the cluster are made for, and the environment the tests run in
satisfies all of them."""
import re
from importlib.metadata import version
from pathlib import Path

from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]


def requirements() -> dict[str, Requirement]:
    """pyproject.toml's [project] dependencies (read by hand: tomllib is Python 3.11's, the floor is 3.10)."""
    block = re.search(r"^dependencies = \[\n(.*?)^\]", (ROOT / "pyproject.toml").read_text(), flags=re.M | re.S)
    return {r.name: r for r in map(Requirement, re.findall(r'^\s*"([^"]+)",', block.group(1), flags=re.M))}


def test_the_floors_and_the_ray_pin():
    reqs = requirements()
    assert str(reqs["pillow"].specifier) == ">=11.3"
    assert str(reqs["msgpack"].specifier) == ">=1.0"
    ray = reqs["ray"]
    assert ray.extras == {"serve"} and set(map(str, ray.specifier)) == {">=2.60", "<2.61"}
    assert Version("2.60.0") in ray.specifier and Version("2.61.0") not in ray.specifier


def test_the_installed_versions_and_the_cluster_meet_them():
    reqs = requirements()
    for name in ("pillow", "msgpack", "ray"):
        assert reqs[name].specifier.contains(version(name), prereleases=True), (name, version(name))
    dockerfile = (ROOT / "cluster" / "Dockerfile").read_text()
    (base,) = re.findall(r"^ARG BASE=rayproject/ray:([0-9.]+)-", dockerfile, flags=re.M)
    assert base in reqs["ray"].specifier                              # the image the manifests run
    for manifest in (ROOT / "cluster" / "kuberay").glob("*.yaml"):
        (ray_version,) = re.findall(r"^    rayVersion: ([0-9.]+)$", manifest.read_text(), flags=re.M)
        assert ray_version in reqs["ray"].specifier, manifest.name
