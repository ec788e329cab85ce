"""`make test`'s runner (tests/side_by_side.py): the modules that run Ray in one pytest process, the rest beside it,
each test in exactly one of them, both profiles merged, and a failure on either side the runner's exit status."""
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RAY_MARK = "serve" + "_app"          # what marks a module as one that runs Ray (written so, this module is not one)


def side_by_side(tmp_path, *args, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tests.side_by_side", "-p", "tests.conftest", "-q",
                           "-p", "no:cacheprovider", str(tmp_path), *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, env=env)


def test_each_test_runs_once_on_its_side_and_a_failure_exits_non_zero(tmp_path):
    (tmp_path / "test_served.py").write_text(f"# uses {RAY_MARK}\ndef test_ok_served():\n    pass\n\n\n"
                                             "def test_bad_served():\n    assert False\n")
    (tmp_path / "test_plain.py").write_text("def test_ok_plain():\n    pass\n\n\n"
                                            "def test_bad_plain():\n    assert False\n")
    profile = tmp_path / "profile.json"
    passed = side_by_side(tmp_path, "-k", "ok", env={**os.environ, "LINGBOT_TEST_PROFILE": str(profile)})
    assert passed.returncode == 0, passed.stdout + passed.stderr
    assert "ray exit 0, rest exit 0" in passed.stdout
    assert sorted(name.split("::")[-1] for name in json.loads(profile.read_text())) == ["test_ok_plain",
                                                                                        "test_ok_served"]
    failed = side_by_side(tmp_path)
    assert failed.returncode == 1, failed.stdout + failed.stderr
    assert "ray exit 1, rest exit 1" in failed.stdout
    assert "FAILED" in failed.stdout and "test_bad_served" in failed.stdout and "test_bad_plain" in failed.stdout
    one_side = side_by_side(tmp_path, "-k", "ok or bad_plain")
    assert one_side.returncode == 1 and "ray exit 0, rest exit 1" in one_side.stdout
