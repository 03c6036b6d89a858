#!/bin/bash
# usage: run.sh NAME args...   -> runs 2-rank probe, writes NAME.json / NAME.log
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false OMP_NUM_THREADS=1
name=$1; shift
timeout 180 /work/main/.venv/bin/torchrun --nproc_per_node 2 --master_port ${PORT:-29511} autoep_probe.py --mode ds --out $name.json "$@" > $name.log 2>&1
echo "$name rc=$?"
grep -h "^\[rank[01]\] {" $name.log | cut -c1-900
