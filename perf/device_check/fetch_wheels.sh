#!/usr/bin/env bash
# Run here, in the checkout the GPU run will send, right before the run (perf/README.md, "On a GPU"): brings
# into .whl/ what the GPU machine lacks and cannot fetch (it reaches no registry), and the commit the tree
# is at (the copy of the tree it gets has no .git).
#   - nvidia-ml-py, pure Python (~50 KB): torch.cuda.utilization reads NVML through it, as a serving rank's
#     device metrics do; the 580 branch, as that machine's driver (580.159). The GPU command installs it
#     with `pip install --no-index --target /tmp/site .whl/*.whl` and puts /tmp/site on PYTHONPATH.
#   - COMMIT: `git rev-parse HEAD`, with "-modified" when tracked files differ; the command passes it as
#     --commit.
# .whl/ is ignored through git's info/exclude (the wheel is never committed); the run names it in `carry`.
set -euo pipefail
cd "$(dirname "$0")/../.."
NVML_VERSION=${NVML_VERSION:-13.580.126}

exclude=$(git rev-parse --git-path info/exclude)
mkdir -p "$(dirname "$exclude")"
grep -qx '/.whl/' "$exclude" 2>/dev/null || echo '/.whl/' >> "$exclude"
rm -rf .whl
mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d .whl "nvidia-ml-py==$NVML_VERSION"
commit=$(git rev-parse HEAD)
git diff --quiet HEAD -- || commit="$commit-modified"
echo "$commit" > .whl/COMMIT
ls -l .whl
echo "fetch_wheels: .whl/ ready for commit $commit; name .whl in the run's carry"
