#!/usr/bin/env bash
# The GPU check of mixer-plugins in one command, the targets first (at most 8 minutes on one H100/H200 with the
# default limits, cold caches included):
#     bash benchmarks/gpu/run.sh OUT_DIR          # on a CUDA machine
#     bash benchmarks/gpu/run.sh OUT_DIR --dry    # anywhere: CPU, Triton interpreter, tiny shapes (CI runs this)
# Steps, in priority order, each under its own limit (seconds: environment variable, default). A step's script gets a
# deadline a few seconds before its limit (MIXER_PLUGINS_GPU_DEADLINE_AT), checks it inside its timing loops and
# between rows, and writes its results after every row; at the limit `timeout` interrupts it (SIGINT), so a slow row
# never takes a later step's time and a cut step keeps what it measured. MIXER_PLUGINS_GPU_TOTAL_S (480) caps the
# whole run: a step gets at most what is left of it, and none starts with less than 10 s.
#   install         MIXER_PLUGINS_GPU_INSTALL_S   25  the carried wheels ($MIXER_PLUGINS_WHEELS, default .whl/, from
#                                                     benchmarks/gpu/fetch_wheels.sh) the machine lacks, offline, into a
#                                                     site folder put first on PYTHONPATH (install.log)
#   import          MIXER_PLUGINS_GPU_IMPORT_S    25  benchmarks/gpu/import_check.py: versions, the GPU, import
#                                                     mixer_plugins, the mixers and vit_base build; on failure one
#                                                     line says which wheel is missing and nothing else runs
#   qs16k           MIXER_PLUGINS_GPU_QS16K_S     60  throughput.py: fused quasiseparable fwd+bwd at 16k, time and peak
#                                                     memory, then SDPA (qs16k.json)
#   vit             MIXER_PLUGINS_GPU_VIT_S       75  throughput.py: ViT-B/16 train step, eager: timm's attention, our
#                                                     vit_base with attention, with quasi (vit.json)
#   launches        MIXER_PLUGINS_GPU_LAUNCHES_S  60  throughput.py: launches per Hydra mixer fwd+bwd, float32 and bf16
#                                                     autocast, one chunk and chunked (launches.json)
#   mlr             MIXER_PLUGINS_GPU_MLR_S       60  mlr_rows.py: MLR and sliding-window attention vs SDPA at 16k,
#                                                     then 4k, with verdicts; then the kernels' checks (mlr_rows.json)
#   scan_tests      MIXER_PLUGINS_GPU_SCAN_TESTS_S 25 the Triton scan at a ViT block and at 1000 tokens vs float64
#   normconv_tests  MIXER_PLUGINS_GPU_NORMCONV_TESTS_S 20  the norm and conv kernels vs float64
#   vit_compiled    MIXER_PLUGINS_GPU_VIT_COMPILED_S 75  throughput.py: the quasi ViT-B/16 step under torch.compile
#   mamba           MIXER_PLUGINS_GPU_MAMBA_S     40  throughput.py: mamba-ssm at 16k, one pinned config per kernel
#   extras          MIXER_PLUGINS_GPU_EXTRAS_S   120  only with MIXER_PLUGINS_GPU_EXTRAS=parts,scan,attention,window,
#                                                     normconv,tune (any of them; MIXER_PLUGINS_GPU_TUNE=1 adds tune)
#   gpu_tests       MIXER_PLUGINS_GPU_TESTS_S   rest  the GPU test files, the tests not run above (gpu_tests.xml);
#                                                     by default what is left of the run's time
#   summary                                           summary.py: one verdict row per target (targets.py), in
#                                                     summary.md and summary.json, printed; rewritten after every step
# Results, under OUT_DIR (for benchmarks/gpu/results/<date>-<gpu>/): log.txt (a line per step with the seconds so
# far), steps.tsv, install.log, environment.json, STEP.log, STEP.json/.md, *_tests.xml, summary.md/.json.
# See docs/kernels.md, "The GPU check".
set -uo pipefail
OUT="${1:?usage: run.sh OUT_DIR [--dry]}"
DRY="${2:-}"
cd "$(dirname "$0")/../.."
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
PY="${PYTHON:-python3}"
WHEELS="${MIXER_PLUGINS_WHEELS:-.whl}"
SITE="${MIXER_PLUGINS_SITE:-${TMPDIR:-/tmp}/mixer-plugins-site}"
TOTAL="${MIXER_PLUGINS_GPU_TOTAL_S:-480}"
START=$SECONDS
GPU=benchmarks/gpu
DRYARG=()
COLLECT=()
if [ "$DRY" = "--dry" ]; then
  DRYARG=(--dry)
  COLLECT=(--collect-only)    # the last step's test files are only collected (their CPU checks take minutes)
  export TRITON_INTERPRET=1   # the same steps on the CPU: the tables run under the interpreter, GPU tests skip
fi
export PYTHONUNBUFFERED=1

