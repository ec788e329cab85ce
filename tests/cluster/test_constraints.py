"""The container image's constraints (cluster/constraints.txt, written by python -m cluster.constraints) and the
Dockerfile that installs the package under them as a non-root user."""
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement

from cluster import constraints

ROOT = Path(__file__).resolve().parents[2]


def pins(text: str) -> dict[str, str]:
    lines = [line for line in text.splitlines() if line and not line.startswith("#")]
    assert all(line.count("==") == 1 and " " not in line for line in lines), lines
    return dict(line.split("==") for line in lines)


def test_every_runtime_dependency_is_pinned_within_its_range():
    committed = pins((ROOT / "cluster/constraints.txt").read_text())
    runtime = [Requirement(t) for t in metadata.requires("lingbot-serve")]      # pyproject's, as installed
    for req in (r for r in runtime if r.marker is None):
        text = str(req)
        key = constraints._key(req.name)
        if constraints.accelerator_bound(key):
            assert key not in committed, key                # the image's accelerator build decides
            continue
        assert key in committed, req.name
        assert req.specifier.contains(committed[key], prereleases=True), (text, committed[key])
    assert committed["ray"] == "2.60.0" and "pytest" not in committed and "hypothesis" not in committed


def test_the_command_pins_what_is_installed_here(tmp_path, capsys):
    out = tmp_path / "constraints.txt"
    assert constraints.main(["-o", str(out)]) == 0
    written = pins(out.read_text())
    assert capsys.readouterr().out == f"wrote {out}: {len(written)} packages\n"
    assert {"ray", "av", "pillow", "msgpack", "fastapi", "transformers"} <= set(written)
    assert not {"torch", "numpy", "triton"} & set(written) and "nvidia-ml-py" in written
    assert not any(constraints.accelerator_bound(k) for k in written)


def test_the_image_installs_under_the_constraints_and_runs_as_a_non_root_user():
    lines = [line.strip() for line in (ROOT / "cluster/Dockerfile").read_text().splitlines()
             if line.strip() and not line.startswith("#")]
    assert "RUN pip install --no-cache-dir -c /opt/lingbot-serve/cluster/constraints.txt /opt/lingbot-serve" in lines
    assert lines[-1] == "USER 1000"
