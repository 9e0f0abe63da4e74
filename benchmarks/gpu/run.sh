#!/usr/bin/env bash
# The GPU check of mixer-plugins, in one command:
#     bash benchmarks/gpu/run.sh OUT_DIR          # on a CUDA machine (about 5-8 minutes on one H100/H200)
#     bash benchmarks/gpu/run.sh OUT_DIR --dry    # anywhere: CPU, Triton interpreter, tiny shapes (CI runs this)
# It installs wheels carried in .whl/ (pydantic and its needs, a mamba-ssm wheel built with
# MAMBA_SKIP_CUDA_BUILD=TRUE) when the machine lacks them, runs the CUDA correctness tests (pytest -m gpu), then the
# throughput tables. Results: OUT_DIR/gpu_tests.xml, OUT_DIR/throughput.json, OUT_DIR/throughput.md, OUT_DIR/log.txt.
set -uo pipefail
OUT="${1:?usage: run.sh OUT_DIR [--dry]}"
DRY="${2:-}"
cd "$(dirname "$0")/../.."
mkdir -p "$OUT"
PY="${PYTHON:-python3}"

if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1 && ! "$PY" -c "import pydantic" 2>/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/mp-site .whl/*.whl \
    && export PYTHONPATH="/tmp/mp-site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1

status=0
if [ "$DRY" = "--dry" ]; then
  export TRITON_INTERPRET=1
  "$PY" benchmarks/gpu/throughput.py --out "$OUT" --dry 2>&1 | tee "$OUT/log.txt" || status=1
else
  timeout 240 "$PY" -m pytest -q -m gpu -p no:cacheprovider tests --junitxml="$OUT/gpu_tests.xml" 2>&1 \
    | tee "$OUT/log.txt" || status=1
  timeout 300 "$PY" benchmarks/gpu/throughput.py --out "$OUT" 2>&1 | tee -a "$OUT/log.txt" || status=1
fi
exit $status
