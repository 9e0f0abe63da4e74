#!/usr/bin/env bash
# The GPU check of mixer-plugins, in one command (a cold run, compiles and autotuning included, in 8 minutes on one
# H100/H200):
#     bash benchmarks/gpu/run.sh OUT_DIR          # on a CUDA machine
#     bash benchmarks/gpu/run.sh OUT_DIR --dry    # anywhere: CPU, Triton interpreter, tiny shapes (CI runs this)
# Steps, each under its own time limit (seconds, by environment variable), each writing its results as it goes (a
# limit keeps what was measured):
#   1. install: the wheels carried in $MIXER_PLUGINS_WHEELS (default .whl/, filled by benchmarks/gpu/fetch_wheels.sh:
#      pydantic and its needs, einops, wrapt, a mamba-ssm wheel built with MAMBA_SKIP_CUDA_BUILD=TRUE, mixer-plugins'
#      own wheel for its entry points), offline, each only where the machine lacks that distribution, into a site
#      folder put first on PYTHONPATH (the machine's own environment is left alone);
#   2. kernel correctness (MIXER_PLUGINS_GPU_KERNEL_TESTS_S, 150): tests/ops/test_gpu.py's kernel tests, then the Triton
#      scan, norm and conv tests on CUDA (tests/ops/test_scan_triton.py, tests/ops/test_norm_conv_triton.py);
#   3. tables (MIXER_PLUGINS_GPU_TABLES_S, 185): benchmarks/gpu/throughput.py (ViT-B step, launches and per-part
#      profile of a Hydra block, scans; MIXER_PLUGINS_GPU_TABLES picks and orders them), then
#      benchmarks/gpu/mlr_rows.py where it exists (MIXER_PLUGINS_GPU_MLR_S, 45) and benchmarks/gpu/normconv_rows.py
#      (MIXER_PLUGINS_GPU_NORMCONV_S, 25);
#   4. every registered mixer on CUDA against float64 on the CPU (MIXER_PLUGINS_GPU_MIXER_TESTS_S, 60);
#   MIXER_PLUGINS_GPU_TUNE=1 adds benchmarks/gpu/tune.py (launch options of the fused scan, and its profile).
# Results, under OUT_DIR (for benchmarks/gpu/results/<date>-<gpu>/): install.log, log.txt, kernel_tests.xml,
# mixer_tests.xml, throughput.json/.md, mlr_rows.json/.md, normconv_rows.json/.md (and tune.json/.md).
# See docs/kernels.md.
set -uo pipefail
OUT="${1:?usage: run.sh OUT_DIR [--dry]}"
DRY="${2:-}"
cd "$(dirname "$0")/../.."
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
PY="${PYTHON:-python3}"
WHEELS="${MIXER_PLUGINS_WHEELS:-.whl}"
SITE="${MIXER_PLUGINS_SITE:-${TMPDIR:-/tmp}/mixer-plugins-site}"
START=$SECONDS

install_wheels() {
  # the carried wheels whose distribution the machine lacks, or has at an older version, installed offline
  local missing=() whl
  while IFS= read -r whl; do missing+=("$whl"); done < <("$PY" - "$WHEELS" <<'PYEOF'
import importlib.metadata as metadata
import pathlib
import sys

def key(text):
    try:
        from packaging.version import Version
        return Version(text)
    except Exception:  # no packaging, or an odd version: compare as text
        return text

for wheel in sorted(pathlib.Path(sys.argv[1]).glob("*.whl")):
    name, version = wheel.name.split("-")[:2]
    try:
        have = metadata.version(name)
    except metadata.PackageNotFoundError:
        have = None
    if have is None or key(have) < key(version):
        print(wheel)
PYEOF
)
  echo "wheels in $WHEELS: $(ls "$WHEELS"/*.whl 2>/dev/null | wc -l); to install: ${#missing[@]}"
  [ "${#missing[@]}" -gt 0 ] || return 0
  printf '  %s\n' "${missing[@]}"
  export PIP_ROOT_USER_ACTION=ignore
  local pip=("$PY" -m pip install -q --no-index --find-links "$WHEELS" --no-deps --no-compile --no-cache-dir
             --disable-pip-version-check)
  if mkdir -p "$SITE" && "${pip[@]}" --upgrade --target "$SITE" "${missing[@]}"; then
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
    echo "installed into $SITE (first on PYTHONPATH)"
  elif "${pip[@]}" --user "${missing[@]}"; then
    echo "installed into the user site"
  else
    echo "WARNING: the carried wheels could not be installed; what needs them will fail and say so"
  fi
}

step() {  # step NAME: a line in the log with the seconds spent so far
  echo "== $1 ($((SECONDS - START)) s)" | tee -a "$OUT/log.txt"
}

