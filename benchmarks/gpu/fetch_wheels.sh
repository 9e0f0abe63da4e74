#!/usr/bin/env bash
# Fills DIR with the wheels benchmarks/gpu/run.sh installs offline on the GPU machine (Python 3.12, x86_64, no
# network; it lacks pydantic and mamba-ssm):
#   * pydantic, pydantic-core, typing-extensions, annotated-types, typing-inspection, einops and wrapt, cp312
#     manylinux x86_64 (pure-Python ones as py3-none-any), at the versions installed here when they are (what CI
#     tests), else the newest;
#   * the mamba-ssm wheel built without its CUDA extensions (MAMBA_SKIP_CUDA_BUILD=TRUE: pure Python, py3-none-any),
#     copied from $MAMBA_WHEEL_DIR (default /work/wheels), or built here when there is none;
#   * mixer-plugins' own wheel, pure Python (MIXER_PLUGINS_NATIVE=0: without the native CPU kernels, which would be
#     compiled for this Python and CPU): run.sh imports the checkout itself, but the built-in mixers are found through
#     the entry points of installed metadata, which the wheel provides (build it again after changing them).
# Usage, from the repository root (DIR is usually .whl, which git ignores and the device tool carries):
#     PYTHON=/path/to/venv/bin/python bash benchmarks/gpu/fetch_wheels.sh .whl
set -euo pipefail
DIR="${1:?usage: fetch_wheels.sh DIR}"
PY="${PYTHON:-python3}"
mkdir -p "$DIR"
PLATFORMS=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
           --platform manylinux2014_x86_64 --platform manylinux1_x86_64)

pinned() {  # NAME==VERSION when NAME is installed here, else NAME
  local version
  version="$("$PY" -c 'import importlib.metadata as m, sys; print(m.version(sys.argv[1]))' "$1" 2>/dev/null)" \
    && echo "$1==$version" || echo "$1"
}

for name in pydantic pydantic-core typing-extensions annotated-types typing-inspection einops wrapt; do
  "$PY" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --abi cp312 --abi abi3 --abi none "${PLATFORMS[@]}" -d "$DIR" "$(pinned "$name")"
done

MAMBA_WHEEL_DIR="${MAMBA_WHEEL_DIR:-/work/wheels}"
if ! ls "$MAMBA_WHEEL_DIR"/mamba_ssm-*-py3-none-any.whl >/dev/null 2>&1; then
  echo "building the mamba-ssm wheel without CUDA extensions into $MAMBA_WHEEL_DIR (needs torch, wheel, packaging)"
  mkdir -p "$MAMBA_WHEEL_DIR"
  (cd "${TMPDIR:-/tmp}" && MAMBA_SKIP_CUDA_BUILD=TRUE MAMBA_FORCE_BUILD=TRUE "$PY" -m pip wheel -q \
     --no-build-isolation --no-deps mamba-ssm -w "$MAMBA_WHEEL_DIR")
fi
newest="$(ls -t "$MAMBA_WHEEL_DIR"/mamba_ssm-*-py3-none-any.whl | head -n 1)"
rm -f "$DIR"/mamba_ssm-*.whl
cp "$newest" "$DIR/"

rm -f "$DIR"/mixer_plugins-*.whl
MIXER_PLUGINS_NATIVE=0 "$PY" -m pip wheel -q --disable-pip-version-check --no-deps -w "$DIR" .

# one version of each distribution (two would stop the install), and what came
dups="$(ls "$DIR"/*.whl | xargs -n 1 basename | cut -d- -f1 | tr 'A-Z-' 'a-z_' | sort | uniq -d)"
if [ -n "$dups" ]; then
  echo "ERROR: several wheels of: $dups (remove the older ones from $DIR)" >&2
  exit 1
fi
ls -l "$DIR"/*.whl
du -ch "$DIR"/*.whl | tail -n 1
