"""DeepSpeed's JIT op loads (fused_adam, cpu_adam, the shm comm op): the same build inputs on every launch, answered fast.

Two things made a launch pay for op builds it had done before:

- ninja. torch builds and loads the ops with the `ninja` first on PATH. An environment made by pip has its own
  (the `ninja` package, 1.13 here) and the machine another (/usr/bin/ninja, 1.11 here): each reads the other's
  .ninja_log as foreign and rebuilds every object (about 50 s per op on 2 cores), so a launch from an activated
  environment (or the deepspeed launcher's walk-through) and one without rebuilt each other's ops in turn.
  `pin_ninja` puts the environment's own ninja first on PATH, as activating the environment would.
- py-cpuinfo. DeepSpeed's CPU op builder (deepspeed/ops/op_builder/builder.py: cpu_arch, simd_width) calls
`cpuinfo.get_cpu_info()` while it loads fused_adam or cpu_adam, even when the op is built already. Each call
starts a subprocess that runs CPUID and times the clock: 1.1-1.2 s of CPU here, twice per rank of every DeepSpeed
run (profiled with cProfile on a 4-step ZeRO-2 run: 2.3 of its 14.5 s). DeepSpeed reads only `arch` and `flags`
from it, which change only with the CPU, so the answer is kept in zerotrain's cache, keyed by what /proc/cpuinfo
says of the CPU (vendor, family, model, stepping, flags, core count). Elsewhere (no /proc/cpuinfo) the answer is
kept for the process only. A cache that cannot be read or written is ignored: py-cpuinfo answers as before.
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import platform
import sys
from pathlib import Path
from typing import Any, Callable, Optional

_IDENTITY = ("vendor_id", "cpu family", "model", "model name", "stepping", "flags")
"""The /proc/cpuinfo fields that name the CPU (not its clock, which moves)."""


def machine_key(cpuinfo_text: Optional[str] = None) -> Optional[str]:
    """A short hash of what names this machine's CPU, or None where /proc/cpuinfo is not there."""
    if cpuinfo_text is None:
        try:
            cpuinfo_text = Path("/proc/cpuinfo").read_text()
        except OSError:
            return None
    lines = sorted({ln.strip() for ln in cpuinfo_text.splitlines() if ln.split(":")[0].strip() in _IDENTITY})
    ident = "\n".join([platform.machine(), str(os.cpu_count()), *lines])
    return hashlib.sha256(ident.encode()).hexdigest()[:16]


def cached(ask: Callable[[], dict[str, Any]], path: Optional[Path]) -> Callable[[], dict[str, Any]]:
    """`ask` answered from `path` when it holds an answer, else asked once and written there (atomically)."""

    @functools.cache
    def get_cpu_info() -> dict[str, Any]:
        if path is not None:
            try:
                return json.loads(path.read_text())
            except (OSError, ValueError):
                pass
        info = ask()
        if path is not None:
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
                tmp.write_text(json.dumps(info))
                os.replace(tmp, path)  # another rank writing the same answer at once is harmless
            except OSError:
                pass
        return info

    get_cpu_info.asked_by = ask  # type: ignore[attr-defined]  (what install() replaced, and a sign it did)
    return get_cpu_info


def pin_ninja(executable: Optional[str] = None) -> Optional[Path]:
    """Put the environment's own ninja (beside the Python that runs) first on PATH; returns its folder, None where
    the environment has none (the machine's ninja is then the only one)."""
    folder = Path(executable or sys.executable).parent
    ninja = folder / "ninja"
    if not (ninja.is_file() and os.access(ninja, os.X_OK)):
        return None
    entries = os.environ.get("PATH", "").split(os.pathsep)
    if entries[:1] != [str(folder)]:
        os.environ["PATH"] = os.pathsep.join([str(folder), *[e for e in entries if e and e != str(folder)]])
    return folder


def install() -> None:
    """Before DeepSpeed loads an op in this process: the environment's ninja first on PATH (pin_ninja) and
    py-cpuinfo's `get_cpu_info` answered from the cache (DeepSpeed imports it at call time)."""
    pin_ninja()
    _cache_cpu_info()


def _cache_cpu_info() -> None:
    try:
        import cpuinfo
    except ImportError:  # DeepSpeed then uses its lscpu fallback: nothing to cache
        return
    if hasattr(cpuinfo.get_cpu_info, "asked_by"):
        return
    from ...assets.demo import cache_root

    key = machine_key()
    path = cache_root() / "cpuinfo" / f"{key}.json" if key else None
    cpuinfo.get_cpu_info = cached(cpuinfo.get_cpu_info, path)
