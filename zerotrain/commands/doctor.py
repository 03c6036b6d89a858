"""`zerotrain doctor`: is this machine (and the hostfile's) ready for a run? One line per check.

    zerotrain doctor                          # versions, accelerator, precision, ops, locks, network
    zerotrain doctor --hostfile hostfile      # also: every host over ssh, same Python and zerotrain
    zerotrain doctor --build-ops              # also build DeepSpeed's JIT ops now (g++, minutes once)
    zerotrain doctor --build-ops cpu_adam     # only this one

Each line starts with `ok`, `warn` or `FAIL`; a FAIL line names the fix. Exit 1 when a check a run
needs failed (torch or transformers missing, a stale build lock, an unreachable or mismatched host,
an op --build-ops could not build, a socket interface that does not exist); missing optional
packages (peft, torchao, deepspeed: FSDP2 runs without it) only warn. Nothing is built unless
--build-ops asks: by default an op is reported compatible, and built or not in the torch extension
cache.
"""
from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import logging
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

from .. import __version__
from ..errors import UserError, first_line
from ..launch import launchers as L

OPS = {"cpu_adam": "CPUAdamBuilder", "fused_adam": "FusedAdamBuilder"}
"""DeepSpeed JIT ops checked (op name -> builder class): cpu_adam for optimizer offload, fused_adam for Adam."""

PROBE = "import zerotrain, sys; print(zerotrain.__version__, sys.version.split()[0])"
"""What each remote host runs with this machine's interpreter path (the launcher runs the same path there)."""


@dataclass(frozen=True)
class Check:
    """One output line: status is 'ok', 'warn' or 'FAIL' (FAIL: a run would fail; the text names the fix)."""

    status: str
    text: str

    def line(self) -> str:
        return f"{self.status:<6}{self.text}"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--hostfile", default=None, help="also check every host: ssh, same Python and zerotrain")
    p.add_argument("--ssh-timeout", type=float, default=5.0, help="seconds for each host's ssh check")
    p.add_argument("--ssh-port", type=int, default=None, help="ssh port for the host checks (default: ssh's)")
    p.add_argument("--build-ops", nargs="*", choices=list(OPS), default=None, metavar="OP",
                   help="build DeepSpeed's JIT ops now if they are not built (all of cpu_adam, fused_adam, or "
                        "the ones named; compiling takes minutes the first time) instead of only reporting them")


def _version(dist: str) -> Optional[str]:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


# ------------------------------------------------------------------------------------------ packages

def package_checks() -> list[Check]:
    """python/zerotrain, torch, transformers (a run needs them), deepspeed, peft, torchao (optional)."""
    out = [Check("ok", f"python {sys.version.split()[0]}, zerotrain {__version__} ({sys.executable})")]
    try:
        import torch
    except Exception as e:  # a broken torch raises many kinds at import
        out.append(Check("FAIL", f"torch: import failed ({first_line(e)}): pip install torch"))
    else:
        hip = getattr(torch.version, "hip", None)
        cuda = f"CUDA {torch.version.cuda}" if torch.version.cuda else f"ROCm {hip}" if hip else "CUDA none"
        out.append(Check("ok", f"torch {_version('torch') or torch.__version__} ({cuda})"))
    try:
        import transformers  # noqa: F401
    except Exception as e:
        out.append(Check("FAIL", f"transformers: import failed ({first_line(e)}): pip install transformers"))
    else:
        out.append(Check("ok", f"transformers {_version('transformers')}"))
    if "torch" in sys.modules:  # deepspeed_importable imports torch
        from ..plan.resolve import deepspeed_importable

        ds_log = logging.getLogger("DeepSpeed")  # its logger writes to stdout: keep one line per check there
        if _not_cpu_notice not in ds_log.filters:
            ds_log.addFilter(_not_cpu_notice)
        ok, why = deepspeed_importable()
        out.append(Check("ok", f"deepspeed {_version('deepspeed')}") if ok else
                   Check("warn", f"deepspeed: {why}; runs use the FSDP2 backend "
                                 "(pip install deepspeed for ZeRO offload to NVMe, fp16 and DeepSpeed configs)"))
    for dist, use in (("peft", "--lora"), ("torchao", "--quantize/--qat")):  # not imported: metadata is enough
        ver = _version(dist) if importlib.util.find_spec(dist) else None
        out.append(Check("ok", f"{dist} {ver}") if ver else
                   Check("warn", f"{dist}: not installed; needed only for {use} (pip install {dist})"))
    return out


