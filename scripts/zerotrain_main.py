"""`python scripts/zerotrain_main.py train ...`: the zerotrain CLI as a script path, for launchers
that cannot run a module (deepspeed's slurm runner drops --module).

When RANK is not set (srun/mpirun started the process directly), the scheduler's variables are
mapped to RANK/LOCAL_RANK/WORLD_SIZE first, so DeepSpeed does not fall back to mpi4py discovery.
"""
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from zerotrain.launch.launchers import env_from_scheduler  # noqa: E402

os.environ.update(env_from_scheduler(os.environ))

from zerotrain.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
