#!/usr/bin/env bash
# The device check end to end on CPU (tiny preset) in an environment with only the GPU machine's packages
# (perf/README.md, "On a GPU": torch, numpy, pillow, safetensors, tokenizers, transformers; no ray, av,
# msgpack, diffusers, psutil), so that the one-shot GPU run cannot fail on an import the project's own venv
# hides. Too slow for the suite (it builds a venv); run by hand after changing perf/device_check/ or what it
# imports:
#
#     bash perf/device_check/bare_env.sh [OUT_DIR]
#
# PYTHON (default python3) makes the venv, without the system's site packages; TORCH (default 2.13.0) is the
# torch it installs (the CPU wheel where pip finds one locally). Exits with the check's status, and non-zero
# unless every stage ran ok or is not applicable on CPU.
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHON=${PYTHON:-python3}
TORCH=${TORCH:-2.13.0}
VENV=${VENV:-$(mktemp -d)/venv}
OUT=${1:-$(mktemp -d)}

"$PYTHON" -m venv --clear "$VENV"
"$VENV/bin/python" -m pip install -q "torch==$TORCH"
"$VENV/bin/python" -m pip install -q numpy pillow safetensors tokenizers transformers
"$VENV/bin/python" -m pip list --format=freeze > "$OUT/bare_env_packages.txt"
for absent in ray av msgpack diffusers psutil; do
  if "$VENV/bin/python" -c "import $absent" 2>/dev/null; then
    echo "bare_env: $absent is importable in $VENV; the GPU machine lacks it" >&2
    exit 2
  fi
done
echo "bare_env: $(wc -l < "$OUT/bare_env_packages.txt") packages in $VENV; the check writes to $OUT"
start=$(date +%s)
PYTHONUNBUFFERED=1 "$VENV/bin/python" -m perf.device_check --preset tiny --device cpu --steady 1 \
  --peak-seconds 0.3 --deadline-s 100000 --out "$OUT"
"$VENV/bin/python" - "$OUT/device_check.json" "$(( $(date +%s) - start ))" <<'EOF'
import json
import sys

report = json.load(open(sys.argv[1]))
statuses = {name: r["status"] for name, r in report["stages"].items()}
bad = {name: s for name, s in statuses.items() if s not in ("ok", "not applicable")}
print(f"bare_env: {sys.argv[2]} s; " + ", ".join(f"{n} {s}" for n, s in statuses.items()))
sys.exit(f"bare_env: stages not ok: {bad}" if bad else 0)
EOF
