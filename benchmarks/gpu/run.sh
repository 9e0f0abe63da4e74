#!/usr/bin/env bash
# The GPU check of mixer-plugins, in one command (under 7 minutes on one H100/H200):
#     bash benchmarks/gpu/run.sh OUT_DIR          # on a CUDA machine
#     bash benchmarks/gpu/run.sh OUT_DIR --dry    # anywhere: CPU, Triton interpreter, tiny shapes (CI runs this)
# Options by environment: MIXER_PLUGINS_GPU_TABLES=scan,attention,window,vit (a subset to measure fewer tables);
# MIXER_PLUGINS_GPU_TUNE=1 adds benchmarks/gpu/tune.py (launch options of the fused scan, and its profile);
# MIXER_PLUGINS_GPU_TEST_S / MIXER_PLUGINS_GPU_TABLES_S: time limits of the tests (170) and the tables (230).
# First it installs the wheels carried in $MIXER_PLUGINS_WHEELS (default .whl/, filled by
# benchmarks/gpu/fetch_wheels.sh: pydantic and its needs, einops, wrapt, a mamba-ssm wheel built with
# MAMBA_SKIP_CUDA_BUILD=TRUE, and mixer-plugins' own wheel for its entry points), offline, each only where the
# machine lacks that distribution, into a site folder put first on PYTHONPATH (the machine's own environment is
# left alone). Then it runs the CUDA correctness tests (pytest -m gpu) and the throughput tables. Results:
# OUT_DIR/install.log, OUT_DIR/gpu_tests.xml, OUT_DIR/log.txt, OUT_DIR/throughput.json, OUT_DIR/throughput.md
# (rewritten after each table). See docs/kernels.md.
set -uo pipefail
OUT="${1:?usage: run.sh OUT_DIR [--dry]}"
DRY="${2:-}"
cd "$(dirname "$0")/../.."
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
PY="${PYTHON:-python3}"
WHEELS="${MIXER_PLUGINS_WHEELS:-.whl}"
SITE="${MIXER_PLUGINS_SITE:-${TMPDIR:-/tmp}/mixer-plugins-site}"

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

: > "$OUT/install.log"
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
TABLES="${MIXER_PLUGINS_GPU_TABLES:-scan,attention,window,vit}"   # which throughput tables (all by default)
if [ "$DRY" = "--dry" ]; then
  export TRITON_INTERPRET=1
  "$PY" benchmarks/gpu/throughput.py --out "$OUT" --dry 2>&1 | tee "$OUT/log.txt" || status=1
  if [ "${MIXER_PLUGINS_GPU_TUNE:-0}" = 1 ]; then
    "$PY" benchmarks/gpu/tune.py --out "$OUT" --dry 2>&1 | tee -a "$OUT/log.txt" || status=1
  fi
else
  # budgets: install ~15 s + tests 170 s + tables 230 s < 7 minutes
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv 2>&1 | tee "$OUT/log.txt"
  # SIGINT at the limit: pytest stops, prints its summary and still writes the XML; one line per test in the log.
  # tests/test_gpu.py holds every gpu-marked test (collecting the whole suite would import what this machine lacks)
  timeout -s INT -k 15 "${MIXER_PLUGINS_GPU_TEST_S:-170}" "$PY" -m pytest -v -m gpu -p no:cacheprovider --durations=15 tests/test_gpu.py \
    --junitxml="$OUT/gpu_tests.xml" 2>&1 | tee -a "$OUT/log.txt" || status=1
  limit="${MIXER_PLUGINS_GPU_TABLES_S:-230}"
  timeout "$limit" "$PY" benchmarks/gpu/throughput.py --out "$OUT" --budget-s $((limit - 40)) --tables "$TABLES" 2>&1 \
    | tee -a "$OUT/log.txt" || status=1
  if [ "${MIXER_PLUGINS_GPU_TUNE:-0}" = 1 ]; then  # launch options of the fused scan and its profile (~90 s)
    timeout 120 "$PY" benchmarks/gpu/tune.py --out "$OUT" 2>&1 | tee -a "$OUT/log.txt" || status=1
  fi
fi
exit $status