install_wheels() {  # install_wheels LIMIT: the carried wheels whose distribution the machine lacks or has older
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
  local pip=(timeout "$1" "$PY" -m pip install -q --no-index --find-links "$WHEELS" --no-deps --no-compile
             --no-cache-dir --disable-pip-version-check)
  if mkdir -p "$SITE" && "${pip[@]}" --upgrade --target "$SITE" "${missing[@]}"; then
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
    echo "installed into $SITE (first on PYTHONPATH)"
  elif "${pip[@]}" --user "${missing[@]}"; then
    echo "installed into the user site"
  else
    echo "WARNING: the carried wheels could not be installed; the import check says what is missing"
    return 1
  fi
}

record() {  # record NAME STATUS SECONDS LIMIT: a row of steps.tsv, then the summary rewritten
  printf '%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$4" >> "$OUT/steps.tsv"
  [ "$2" = done ] || echo "   $1: $2" | tee -a "$OUT/log.txt"
  "$PY" "$GPU/summary.py" --out "$OUT" --quiet 2>> "$OUT/summary.log" || true
}

left_s() {  # what is left of the run's time, less 10 s for a step's kill and the summary
  echo $((TOTAL - (SECONDS - START) - 10))
}

limit_of() {  # limit_of DEFAULT: the step's limit, at most what is left of the run's
  local left
  left="$(left_s)"
  if [ "$1" -lt "$left" ]; then echo "$1"; else echo "$left"; fi
}

IMPORT_OK=1
status=0
run_step() {  # run_step NAME LIMIT TAIL COMMAND...: COMMAND under the limit, output in OUT/NAME.log (TAIL lines shown)
  local name="$1" limit tail="$3" rc t0 state
  limit="$(limit_of "$2")"
  shift 3
  if [ "$IMPORT_OK" != 1 ]; then record "$name" "not run: the import check failed" 0 "$limit"; status=1; return; fi
  if [ "$(left_s)" -lt 10 ]; then
    record "$name" "not run: the run's time (MIXER_PLUGINS_GPU_TOTAL_S=$TOTAL) was spent" 0 "$limit"
    status=1
    return
  fi
  echo "== $name ($((SECONDS - START)) s, limit $limit s)" | tee -a "$OUT/log.txt"
  local margin=$((limit >= 40 ? 8 : limit / 5))
  t0=$SECONDS
  MIXER_PLUGINS_GPU_DEADLINE_AT=$(($(date +%s) + limit - margin)) timeout -s INT -k 10 "$limit" "$@" \
    > "$OUT/$name.log" 2>&1
  rc=$?
  tail -n "$tail" "$OUT/$name.log" | tee -a "$OUT/log.txt"
  case $rc in
    0) state=done ;;
    4) state="stopped at its deadline: rows left not measured" ;;   # deadline.EXIT_CUT
    124|130|137) state="cut at its limit ($limit s)" ;;
    *) state="failed (exit $rc)" ;;
  esac
  [ "$rc" = 0 ] || status=1
  record "$name" "$state" $((SECONDS - t0)) "$limit"
}