def _not_cpu_notice(record: logging.LogRecord) -> bool:
    """Drops DeepSpeed's import-time 'Setting accelerator to CPU' (the accelerator line says it)."""
    return "Setting accelerator to CPU" not in record.getMessage()


# ------------------------------------------------------------------------------------------ device

def device_checks() -> list[Check]:
    """The accelerator torch sees, and whether bf16/fp16 run natively on it (needs torch)."""
    import torch

    if torch.cuda.is_available():
        n = torch.cuda.device_count()
        name, cap = torch.cuda.get_device_name(0), torch.cuda.get_device_capability(0)
        try:
            import torch.cuda.nccl

            nccl = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception:  # a build without NCCL
            nccl = "none"
        bf16 = torch.cuda.is_bf16_supported(including_emulation=False)
        return [Check("ok", f"accelerator: {n} x {name} (compute {cap[0]}.{cap[1]}), CUDA {torch.version.cuda}, "
                            f"NCCL {nccl}"),
                Check("ok", "bf16 native on this GPU") if bf16 else
                Check("warn", f"bf16 not native on {name} (compute < 8.0): use --precision fp16 (DeepSpeed) or fp32"),
                Check("ok", "fp16 supported on this GPU (DeepSpeed backend; FSDP2 has no loss scaling)")]
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    acc = (Check("warn", f"accelerator: torch has CUDA {torch.version.cuda} but sees no GPU (driver, "
                         f"CUDA_VISIBLE_DEVICES?); runs use the CPU ({cores} cores) and gloo")
           if torch.version.cuda else Check("ok", f"accelerator: CPU only, {cores} cores (torch without CUDA); "
                                                  "runs use gloo"))
    bf16 = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return [acc,
            Check("ok", "bf16 native on this CPU (oneDNN bf16 kernels)") if bf16 else
            Check("warn", "bf16 slow on this CPU: no oneDNN bf16 kernels (no AVX-512 bf16), matrix multiplies run "
                          "~50x slower than fp32; use --precision fp32 here"),
            Check("ok", "fp16 not on CPU (zerotrain refuses it there; use bf16 or fp32)")]


# ------------------------------------------------------------------------------------------ build locks and ops

def lock_checks(root: Path) -> list[Check]:
    """A stale build lock is a FAIL (DeepSpeed would wait on it forever); a fresh one is a build running."""
    from ..distributed.jit_locks import stale_locks

    stale = stale_locks(root)
    out = [Check("FAIL", f"stale build lock {lock} ({age / 60:.0f} min old, no process holds it): DeepSpeed would "
                         f"wait on it forever; rm {lock} if no build is running on a machine sharing {root}")
           for lock, age in stale]
    busy = sorted(set(root.glob("*/lock")) - {lock for lock, _ in stale}) if root.is_dir() else []
    out += [Check("warn", f"build lock {lock}: a build is running (or was killed < 10 min ago); rerun doctor later")
            for lock in busy]
    return out or [Check("ok", f"no torch extension build lock under {root}")]


@contextmanager
def _term_raises() -> Iterator[None]:
    """While building: SIGTERM/SIGHUP stop ninja (which stops its compilers) and raise KeyboardInterrupt, so
    torch's `finally` deletes its build lock (the default action would kill us holding it, and every later
    DeepSpeed run would wait forever) and no compiler is left running."""
    def interrupt(signum, frame):
        kids = _children(os.getpid())
        for pid in kids:
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 10
        while _children(os.getpid(), running=True) and time.monotonic() < deadline:
            time.sleep(0.1)
        raise KeyboardInterrupt(f"signal {signum} during an op build")

    old = {s: signal.signal(s, interrupt) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)


