#!/usr/bin/env bash
# The GPU suite in one command (it runs from the repository root wherever it is called from):
#   bash benchmarks/gpu_suite.sh [--cpu] [DEADLINE_S] [benchmarks/gpu/drive.py args]
# On a CUDA machine: install the carried wheelhouse offline (.whl: deepspeed built with DS_BUILD_OPS=0, pydantic,
# datasets, ...; .whl_opt: pyarrow, only where the machine's is missing or older; made by
# benchmarks/gpu/make_wheelhouse.sh), check the imports, then run benchmarks/gpu/drive.py: zerotrain ZeRO 0-3
# (+ offload, + compile, fused loss off) vs the DeepSpeed loop vs HF Trainer on a ~1.1B Llama built here, and the
# largest model ZeRO-3 trains with and without offload. With --cpu, or without CUDA: the same driver on a tiny Llama
# over gloo (no wheels; CI runs it, tests/multirank/test_bench_smoke.py).
# DEADLINE_S (default 540 on CUDA, 300 on CPU): seconds from this script's start by which the last run has ended; the
# command ends a few seconds later (the device allows 600 s a command). Everything lands in $OUT
# (default /tmp/ztgpu-out), rewritten after every run: gpu_results.json, RESULTS_GPU.md (copy it to benchmarks/),
# log.txt, runs_log.txt, jit_log.txt.
set -o pipefail
OUT=$(realpath -m "${OUT:-/tmp/ztgpu-out}")
cd "$(dirname "$0")/.." || exit 2
CPU=""
if [ "$1" = "--cpu" ]; then CPU=1; shift; fi
if [ -n "$PY" ]; then :; elif [ -x .venv/bin/python ]; then PY=$PWD/.venv/bin/python; else PY=$(command -v python3); fi
if [ -z "$CPU" ] && [ "$(timeout 120 $PY -c 'import torch; print(int(torch.cuda.is_available()))' 2>/dev/null)" != 1 ]
then CPU=1; fi
MODE=$([ -n "$CPU" ] && echo CPU || echo CUDA)
DEADLINE=$([ -n "$CPU" ] && echo 300 || echo 540)
if [[ "$1" =~ ^[0-9]+$ ]]; then DEADLINE=$1; shift; fi
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
{
  echo "== $(date -u +%FT%TZ) $(hostname) $(nproc) cpus, $MODE mode, deadline ${DEADLINE} s, python $PY"
  if [ -z "$CPU" ]; then
    nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used,temperature.gpu,clocks.sm --format=csv 2>&1
    if [ -z "$SKIP_WHEELS" ] && ls .whl/*.whl >/dev/null 2>&1; then
      # .whl_opt wheels only where the machine lacks the package or has an older major version (datasets 5.2 wants
      # pyarrow >= 24; the image's own is kept when new enough: 50 MB less to install)
      EXTRA=$($PY - .whl_opt/*.whl <<'EOF'
import importlib.metadata as md, os, sys
for w in sys.argv[1:]:
    if not os.path.isfile(w):
        continue
    name, version = os.path.basename(w).split("-")[:2]
    try:
        have = int(md.version(name.replace("_", "-")).split(".")[0])
    except (md.PackageNotFoundError, ValueError):
        have = -1
    if have < int(version.split(".")[0]):
        print(w)
EOF
)
      echo "extra wheels: ${EXTRA:-none}"
      # shellcheck disable=SC2086
      timeout 300 $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl $EXTRA \
        || { echo "wheel install failed"; exit 3; }
      export PYTHONPATH=/tmp/site PATH=$PATH:/tmp/site/bin  # bin: ninja, where the machine has none
    fi
    # DeepSpeed 0.19.8's JIT builder parses TORCH_CUDA_ARCH_LIST entries as numbers and fails on arch suffixes
    # ("9.0a": ValueError: invalid literal for int() with base 10: '0a', seen on the H100 image on 2026-11-26, where
    # fused_adam then did not build); strip the a/f suffixes for the build.
    echo "TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST-<unset>}"
    if [ -n "$TORCH_CUDA_ARCH_LIST" ]; then
      TORCH_CUDA_ARCH_LIST=$(echo "$TORCH_CUDA_ARCH_LIST" | sed -E 's/([0-9])[af]\b/\1/g'); export TORCH_CUDA_ARCH_LIST
      echo "TORCH_CUDA_ARCH_LIST for DeepSpeed's JIT builds: $TORCH_CUDA_ARCH_LIST"
    fi
  fi
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
  export DS_ACCELERATOR=${DS_ACCELERATOR:-$([ -n "$CPU" ] && echo cpu || echo cuda)}
  timeout 120 $PY -c "import deepspeed, datasets, pydantic, hjson, transformers, torch, zerotrain.cli, \
zerotrain.backends.deepspeed.engine; print('imports ok: deepspeed', deepspeed.__version__, 'datasets', \
datasets.__version__, 'transformers', transformers.__version__, 'torch', torch.__version__, 'cuda', \
torch.cuda.is_available())" || { echo "import check failed"; exit 4; }
  LEFT=$((DEADLINE - SECONDS))
  # the driver keeps its own deadline; the kill is the backstop
  timeout --signal=KILL $((LEFT + 40)) $PY benchmarks/gpu/drive.py --out "$OUT" --deadline "$LEFT" ${CPU:+--cpu} "$@"
  RC=$?
  echo "== drive.py exit $RC after ${SECONDS} s"
  exit $RC
} 2>&1 | tee "$OUT/log.txt"
