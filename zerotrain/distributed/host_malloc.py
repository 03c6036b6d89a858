"""Fixed glibc malloc thresholds for training processes (run.tune_malloc).

glibc serves large blocks with fresh mmap pages and adapts the threshold to the sizes freed so far,
so a process's history decides whether each step's activation-sized tensors (MBs) come back as
new pages: every page then costs a fault plus zeroing, every step. Measured here (2 ranks,
small-gpt2, bf16, ZeRO-0, benchmarks/RESULTS.md): the `zerotrain train` process took ~3,100 minor
page faults per step against ~700 for a bare deepspeed loop, and ran ~5% slower; with the two
thresholds below fixed, both took ~50 faults per step. The values are the ones glibc's own
adaptation converges to at most (mmap 32 MiB, trim 2x that), set up front instead of left to
chance. Other allocators (jemalloc/tcmalloc via LD_PRELOAD) never see mallopt and are unaffected.
"""
from __future__ import annotations

import ctypes
import os
import platform
import sys

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 * 2**20
"""glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit: the most its dynamic rule would reach."""
TRIM_THRESHOLD = 2 * MMAP_THRESHOLD
"""What glibc's dynamic rule pairs with that mmap threshold."""
USER_ENV = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "GLIBC_TUNABLES")

_done = False


def tune() -> bool:
    """Fix glibc's mmap/trim thresholds once per process; False where not glibc or the user set them."""
    global _done
    if _done:
        return True
    if sys.platform != "linux" or platform.libc_ver()[0] != "glibc" or any(os.environ.get(k) for k in USER_ENV):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    _done = libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    return _done
