#!/usr/bin/env bash
# Build the offline wheelhouse benchmarks/gpu_suite.sh installs on a GPU machine that reaches no package registry.
# Run from the repository root, on a machine WITH registry access:
#   bash benchmarks/gpu/make_wheelhouse.sh [DEST]       # writes DEST/.whl and DEST/.whl_opt (DEST default: .)
# .whl: DeepSpeed, built here from its source package with DS_BUILD_OPS=0 (pure Python: its ops are JIT-built on the
#       GPU machine), and the small packages it, pydantic and datasets need that a CUDA torch image may lack;
# .whl_opt: pyarrow (50 MB), which gpu_suite.sh installs only where the machine's is missing or older.
# Versions are this checkout's .venv (what the tests ran against; DS_VERSION overrides DeepSpeed's); binary wheels are
# for CPython $PYVER (default 3.12, the GPU image's) on manylinux x86_64. Fails if .whl is over 64 MiB; .whl,
# .whl_opt and the work tree together must stay under the device's 64 MiB carry.
set -euo pipefail
DEST=${1:-.}
PY=${PY:-.venv/bin/python}
PYVER=${PYVER:-3.12}
ver() { $PY -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$1"; }
WHL=$DEST/.whl
OPT=$DEST/.whl_opt
rm -rf "$WHL" "$OPT"
mkdir -p "$WHL" "$OPT"
# the build runs isolated (no torch in it), so the wheel records no torch/CUDA of this machine
DS_BUILD_OPS=0 $PY -m pip wheel -q --no-deps --no-binary deepspeed -w "$WHL" "deepspeed==${DS_VERSION:-$(ver deepspeed)}"
PINS=()
for p in hjson ninja py-cpuinfo msgpack einops pydantic pydantic-core annotated-types typing-inspection \
         typing-extensions datasets dill multiprocess xxhash; do
  PINS+=("$p==$(ver "$p")")
done
TARGET=(--only-binary=:all: --no-deps --python-version "$PYVER" --implementation cp --abi "cp${PYVER/./}" --abi abi3
        --abi none --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64)
$PY -m pip download -q "${TARGET[@]}" -d "$WHL" "${PINS[@]}"
$PY -m pip download -q "${TARGET[@]}" -d "$OPT" "pyarrow==$(ver pyarrow)"
ls -l "$WHL" "$OPT"
WHL_B=$(du -cb "$WHL"/*.whl | tail -1 | cut -f1)
OPT_B=$(du -cb "$OPT"/*.whl | tail -1 | cut -f1)
echo "wheelhouse: .whl $((WHL_B / 1048576)) MiB, .whl_opt $((OPT_B / 1048576)) MiB, together $(((WHL_B + OPT_B) / 1048576)) MiB"
if [ "$WHL_B" -gt $((64 * 1048576)) ]; then echo ".whl is over 64 MiB"; exit 1; fi
