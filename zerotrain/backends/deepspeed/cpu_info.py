"""py-cpuinfo's answer, asked once per machine instead of twice per DeepSpeed op load in every rank.

DeepSpeed's CPU op builder (deepspeed/ops/op_builder/builder.py: cpu_arch, simd_width) calls
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


def install() -> None:
    """Answer py-cpuinfo's `get_cpu_info` from the cache in this process (DeepSpeed imports it at call time)."""
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
