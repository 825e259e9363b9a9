#!/usr/bin/env bash
# The GPU check of expertcache.hf (issue 8): runs the project from src with this machine's
# python3, installs nothing, prints every figure with PASS/FAIL, exits non-zero on any FAIL.
#   bash benchmarks/gpu_check.sh [--json OUT.json] [any option of benchmarks/gpu_check.py]
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
PY="${PYTHON:-python3}"
export PYTHONPATH="$here/src${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
exec timeout 480 "$PY" "$here/benchmarks/gpu_check.py" "$@"
