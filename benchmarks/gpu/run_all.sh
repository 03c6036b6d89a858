#!/usr/bin/env bash
# The device call: install the carried wheels (.whl: deepspeed built with DS_BUILD_OPS=0, hjson, pydantic, datasets, ...),
# check the imports, then benchmarks/gpu/drive.py. Everything it measures lands in $OUT (at most 8 files):
#   log.txt  gpu_results.json  gpu_summary.md  runs_log.txt  jit_log.txt
# Usage (from the repository root, on the GPU machine): bash benchmarks/gpu/run_all.sh [DEADLINE_S] [extra drive.py args]
set -o pipefail
DEADLINE=${1:-480}
shift || true
OUT=${OUT:-/tmp/ztgpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
{
  echo "== $(date -u +%FT%TZ) $(hostname) $(nproc) cpus"
  nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used,temperature.gpu,clocks.sm --format=csv 2>&1
  PY=$(command -v python3)
  if [ -z "$SKIP_WHEELS" ] && ls .whl/*.whl >/dev/null 2>&1; then
    # datasets 5.2 wants pyarrow >= 24: the carried pyarrow (.whl_opt) only where the machine's is older
    PA=$($PY -c "import pyarrow; print(pyarrow.__version__.split('.')[0])" 2>/dev/null || echo 0)
    EXTRA=""
    if [ "$PA" -lt 24 ] && ls .whl_opt/pyarrow-*.whl >/dev/null 2>&1; then EXTRA=$(ls .whl_opt/pyarrow-*.whl); fi
    echo "machine pyarrow major: $PA; extra wheels: ${EXTRA:-none}"
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl $EXTRA \
      || { echo "wheel install failed"; exit 3; }
    export PYTHONPATH=/tmp/site
  fi
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
  # DeepSpeed 0.19.8's JIT builder parses TORCH_CUDA_ARCH_LIST entries as numbers and fails on arch suffixes
  # ("9.0a": ValueError: invalid literal for int() with base 10: '0a', seen on the H100 image on 2026-11-26, where
  # fused_adam then did not build); strip the a/f suffixes for the build.
  echo "TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST-<unset>}"
  if [ -n "$TORCH_CUDA_ARCH_LIST" ]; then
    TORCH_CUDA_ARCH_LIST=$(echo "$TORCH_CUDA_ARCH_LIST" | sed -E 's/([0-9])[af]\b/\1/g'); export TORCH_CUDA_ARCH_LIST
    echo "TORCH_CUDA_ARCH_LIST for DeepSpeed's JIT builds: $TORCH_CUDA_ARCH_LIST"
  fi
  export DS_ACCELERATOR=${DS_ACCELERATOR:-$($PY -c 'import torch; print("cuda" if torch.cuda.is_available() else "cpu")')}
  $PY -c "import deepspeed, datasets, pydantic, hjson, transformers, torch, zerotrain.cli, zerotrain.backends.deepspeed.engine; \
print('imports ok: deepspeed', deepspeed.__version__, 'datasets', datasets.__version__, 'transformers', transformers.__version__, \
'torch', torch.__version__, 'cuda', torch.cuda.is_available())" || { echo "import check failed"; exit 4; }
  timeout --signal=KILL $((DEADLINE + 45)) $PY benchmarks/gpu/drive.py --out "$OUT" --deadline "$DEADLINE" "$@"
  echo "== drive.py exit $?"
} 2>&1 | tee "$OUT/log.txt"