def _children(parent: int, running: bool = False) -> list[int]:
    """Child process ids of `parent` (Linux /proc; empty elsewhere); running: leave out zombies."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()  # after "pid (comm)": state, ppid, ...
        except (OSError, IndexError):
            continue
        if int(fields[1]) == parent and not (running and fields[0] == "Z"):
            out.append(int(stat.parent.name))
    return out


def _build_error(e: BaseException) -> str:
    """'Error building extension X: <the compiler's first error line>' from a failed build (torch puts the
    whole build log in the message; its first line is a long compiler command)."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    head = first_line(e).split(": [", 1)[0]
    err = next((ln for ln in lines[1:] if re.search(r"\berror\b", ln, re.I)
                and not ln.startswith(("FAILED", "ninja:", "subprocess."))), None)
    return (f"{head}: {err}" if err else head)[:300]


def op_check(op: str, root: Path, build: bool) -> Check:
    """One DeepSpeed op: compatible here? built (prebuilt or in the extension cache)? With build, build it."""
    from deepspeed.accelerator import get_accelerator
    from deepspeed.git_version_info import installed_ops

    cls = get_accelerator().get_op_builder(OPS[op])
    builder = cls() if cls is not None else None
    if builder is None or not builder.is_compatible(verbose=False):
        why = (str(getattr(builder, "error_log", None) or "").strip().splitlines() or [""])[0]
        status = "FAIL" if build else "warn"
        return Check(status, f"op {op}: not compatible with this machine{f' ({why})' if why else ''}; "
                             f"DeepSpeed runs that use it fail (pick another --optimizer/offload or --backend fsdp)")
    cached = sorted((root / op).glob(f"{op}*.so"))
    if installed_ops.get(op):
        return Check("ok", f"op {op}: compatible, prebuilt into deepspeed")
    if cached:
        return Check("ok", f"op {op}: compatible, built ({cached[-1]})")
    lock = root / op / "lock"
    if lock.exists():  # a build in progress, or a stale lock (its own FAIL line): building would wait on it
        return Check("warn", f"op {op}: compatible, not built, and {lock} exists (see the lock line): not building")
    if not build:
        tools = [t for t in (os.environ.get("CXX", "c++"), "ninja") if shutil.which(t) is None]
        if tools:
            return Check("warn", f"op {op}: not built, and no {' or '.join(tools)} on PATH: the first DeepSpeed run "
                                 f"that needs it fails to build it (apt-get install g++ ninja-build)")
        return Check("warn", f"op {op}: compatible, not built yet: the first DeepSpeed run compiles it "
                             f"(minutes); `zerotrain doctor --build-ops` builds it now")
    print(f"building op {op} (compiling: minutes the first time) ...", file=sys.stderr, flush=True)
    start = time.monotonic()
    try:
        with _term_raises():
            builder.load(verbose=False)
    except Exception as e:  # compiler errors, missing ninja, a torch/deepspeed mismatch
        return Check("FAIL", f"op {op}: build failed ({_build_error(e)}); check g++/ninja and the deepspeed/torch "
                             f"versions, then rerun with --build-ops")
    return Check("ok", f"op {op}: built in {time.monotonic() - start:.0f} s (in {root / op})")


def ops_checks(root: Path, build: Optional[list[str]]) -> list[Check]:
    """One line per op in OPS, building those in `build` ([]: all; None: none); no line when deepspeed does
    not import (its own line said so)."""
    if sys.modules.get("deepspeed") is None:  # not imported, or made absent by deepspeed_importable
        return [] if build is None else [Check("FAIL", "--build-ops: deepspeed does not import, so no op can be built")]
    return [op_check(op, root, build is not None and (not build or op in build)) for op in OPS]


# ------------------------------------------------------------------------------------------ network

def _interfaces() -> list[str]:
    try:
        return [name for _, name in socket.if_nameindex()]
    except OSError:
        return []


def _iface_of(addr: str) -> Optional[str]:
    """The local interface holding `addr` (psutil, else `ip -o addr`)."""
    try:
        import psutil

        return next((n for n, addrs in psutil.net_if_addrs().items() for a in addrs if a.address == addr), None)
    except ImportError:
        out = _run(["ip", "-o", "addr", "show"])
        m = re.search(rf"^\d+:\s+(\S+)\s+inet6?\s+{re.escape(addr)}/", out or "", re.M)
        return m[1] if m else None


def _run(cmd: list[str]) -> Optional[str]:
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=5, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return res.stdout if res.returncode == 0 else None


def route_to(addr: str) -> tuple[Optional[str], Optional[str]]:
    """(interface, source address) this machine sends to `addr` from: `ip route get`, else a UDP socket
    (connect() on UDP only picks the route; nothing is sent)."""
    out = _run(["ip", "route", "get", addr])
    if out:
        dev, src = re.search(r"\bdev (\S+)", out), re.search(r"\bsrc (\S+)", out)
        if dev:
            return dev[1], src[1] if src else None
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((addr, 9))
            src = s.getsockname()[0]
    except OSError:
        return None, None
    return _iface_of(src), src


def network_check(multi_host: bool) -> Check:
    """The interface gloo (and NCCL's socket transport) would use: GLOO_SOCKET_IFNAME/NCCL_SOCKET_IFNAME (set
    here, or in the .deepspeed_env the launcher exports), else the route to MASTER_ADDR, else the address this
    host name resolves to (what gloo binds)."""
    have = _interfaces()
    env: dict[str, str] = {}
    for path in (Path.home() / L.ENV_FILE_NAME, Path(L.ENV_FILE_NAME)):  # the launcher reads both, . last
        try:
            env.update(L.read_env_file(path))
        except UserError as e:
            return Check("FAIL", f"network: {e}")
    env.update(os.environ)
    pinned = [(v, env[v]) for v in L.IFNAME_VARS if env.get(v)]
    for var, value in pinned:
        names = [n for n in value.split(",") if n]
        # NCCL takes prefixes (eth matches eth0), '=' for an exact name and '^' to exclude
        exact = var == "GLOO_SOCKET_IFNAME" or value.startswith("=")
        if value.startswith("^"):
            continue
        names = [n.lstrip("=") for n in names]
        missing = [n for n in names if not any(i == n if exact else i.startswith(n) for i in have)]
        if have and missing:
            return Check("FAIL", f"network: {var}={value}: no interface {', '.join(missing)} here (have "
                                 f"{', '.join(have)}); set it to one of those, or unset it")
    if pinned:
        where = "environment" if all(os.environ.get(v) for v, _ in pinned) else L.ENV_FILE_NAME
        return Check("ok", "network: " + ", ".join(f"{v}={val}" for v, val in pinned) + f" (pinned, from {where})")
    master = os.environ.get("MASTER_ADDR")
    if master and not L.is_local(master):
        dev, src = route_to(master)
        if dev is None:
            return Check("FAIL", f"network: no route to MASTER_ADDR={master} (or the name does not resolve): "
                                 "check the address, or unset it")
        return Check("ok", f"network: gloo/NCCL would reach MASTER_ADDR={master} over {dev} ({src})")
    host = socket.gethostname()
    try:
        addr = socket.gethostbyname(host)
    except OSError:
        return Check("warn", f"network: host name {host} does not resolve; gloo falls back to loopback; set "
                             f"GLOO_SOCKET_IFNAME (zerotrain launch --ifname IFACE)")
    dev = _iface_of(addr) or "?"
    if addr.startswith("127."):
        default = route_to("8.8.8.8")[0]  # the default route's interface (nothing is sent)
        hint = f"set GLOO_SOCKET_IFNAME={default or 'IFACE'} (zerotrain launch --ifname {default or 'IFACE'})"
        return Check("warn" if multi_host else "ok",
                     f"network: gloo would use {dev} ({host} resolves to {addr}): fine on one machine, other hosts "
                     f"cannot reach it; for several hosts {hint}")
    return Check("ok", f"network: gloo would use {dev} ({host} resolves to {addr})")


# ------------------------------------------------------------------------------------------ hosts

def host_checks(hostfile: str, hosts: list[L.Host], timeout: float, port: Optional[int]) -> list[Check]:
    """Every hostfile host: reachable over passwordless ssh, and this interpreter path there runs the same
    Python minor version and zerotrain version (localhost/127.0.0.1 is this machine: no ssh)."""
    reach = L.check_hosts(hosts, timeout=timeout, port=port, skip_local=True)
    remote = [h.name for h in hosts if not L.is_local(h.name) and reach[h.name] is None]
    with ThreadPoolExecutor(max_workers=max(1, min(32, len(remote)))) as pool:
        probed = dict(zip(remote, pool.map(lambda n: _probe(n, timeout, port), remote)))
    out = [Check("ok", f"hostfile {hostfile}: {len(hosts)} host(s), {L.world_size(hosts)} rank(s)")]
    for h in hosts:
        if L.is_local(h.name):
            out.append(Check("ok", f"host {h.name}: this machine (no ssh)"))
        elif reach[h.name] is not None:
            out.append(Check("FAIL", L.unreachable_lines({h.name: reach[h.name]})[0]))
        else:
            out.append(probed[h.name])
    return out


def _probe(host: str, timeout: float, port: Optional[int]) -> Check:
    """Run PROBE on `host` with this machine's interpreter path; compare Python minor and zerotrain."""
    cmd = L.ssh_check_cmd(host, timeout, port)[:-1] + [shlex.join([sys.executable, "-c", PROBE])]
    try:
        res = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout + 30)
    except subprocess.TimeoutExpired:
        return Check("FAIL", f"host {host}: {sys.executable} did not answer within {timeout + 30:.0f}s")
    words = res.stdout.split()
    if res.returncode != 0 or len(words) != 2:
        err = (res.stderr.strip().splitlines() or [f"exit {res.returncode}"])[-1]
        return Check("FAIL", f"host {host}: `{sys.executable} -c 'import zerotrain'` failed there ({err}); install "
                             f"the same venv at the same path on every host")
    zt, py = words
    mine = sys.version.split()[0]
    if py.split(".")[:2] != mine.split(".")[:2] or zt != __version__:
        return Check("FAIL", f"host {host}: Python {py}, zerotrain {zt} there vs Python {mine}, zerotrain "
                             f"{__version__} here; install the same versions on every host")
    return Check("ok", f"host {host}: ssh ok, Python {py}, zerotrain {zt}")


