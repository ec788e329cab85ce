"""The whole suite as two pytest processes side by side: `make test` runs `python -m tests.side_by_side`.

The modules that run Ray (the served tests, the local clusters, `make serve`'s command) spend much of their time
waiting for real time (paced sessions, timeouts, group starts) and run one after another in one process, in file
order (`pytest --ray only`: fixed ports, one package app, each module's fixtures made once). The other modules
(the engine, the parallel collectives, the session layer without Ray, perf's checks) run beside them in a second
process (`--ray none`) with one torch thread, on the cores the first leaves idle. Tests marked `quiet` (a stall
bound measured on a served session) run last in theirs and first wait until the other process has ended. The
first streams to the terminal; the second's output follows it. Exit status: 0 when both passed, else the first non-zero.

Arguments go to both (`python -m tests.side_by_side -x -k spectators`). `LINGBOT_TEST_PROFILE=path.json` gets
both processes' tests (README.md, "Two commands")."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

NO_TESTS = 5              # pytest's status when a selection is empty (-k matched nothing on one side)
QUIET_AFTER_ENV = "LINGBOT_QUIET_AFTER_PID"   # (tests/conftest.py's quiet_machine)


def main(argv: list[str]) -> int:
    profile = os.environ.get("LINGBOT_TEST_PROFILE")
    parts = {}
    started = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp, open(os.path.join(tmp, "rest.log"), "w+") as rest_log:
        def run(which: str, threads: str, **io) -> subprocess.Popen:
            env = dict(os.environ, LINGBOT_TEST_THREADS=threads, **extra)
            if profile:
                parts[which] = env["LINGBOT_TEST_PROFILE"] = os.path.join(tmp, f"{which}.json")
            return subprocess.Popen([sys.executable, "-m", "pytest", "--ray", which, *argv], env=env, **io)
        extra: dict = {}
        rest = run("none", "1", stdout=rest_log, stderr=subprocess.STDOUT)
        extra[QUIET_AFTER_ENV] = str(rest.pid)       # the quiet tests (run last) wait for it to end
        ray = run("only", "2")
        codes = {"ray": ray.wait(), "rest": rest.wait()}
        rest_log.seek(0)
        print("\n==== the modules without Ray (run beside the above) ====", flush=True)
        sys.stdout.write(rest_log.read())
        if profile:
            merged: dict = {}
            for path in parts.values():
                if os.path.exists(path):
                    with open(path) as f:
                        merged.update(json.load(f))
            with open(profile, "w") as f:
                json.dump(merged, f, indent=1)
    failed = {name: code for name, code in codes.items() if code not in (0, NO_TESTS)}
    print(f"==== side by side: {time.monotonic() - started:.0f} s of pytest; "
          + ", ".join(f"{name} exit {code}" for name, code in codes.items()), flush=True)
    if failed:
        return next(iter(failed.values()))
    return NO_TESTS if set(codes.values()) == {NO_TESTS} else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
