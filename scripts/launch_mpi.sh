#!/usr/bin/env bash
# OpenMPI: mpirun starts every rank directly (no pdsh, no deepspeed launcher). Each rank maps
# OMPI_COMM_WORLD_* to RANK/WORLD_SIZE/LOCAL_RANK in a bash prologue, so mpi4py is not needed.
#
#   HOSTFILE=hostfile IFNAME=eth0 scripts/launch_mpi.sh --stage 3 --output runs/x
#
# Settings (environment): HOSTFILE (required), MASTER_ADDR (first hostfile entry), MASTER_PORT
# (29500), IFNAME (pins MPI's TCP and gloo/NCCL to one interface), PYTHON (python), DRY_RUN=1.
# The command comes from zerotrain.launch.launchers.mpirun_cmd (unit-tested in tests/unit/test_launch.py).
set -euo pipefail
REPO="$(cd "$(dirname "$0")/.." && pwd)"
: "${HOSTFILE:?set HOSTFILE to a file of lines 'HOST slots=N' (see hostfile.example)}"
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
ARGS=(--hostfile "$HOSTFILE" --master-port "${MASTER_PORT:-29500}" --print mpi)
[ -n "${MASTER_ADDR:-}" ] && ARGS+=(--master-addr "$MASTER_ADDR")
[ -n "${IFNAME:-}" ] && ARGS+=(--ifname "$IFNAME")
CMD="$("${PYTHON:-python}" -m zerotrain launch "${ARGS[@]}" -- train "$@")"
if [ "${DRY_RUN:-0}" = 1 ]; then echo "$CMD"; exit 0; fi
command -v mpirun >/dev/null || { echo "launch_mpi.sh: mpirun not found; install OpenMPI (apt-get install openmpi-bin)" >&2; exit 1; }
eval "exec $CMD"   # CMD is shell-quoted by zerotrain.launch.launchers.shell_join