: > "$OUT/install.log"
: > "$OUT/log.txt"
if [ -d "$WHEELS" ]; then
  install_wheels > "$OUT/install.log" 2>&1   # not in a pipeline: its PYTHONPATH must reach this shell
  cat "$OUT/install.log"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
"$PY" - <<'EOF' 2>&1 | tee -a "$OUT/install.log"
import importlib.metadata as m
for name in ("torch", "triton", "pydantic", "pydantic-core", "einops", "mamba-ssm", "timm"):
    try:
        print(f"{name} {m.version(name)}")
    except m.PackageNotFoundError:
        print(f"{name} MISSING")
EOF

status=0
TABLES="${MIXER_PLUGINS_GPU_TABLES:-vit,launches,parts,scan}"
# SIGINT at a limit: pytest stops, prints its summary and still writes its XML; the table scripts write every row
PYTEST=("$PY" -m pytest -p no:cacheprovider -q -rfE --durations=10)
if [ "$DRY" = "--dry" ]; then
  # the same steps on the CPU with tiny shapes: the GPU tests skip themselves, the tables run under the interpreter
  export TRITON_INTERPRET=1
  step "kernel tests (skipped without CUDA)"
  "${PYTEST[@]}" -m gpu tests/ops/test_gpu.py --junitxml="$OUT/kernel_tests.xml" 2>&1 | tail -n 3 | tee -a "$OUT/log.txt" \
    || status=1
  step "tables"
  "$PY" benchmarks/gpu/throughput.py --out "$OUT" --dry --tables "$TABLES" > "$OUT/throughput.log" 2>&1 || status=1
  tail -n 20 "$OUT/throughput.log" | tee -a "$OUT/log.txt"
  if [ -f benchmarks/gpu/mlr_rows.py ]; then
    "$PY" benchmarks/gpu/mlr_rows.py --out "$OUT" --smoke > "$OUT/mlr_rows.log" 2>&1 || status=1
  fi
  "$PY" benchmarks/gpu/normconv_rows.py --dry --json "$OUT/normconv_rows.json" > "$OUT/normconv_rows.md" 2>&1 \
    || status=1
  if [ "${MIXER_PLUGINS_GPU_TUNE:-0}" = 1 ]; then
    "$PY" benchmarks/gpu/tune.py --out "$OUT" --dry >> "$OUT/log.txt" 2>&1 || status=1
  fi
else
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv 2>&1 | tee -a "$OUT/log.txt"
  step "kernel tests"
  timeout -s INT -k 15 "${MIXER_PLUGINS_GPU_KERNEL_TESTS_S:-150}" "${PYTEST[@]}" -m "gpu or triton" \
    tests/ops/test_gpu.py -k "not test_mixer_on_cuda_matches_cpu_float64" tests/ops/test_scan_triton.py \
    tests/ops/test_norm_conv_triton.py --junitxml="$OUT/kernel_tests.xml" 2>&1 | tee -a "$OUT/log.txt" || status=1
  step "throughput tables"
  limit="${MIXER_PLUGINS_GPU_TABLES_S:-185}"
  timeout -s INT -k 10 "$limit" "$PY" benchmarks/gpu/throughput.py --out "$OUT" --budget-s $((limit - 25)) \
    --tables "$TABLES" > "$OUT/throughput.log" 2>&1 || status=1
  tail -n 80 "$OUT/throughput.log" | tee -a "$OUT/log.txt"
  if [ -f benchmarks/gpu/mlr_rows.py ]; then
    step "MLR rows"
    timeout -s INT -k 10 "${MIXER_PLUGINS_GPU_MLR_S:-45}" "$PY" benchmarks/gpu/mlr_rows.py --out "$OUT" \
      > "$OUT/mlr_rows.log" 2>&1 || status=1
  fi
  step "norm and conv rows"
  timeout -s INT -k 10 "${MIXER_PLUGINS_GPU_NORMCONV_S:-25}" "$PY" benchmarks/gpu/normconv_rows.py \
    --json "$OUT/normconv_rows.json" > "$OUT/normconv_rows.md" 2>&1 || status=1
  if [ "${MIXER_PLUGINS_GPU_TUNE:-0}" = 1 ]; then  # launch options of the fused scan and its profile (~90 s)
    step "tune"
    timeout 120 "$PY" benchmarks/gpu/tune.py --out "$OUT" >> "$OUT/log.txt" 2>&1 || status=1
  fi
  step "mixer tests"
  timeout -s INT -k 15 "${MIXER_PLUGINS_GPU_MIXER_TESTS_S:-60}" "${PYTEST[@]}" -m gpu tests/ops/test_gpu.py \
    -k "test_mixer_on_cuda_matches_cpu_float64" --junitxml="$OUT/mixer_tests.xml" 2>&1 | tail -n 30 \
    | tee -a "$OUT/log.txt" || status=1
fi
step "done (status $status)"
exit $status
