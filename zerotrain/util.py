"""Small helpers shared across zerotrain, one of each: byte formatting, this process's memory,
a free local port, whether the HF hub is offline."""
from __future__ import annotations

import math
import os
import socket
from typing import Optional

_TRUE = ("1", "true", "yes", "on")


def human_bytes(n: Optional[float]) -> str:
    """1536 -> '1.5 KiB'; None or NaN -> '-'."""
    if n is None or (isinstance(n, float) and math.isnan(n)):
        return "-"
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def _status_bytes(field: str) -> int:
    """A memory figure of /proc/self/status in bytes; 0 where /proc is unavailable."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def peak_rss_bytes() -> int:
    """This process's peak resident set size (VmHWM), bytes; 0 where /proc is unavailable."""
    return _status_bytes("VmHWM")


def rss_bytes() -> int:
    """This process's current resident set size (VmRSS), bytes; 0 where /proc is unavailable."""
    return _status_bytes("VmRSS")


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (for a local rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def hub_offline(*variables: str) -> bool:
    """Whether the HF hub is switched off (HF_HUB_OFFLINE, plus any `variables` such as HF_DATASETS_OFFLINE)."""
    return any(os.environ.get(v, "0").strip().lower() in _TRUE for v in ("HF_HUB_OFFLINE", *variables))
