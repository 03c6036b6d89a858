"""The process-group API for engine users, at its documented path (`from zerotrain import dist`; README.md):
the functions of zerotrain/distributed/process_group.py (init, rank, world_size, is_main, barrier, teardown,
exit_cleanly)."""
from .distributed.process_group import (  # noqa: F401
                                        DistEnv,
                                        barrier,
                                        env,
                                        exit_cleanly,
                                        init,
                                        is_initialized,
                                        is_main,
                                        rank,
                                        teardown,
                                        used_process_group,
                                        world_size,
)
