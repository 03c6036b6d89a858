#!/usr/bin/env bash
# Several machines: the deepspeed launcher ssh-es into every hostfile entry through pdsh.
# Run it on the first host, from a directory every host sees at the same path (shared FS).
#
#   HOSTFILE=hostfile IFNAME=eth0 scripts/launch_multi_node.sh --stage 3 --output runs/x
#
# It goes through `zerotrain launch`, which first checks every host over ssh (one line per
# unreachable host), writes IFNAME into ./.deepspeed_env (GLOO_SOCKET_IFNAME/NCCL_SOCKET_IFNAME,
# exported by the launcher on every host), then runs
#   deepspeed --hostfile HOSTFILE --master_addr MASTER_ADDR --module zerotrain train ...
# and, when a host fails, names it and stops the others.
#
# Settings (environment): HOSTFILE (required), MASTER_ADDR (first hostfile entry), MASTER_PORT
# (29500), IFNAME (unset: keep ./.deepspeed_env as it is), PYTHON (python), DRY_RUN=1 prints only.
set -euo pipefail
REPO="$(cd "$(dirname "$0")/.." && pwd)"
: "${HOSTFILE:?set HOSTFILE to a file of lines 'HOST slots=N' (see hostfile.example)}"
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
ARGS=(--hostfile "$HOSTFILE" --master-port "${MASTER_PORT:-29500}")
[ -n "${MASTER_ADDR:-}" ] && ARGS+=(--master-addr "$MASTER_ADDR")
[ -n "${IFNAME:-}" ] && ARGS+=(--ifname "$IFNAME")
if [ "${DRY_RUN:-0}" = 1 ]; then exec "${PYTHON:-python}" -m zerotrain launch "${ARGS[@]}" --print deepspeed -- train "$@"; fi
exec "${PYTHON:-python}" -m zerotrain launch "${ARGS[@]}" -- train "$@"
