"""`make test`'s pytest: the suite as two pytest runs side by side, one per core.

The tests that start a Ray cluster (the served apps of tests/deployments, the local and multi-node clusters of
tests/cluster) share fixed loopback ports and Ray's record of the current cluster, so they run in one pytest, in
order; everything else runs in a second pytest next to it. The first's output streams live; the second's is
printed, whole, when it ends. The exit status is the first non-zero of the two (0 when both pass), so a failure
in either fails the command.

    python -m tests.suite [pytest options ...]      # e.g. -x, or -k name; applied to both runs
"""
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# the files of tests that start a Ray cluster (relative to the repository's root)
RAY_CLUSTER_TESTS = ["tests/cluster", *sorted(p.relative_to(ROOT).as_posix()
                                              for p in (ROOT / "tests/deployments").glob("test_*.py"))]


def commands(extra: list[str]) -> tuple[list[str], list[str]]:
    """The pytest command line of the Ray run and of the other one."""
    base = [sys.executable, "-m", "pytest", "-q", "--durations=40", *extra]
    ray = [*base, "--basetemp", str(Path(tempfile.gettempdir()) / "lingbot-tests-ray"), *RAY_CLUSTER_TESTS]
    rest = [*base, "--basetemp", str(Path(tempfile.gettempdir()) / "lingbot-tests-rest"),
            *(f"--ignore={path}" for path in RAY_CLUSTER_TESTS), "tests"]
    return ray, rest


def main(argv: list[str]) -> int:
    ray_cmd, rest_cmd = commands(argv)
    with tempfile.TemporaryFile("w+") as rest_out:
        rest = subprocess.Popen(rest_cmd, cwd=ROOT, stdout=rest_out, stderr=subprocess.STDOUT, text=True)
        done = threading.Event()

        def say_when_done():
            rest.wait()
            done.set()
            print(f"\n[tests.suite] the tests without Ray finished (exit {rest.returncode}); their output follows "
                  "the Ray tests'\n", flush=True)
        threading.Thread(target=say_when_done, daemon=True).start()
        print("[tests.suite] tests that start a Ray cluster, in order:", " ".join(RAY_CLUSTER_TESTS), flush=True)
        ray_code = subprocess.call(ray_cmd, cwd=ROOT)
        rest_code = rest.wait()
        done.wait(5)
        rest_out.seek(0)
        print("\n[tests.suite] the tests without Ray:", flush=True)
        sys.stdout.write(rest_out.read())
    print(f"\n[tests.suite] Ray tests: exit {ray_code}; the other tests: exit {rest_code}", flush=True)
    return ray_code or rest_code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