# pytest under the step's SIGINT (stops, prints its summary, writes its XML) even where SIGINT came in ignored
PYTEST=("$PY" -c 'import signal, sys, pytest; signal.signal(signal.SIGINT, signal.default_int_handler);
sys.exit(pytest.main(sys.argv[1:]))' -p no:cacheprovider -q -rfE --durations=5)
[ "$DRY" = "--dry" ] || export MIXER_PLUGINS_TEST_THREADS="${MIXER_PLUGINS_TEST_THREADS:-8}"
SCAN_TESTS=(tests/ops/test_gpu.py::test_triton_scan_at_a_vit_block_and_past_one_chunk_matches_reference)
NORMCONV_TESTS=(tests/ops/test_gpu.py::test_norm_and_conv_backends_on_cuda_match_reference)
TEST_FILES=(tests/ops/test_gpu.py tests/ops/test_scan_triton.py tests/ops/test_scan_numerics_triton.py
            tests/ops/test_mlr_attention_triton_kernels.py tests/ops/test_norm_conv_triton.py)
CACHE="${TRITON_CACHE_DIR:-$HOME/.triton/cache}"
cubins() { find "$CACHE" -name '*.cubin' 2>/dev/null | wc -l; }

: > "$OUT/log.txt"
: > "$OUT/steps.tsv"
: > "$OUT/install.log"
rm -f "$OUT"/summary.* "$OUT"/environment.json
echo "GPU check ${DRY:-(GPU)} in $OUT; the whole run at most $TOTAL s" | tee -a "$OUT/log.txt"
CUBINS_BEFORE="$(cubins)"

# 1. install (not under run_step: its PYTHONPATH must reach this shell)
limit="$(limit_of "${MIXER_PLUGINS_GPU_INSTALL_S:-25}")"
echo "== install ($((SECONDS - START)) s, limit $limit s)" | tee -a "$OUT/log.txt"
t0=$SECONDS
if [ -d "$WHEELS" ]; then
  install_wheels "$limit" > "$OUT/install.log" 2>&1; rc=$?
  tail -n 15 "$OUT/install.log" | tee -a "$OUT/log.txt"
else
  rc=0
  echo "no $WHEELS/: nothing to install" | tee -a "$OUT/log.txt"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
record install "$([ "$rc" = 0 ] && echo done || echo "failed (exit $rc)")" $((SECONDS - t0)) "$limit"

# 2. import check: fail fast
[ "$DRY" = "--dry" ] || nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv 2>&1 \
  | tee -a "$OUT/log.txt"
run_step import "${MIXER_PLUGINS_GPU_IMPORT_S:-25}" 3 "$PY" "$GPU/import_check.py" --out "$OUT" --wheels "$WHEELS" \
  "${DRYARG[@]}"
if ! grep -q "^import check:" "$OUT/import.log" 2>/dev/null; then
  IMPORT_OK=0
  echo "IMPORT CHECK FAILED: nothing else runs ($(grep -h "IMPORT CHECK FAILED" "$OUT/import.log" 2>/dev/null \
    | sed 's/^IMPORT CHECK FAILED: //' || echo "see import.log"))" | tee -a "$OUT/log.txt"
fi

# 3-10. the targets first, then the correctness checks, the compiled ViT, mamba-ssm
TABLES=("$PY" "$GPU/throughput.py" --out "$OUT" "${DRYARG[@]}")
run_step qs16k "${MIXER_PLUGINS_GPU_QS16K_S:-60}" 12 "${TABLES[@]}" --name qs16k --tables qs16k
run_step vit "${MIXER_PLUGINS_GPU_VIT_S:-75}" 12 "${TABLES[@]}" --name vit --tables vit
run_step launches "${MIXER_PLUGINS_GPU_LAUNCHES_S:-60}" 12 "${TABLES[@]}" --name launches --tables launches
run_step mlr "${MIXER_PLUGINS_GPU_MLR_S:-60}" 20 "$PY" "$GPU/mlr_rows.py" --out "$OUT" "${DRYARG[@]}"
run_step scan_tests "${MIXER_PLUGINS_GPU_SCAN_TESTS_S:-25}" 6 "${PYTEST[@]}" -m gpu "${SCAN_TESTS[@]}" \
  --junitxml="$OUT/scan_tests.xml"
run_step normconv_tests "${MIXER_PLUGINS_GPU_NORMCONV_TESTS_S:-20}" 6 "${PYTEST[@]}" -m gpu "${NORMCONV_TESTS[@]}" \
  --junitxml="$OUT/normconv_tests.xml"
run_step vit_compiled "${MIXER_PLUGINS_GPU_VIT_COMPILED_S:-75}" 8 "${TABLES[@]}" --name vit_compiled \
  --tables vit_compiled
run_step mamba "${MIXER_PLUGINS_GPU_MAMBA_S:-40}" 8 "${TABLES[@]}" --name mamba --tables mamba

# extras, only when asked
EXTRAS="${MIXER_PLUGINS_GPU_EXTRAS:-}"
[ "${MIXER_PLUGINS_GPU_TUNE:-0}" = 1 ] && EXTRAS="${EXTRAS:+$EXTRAS,}tune"
extra_tables="$(echo "$EXTRAS" | tr ',' '\n' | grep -E '^(parts|scan|attention|window)$' | paste -sd, -)"
if [ -n "$extra_tables" ]; then
  run_step extras "${MIXER_PLUGINS_GPU_EXTRAS_S:-120}" 12 "${TABLES[@]}" --name extras --tables "$extra_tables"
fi
if [[ ",$EXTRAS," == *,normconv,* ]]; then
  run_step normconv_rows 60 30 "$PY" "$GPU/normconv_rows.py" "${DRYARG[@]}" --json "$OUT/normconv_rows.json"
fi
if [[ ",$EXTRAS," == *,tune,* ]]; then
  run_step tune 120 30 "$PY" "$GPU/tune.py" --out "$OUT" "${DRYARG[@]}"
fi

# 11. the GPU test files, the rest of them, last
run_step gpu_tests "${MIXER_PLUGINS_GPU_TESTS_S:-$TOTAL}" 12 "${PYTEST[@]}" -m "gpu or triton" "${TEST_FILES[@]}" \
  --deselect "${SCAN_TESTS[0]}" --deselect "${NORMCONV_TESTS[0]}" --junitxml="$OUT/gpu_tests.xml" "${COLLECT[@]}"

# 12. the summary
CUBINS_AFTER="$(cubins)"
echo "Triton kernels compiled by this run: $((CUBINS_AFTER - CUBINS_BEFORE)) (cubins in $CACHE:" \
  "$CUBINS_BEFORE before, $CUBINS_AFTER after)" | tee -a "$OUT/log.txt" "$OUT/triton_cache.txt"
echo "== summary ($((SECONDS - START)) s)" | tee -a "$OUT/log.txt"
"$PY" "$GPU/summary.py" --out "$OUT" --quiet 2>> "$OUT/summary.log" || status=1
cat "$OUT/summary.md" 2>/dev/null | tee -a "$OUT/log.txt" || echo "no summary: see $OUT/summary.log"
echo "== done (status $status) ($((SECONDS - START)) s)" | tee -a "$OUT/log.txt"
exit $status