# ------------------------------------------------------------------------------------------ command

def _emit(checks: list[Check]) -> list[Check]:
    for c in checks:
        print(c.line(), flush=True)
    return checks


def run(args: argparse.Namespace) -> int:
    from ..distributed.jit_locks import extensions_root

    hosts = L.read_hostfile(args.hostfile) if args.hostfile else []  # a bad hostfile: one line, exit 2
    with ThreadPoolExecutor(max_workers=1) as pool:  # the ssh checks run while torch & co. import
        remote = pool.submit(host_checks, args.hostfile, hosts, args.ssh_timeout, args.ssh_port) if hosts else None
        checks = _emit(package_checks())
        if "torch" in sys.modules:  # these read torch's device and extension directory
            root = extensions_root()
            checks += _emit(device_checks() + lock_checks(root))
            checks += _emit(ops_checks(root, args.build_ops))
        checks += _emit([network_check(multi_host=any(not L.is_local(h.name) for h in hosts))])
        checks += _emit(remote.result() if remote else [])
    counts = {s: sum(c.status == s for c in checks) for s in ("ok", "warn", "FAIL")}
    verdict = "a run would fail: fix the FAIL lines" if counts["FAIL"] else "ready to run"
    print(f"doctor: {counts['ok']} ok, {counts['warn']} warn, {counts['FAIL']} FAIL: {verdict}")
    return 1 if counts["FAIL"] else 0
