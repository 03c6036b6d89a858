#!/usr/bin/env bash
# One machine, the ranks of hostfile.example (localhost slots=2): the deepspeed launcher, no ssh.
#
#   scripts/launch_single_node.sh --stage 3 --max-steps 20 --output runs/demo
#
# Settings (environment): HOSTFILE (hostfile.example), MASTER_PORT (29500), DRY_RUN=1 prints only.
set -euo pipefail
REPO="$(cd "$(dirname "$0")/.." && pwd)"
HOSTFILE="${HOSTFILE:-$REPO/hostfile.example}"
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
CMD=(deepspeed --hostfile "$HOSTFILE" --no_ssh --node_rank 0 --master_addr 127.0.0.1
     --master_port "${MASTER_PORT:-29500}" --module zerotrain train "$@")
if [ "${DRY_RUN:-0}" = 1 ]; then printf '%q ' "${CMD[@]}"; echo; exit 0; fi
exec "${CMD[@]}"
