"""Multi-host launch support: hostfiles, reachability, `.deepspeed_env`, world layout, launch commands.

    zerotrain launch --hostfile hostfile --check          # zerotrain/commands/launch.py
    deepspeed --hostfile hostfile --master_addr node1 --module zerotrain train ...

Nothing here imports torch or deepspeed at module level: the CLI can check a hostfile on a login
node. Generated commands are lists of argv strings (see `shell_join` for printing).
"""
from __future__ import annotations

import base64
import json
import os
import re
import shlex
import socket
import subprocess
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence

from ..distributed.layout import WorldLayout
from ..errors import UserError

DEFAULT_MASTER_PORT = 29500
ENV_FILE_NAME = ".deepspeed_env"
# Interface variables the launcher should export on every host (gloo on CPU, NCCL on GPUs).
IFNAME_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")

_HOST_RE = re.compile(r"^(?P<host>[^\s#]+)\s+slots=(?P<slots>\S+)\s*$")


@dataclass(frozen=True)
class Host:
    """One hostfile line: a host name or address and how many ranks (slots) it runs."""

    name: str
    slots: int


# ----------------------------------------------------------------------------------------------
# hostfile

def parse_hostfile(text: str, source: str = "hostfile") -> list[Host]:
    """Parse DeepSpeed/OpenMPI hostfile text (`host slots=N` per line, `#` comments).

    Stricter than DeepSpeed, which ignores anything after `slots=N` on a line: extra words are
    an error here, because a silently ignored setting is a bug. Raises ValueError with one line.
    """
    hosts: list[Host] = []
    seen: dict[str, int] = {}
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        m = _HOST_RE.match(line)
        if not m:
            raise UserError(f"{source}:{lineno}: expected 'HOST slots=N', got {raw.strip()!r}")
        name, slots_text = m["host"], m["slots"]
        if not slots_text.isdigit() or int(slots_text) < 1:
            raise UserError(f"{source}:{lineno}: slots must be a positive integer, got {slots_text!r} for {name}")
        if name in seen:
            raise UserError(f"{source}:{lineno}: host {name} is listed twice (first on line {seen[name]}); "
                            "merge the lines into one 'HOST slots=N'")
        seen[name] = lineno
        hosts.append(Host(name, int(slots_text)))
    if not hosts:
        raise UserError(f"{source}: no hosts; add lines like 'node1 slots=2'")
    return hosts


def read_hostfile(path: str | os.PathLike) -> list[Host]:
    """Read and parse a hostfile; a missing file is a one-line ValueError."""
    p = Path(path)
    if not p.is_file():
        raise UserError(f"hostfile {path}: not found; create one with lines like 'node1 slots=2' "
                        "(see hostfile.example)")
    return parse_hostfile(p.read_text(), source=str(path))


def world_size(hosts: Sequence[Host]) -> int:
    """Total ranks the hostfile asks for."""
    return sum(h.slots for h in hosts)


def is_local(name: str) -> bool:
    """True for names that always mean this machine."""
    return name in ("localhost", "127.0.0.1", "::1")


# ----------------------------------------------------------------------------------------------
# reachability

def ssh_check_cmd(host: str, timeout: float = 5.0, port: Optional[int] = None) -> list[str]:
    """The ssh probe for one host: no prompts (BatchMode), short connect timeout, runs `true`."""
    cmd = ["ssh", "-o", "BatchMode=yes", "-o", f"ConnectTimeout={max(1, int(timeout))}"]
    if port is not None:
        cmd += ["-p", str(port)]
    return cmd + [host, "true"]


def check_host(host: str, timeout: float = 5.0, port: Optional[int] = None) -> Optional[str]:
    """None if `ssh host true` works without a password; else a short reason."""
    try:
        res = subprocess.run(ssh_check_cmd(host, timeout, port), stdin=subprocess.DEVNULL,
                             capture_output=True, text=True, timeout=timeout + 5)
    except FileNotFoundError:
        return "no ssh client installed (apt-get install openssh-client)"
    except subprocess.TimeoutExpired:
        return f"no answer within {timeout + 5:.0f}s"
    if res.returncode == 0:
        return None
    lines = [ln.strip() for ln in res.stderr.splitlines() if ln.strip()]
    return lines[-1] if lines else f"ssh exited with code {res.returncode}"


def check_hosts(hosts: Iterable[Host | str], timeout: float = 5.0, port: Optional[int] = None,
                skip_local: bool = False) -> dict[str, Optional[str]]:
    """Probe every host over ssh in parallel; {host: None if reachable else reason}, hostfile order."""
    names = [h.name if isinstance(h, Host) else h for h in hosts]
    todo = [n for n in names if not (skip_local and is_local(n))]
    results: dict[str, Optional[str]] = {n: None for n in names}
    if todo:
        with ThreadPoolExecutor(max_workers=min(32, len(todo))) as pool:
            for name, reason in zip(todo, pool.map(lambda n: check_host(n, timeout, port), todo)):
                results[name] = reason
    return results


def unreachable_lines(results: dict[str, Optional[str]]) -> list[str]:
    """One line per host that failed the ssh probe, naming the host, the reason and the fix."""
    return [f"host {name}: not reachable over passwordless ssh ({reason}); "
            f"check with: ssh -o BatchMode=yes {name} true"
            for name, reason in results.items() if reason is not None]


# ----------------------------------------------------------------------------------------------
# .deepspeed_env

def read_env_file(path: str | os.PathLike) -> dict[str, str]:
    """KEY=VALUE lines of a `.deepspeed_env` (missing file = empty)."""
    p = Path(path)
    env: dict[str, str] = {}
    if p.is_file():
        for lineno, line in enumerate(p.read_text().splitlines(), 1):
            if not line.strip():
                continue
            key, sep, value = line.partition("=")
            if not sep or not key.strip() or key.strip().startswith("#"):
                # The launcher splits EVERY line on '=' and dies (or exports garbage) on others.
                raise UserError(f"{path}:{lineno}: expected KEY=VALUE (no comments or blank lines: "
                                f"the deepspeed launcher reads every line), got {line!r}")
            env[key.strip()] = value.strip()
    return env


def ifname_env(ifname: str, nccl: bool = True) -> dict[str, str]:
    """Variables pinning gloo (and NCCL) to one network interface on every host."""
    if not re.fullmatch(r"[A-Za-z0-9_.:@-]{1,15}", ifname):
        raise UserError(f"--ifname {ifname!r} is not a network interface name (e.g. eth0, ib0)")
    env = {"GLOO_SOCKET_IFNAME": ifname}
    if nccl:
        env["NCCL_SOCKET_IFNAME"] = ifname
    return env


def write_env_file(path: str | os.PathLike, updates: dict[str, str]) -> dict[str, str]:
    """Merge `updates` into a `.deepspeed_env` (other keys kept); returns the resulting mapping.

    The deepspeed launcher reads `.deepspeed_env` from the launch directory (and ~) and exports
    each KEY=VALUE on every host before starting the ranks; it splits every line on '=', so the
    file holds no comments and no blank lines.
    """
    env = read_env_file(path)
    for key, value in updates.items():
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key) or "\n" in value:
            raise UserError(f"{path}: bad environment entry {key}={value!r}")
        env[key] = value
    Path(path).write_text("".join(f"{k}={v}\n" for k, v in env.items()))
    return env


# ----------------------------------------------------------------------------------------------
# world layout

def _ifname_address(ifname: str) -> Optional[str]:
    try:
        import psutil
    except ImportError:
        return None
    for a in psutil.net_if_addrs().get(ifname, []):
        if a.family == socket.AF_INET:
            return a.address
    return None


def local_identity(env: Optional[dict[str, str]] = None) -> dict:
    """Where this rank runs: global/local/node rank from the launcher's variables, host name and,
    when GLOO_SOCKET_IFNAME/NCCL_SOCKET_IFNAME is set, that interface's address (network
    namespaces and containers can share one host name)."""
    env = dict(os.environ) if env is None else env
    node = env.get("CROSS_RANK") or env.get("GROUP_RANK") or env.get("SLURM_NODEID") or env.get("OMPI_COMM_WORLD_NODE_RANK")
    ifname = next((env[v] for v in IFNAME_VARS if env.get(v)), None)
    return {
        "rank": int(env.get("RANK", env.get("OMPI_COMM_WORLD_RANK", env.get("SLURM_PROCID", "0")))),
        "local_rank": int(env.get("LOCAL_RANK", env.get("OMPI_COMM_WORLD_LOCAL_RANK", "0"))),
        "node_rank": int(node) if node is not None and node.isdigit() else None,
        "host": socket.gethostname(),
        "addr": _ifname_address(ifname) if ifname else None,
    }


def gather_identities() -> list[dict]:
    """Every rank's `local_identity()`, in rank order. A collective when torch.distributed is up:
    call it on ALL ranks (a rank that skips it hangs the others)."""
    me = local_identity()
    try:
        import torch.distributed as dist
    except ImportError:
        return [me]
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [me]
    me["rank"] = dist.get_rank()
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, me)
    return sorted(out, key=lambda e: e["rank"])


def format_world_layout(entries: Optional[list[dict]] = None, layout: Optional[WorldLayout] = None) -> str:
    """A short report of hosts x ranks, e.g.

        world: 2 hosts x 1 rank = 2 ranks
          node 0  10.231.0.1 (vm)  ranks 0
          node 1  10.231.0.2 (vm)  ranks 1

    With `entries=None` it gathers them (a collective: call on every rank, print on rank 0).
    layout (distributed/layout.WorldLayout): with tensor or pipeline parallelism, one more line says where their
    groups lie (tensor-parallel groups must stay inside a host: every layer all-reduces in them).
    """
    entries = gather_identities() if entries is None else entries
    groups: dict[tuple, list[dict]] = {}
    for e in entries:
        key = ("node", e["node_rank"]) if e.get("node_rank") is not None else ("host", e.get("host"), e.get("addr"))
        groups.setdefault(key, []).append(e)
    # order hosts by their lowest rank, so node 0 (the master) comes first
    ordered = sorted(groups.values(), key=lambda g: min(e["rank"] for e in g))
    counts = [len(g) for g in ordered]
    n_hosts, world = len(ordered), len(entries)
    if len(set(counts)) == 1:
        head = f"world: {n_hosts} host{'s' * (n_hosts != 1)} x {counts[0]} rank{'s' * (counts[0] != 1)} = {world} rank{'s' * (world != 1)}"
    else:
        head = f"world: {n_hosts} hosts ({'+'.join(map(str, counts))} ranks) = {world} ranks"
    lines = [head]
    for i, g in enumerate(ordered):
        first = g[0]
        node = first.get("node_rank") if first.get("node_rank") is not None else i
        where = f"{first['addr']} ({first['host']})" if first.get("addr") else str(first.get("host"))
        ranks = ",".join(str(e["rank"]) for e in sorted(g, key=lambda e: e["rank"]))
        lines.append(f"  node {node}  {where}  ranks {ranks}")
    if layout is not None:
        node_of = {e["rank"]: i for i, g in enumerate(ordered) for e in g}
        lines += _group_lines(layout, node_of)
    return "\n".join(lines)


def _group_lines(layout: WorldLayout, node_of: dict[int, int]) -> list[str]:
    """Where the tensor- and sequence-parallel groups (the innermost ranks; under sp x tp an sp group strides over
    its tp neighbours) and the pipeline stages of a WorldLayout (its groups and stages) sit, by node."""
    out = []
    for kind, dim, traffic in (("tensor-parallel", "tp", "every layer all-reduces"),
                               ("sequence-parallel", "sp", "every attention all-to-alls")):
        size = layout.degrees[dim]
        if size == 1:
            continue
        groups = layout.groups(dim)
        split = [g for g in groups if len({node_of.get(r) for r in g}) > 1]
        where = ", ".join(f"ranks {_span(g)} on node {node_of.get(g[0])}" for g in groups if g not in split)
        if split:
            g = split[0]
            # a host must hold whole groups of this dimension and of those inside it (tp inside sp)
            inner = [d for d in ("sp", "tp") if layout.degrees[d] > 1 and (d == dim or dim == "sp")]
            flags = " x ".join(f"--{d}" for d in inner)
            out.append(f"  warning: {kind} group ranks {_span(g)} spans nodes "
                       f"{sorted({node_of.get(r) for r in g})}: {traffic} over the network; "
                       f"give every host a multiple of {flags} ranks")
        else:
            out.append(f"  {kind} groups of {size} inside a host: {where}")
    if layout.pp > 1:
        stages = list(layout.stages())  # every rank of a stage: dp x sp x tp
        out.append("  pipeline stages: " + ", ".join(
            f"stage {i} ranks {g[0]}-{g[-1]} (node {'/'.join(str(n) for n in sorted({node_of.get(r) for r in g}))})"
            for i, g in enumerate(stages)))
        # a composed layout names every group: which ranks pass one micro-batch along, which replicate a stage
        out.append("  pipeline groups (a micro-batch's path): " + _ranks_of(layout.groups("pp"), ">"))
        if layout.dp > 1:
            out.append("  data-parallel groups (a stage's replicas): " + _ranks_of(layout.groups("dp"), ","))
    return out


def _span(group: list[int]) -> str:
    """A group's ranks as "0-1" when they are neighbours, else "0,2" (an sp group under sp x tp)."""
    return f"{group[0]}-{group[-1]}" if group == list(range(group[0], group[-1] + 1)) else ",".join(map(str, group))


def _ranks_of(groups: list[list[int]], sep: str) -> str:
    """Rank groups as "0>2 | 1>3" (or "0,2 | 1,3" with sep ",") for the layout lines."""
    return " | ".join(sep.join(map(str, g)) for g in groups)


# ----------------------------------------------------------------------------------------------
# launch commands

def shell_join(cmd: Sequence[str]) -> str:
    """argv -> one shell-safe line."""
    return " ".join(shlex.quote(str(c)) for c in cmd)


def deepspeed_cmd(hostfile: str, train_args: Sequence[str], master_addr: str,
                  master_port: int = DEFAULT_MASTER_PORT, launcher: str = "pdsh",
                  node_rank: Optional[int] = None, module: str = "zerotrain") -> list[str]:
    """`deepspeed --hostfile H --master_addr A ... --module zerotrain <train_args>`.

    node_rank=None: the launcher reaches every host itself (pdsh over ssh, or `launcher`
    = openmpi/slurm/...). node_rank=N: `--no_ssh --node_rank N`, run once on each host by you.
    """
    cmd = ["deepspeed", "--hostfile", hostfile, "--master_addr", master_addr, "--master_port", str(master_port)]
    if node_rank is not None:
        cmd += ["--no_ssh", "--node_rank", str(node_rank)]
    elif launcher != "pdsh":
        cmd += ["--launcher", launcher]
    return cmd + ["--module", module, *train_args]


def world_info(hosts: Sequence[Host]) -> str:
    """DeepSpeed's --world_info: base64 of {"host": [slot indices]} (what `deepspeed` passes on)."""
    info = {h.name: list(range(h.slots)) for h in hosts}
    return base64.urlsafe_b64encode(json.dumps(info).encode()).decode()


def pdsh_cmd(hosts: Sequence[Host], train_args: Sequence[str], master_addr: str,
             master_port: int = DEFAULT_MASTER_PORT, workdir: str = ".", python: str = "python",
             env: Optional[dict[str, str]] = None, module: str = "zerotrain") -> list[str]:
    """The pdsh command the deepspeed launcher runs (for debugging ssh/pdsh by hand): on every
    host, cd to the shared workdir, export `env`, and start that node's ranks with
    deepspeed.launcher.launch (pdsh replaces %n with the host's index)."""
    exports = "".join(f"export {k}={shlex.quote(v)}; " for k, v in (env or {}).items())
    remote = (f"{exports}cd {shlex.quote(workdir)}; {shlex.quote(python)} -u -m deepspeed.launcher.launch "
              f"--world_info={world_info(hosts)} --node_rank=%n --master_addr={master_addr} "
              f"--master_port={master_port} --module {module} {shell_join(train_args)}").strip()
    return ["pdsh", "-S", "-f", "1024", "-w", ",".join(h.name for h in hosts), remote]


def slurm_torchrun_cmd(train_args: Sequence[str], procs_per_node: int, master_port: int = DEFAULT_MASTER_PORT,
                       module: str = "zerotrain") -> list[str]:
    """Inside an sbatch allocation: one srun task per node, each running torchrun for its node's
    ranks; c10d rendezvous on the first node of the allocation ($MASTER_ADDR, set by the
    sbatch script from `scontrol show hostnames`). The inner command is single-quoted so the
    SLURM variables expand on each node, not on the submitting shell."""
    if procs_per_node < 1:
        raise UserError(f"procs per node must be >= 1 (got {procs_per_node})")
    inner = ("torchrun --nnodes=$SLURM_NNODES --node_rank=$SLURM_NODEID "
             f"--nproc_per_node={procs_per_node} --rdzv_backend=c10d --rdzv_id=$SLURM_JOB_ID "
             f"--rdzv_endpoint=$MASTER_ADDR:{master_port} -m {module} {shell_join(train_args)}").strip()
    # srun inside the allocation spans all its nodes; one task each, and one failed task ends the step
    return ["srun", "--ntasks-per-node=1", "--kill-on-bad-exit=1", "bash", "-c", inner]


def parse_elastic(spec: str) -> tuple[int, int]:
    """--elastic MIN:MAX (or N) -> (min nodes, max nodes)."""
    parts = spec.split(":")
    try:
        lo, hi = (int(parts[0]), int(parts[-1])) if len(parts) in (1, 2) else (0, 0)
    except ValueError:
        lo = hi = 0
    if not 1 <= lo <= hi:
        raise UserError(f"--elastic {spec}: give MIN:MAX nodes with 1 <= MIN <= MAX (e.g. --elastic 1:2)")
    return lo, hi


def elastic_cmd(train_args: Sequence[str], nnodes: tuple[int, int], nproc_per_node: int, max_restarts: int,
                rdzv_endpoint: str, rdzv_id: str = "zerotrain", python: str = "python",
                module: str = "zerotrain", rdzv_conf: Optional[str] = None,
                local_addr: Optional[str] = None) -> list[str]:
    """torchrun under torch's elastic agent on THIS host (run it on every host of the job): a worker group of
    MIN..MAX nodes meets at the c10d rendezvous on `rdzv_endpoint` (hosted by the agent whose host has that
    address: the single point of failure of an elastic job); when a worker dies the agent stops the others
    and starts the group again, up to `max_restarts` times, on the nodes still there."""
    lo, hi = nnodes
    return [python, "-m", "torch.distributed.run", f"--nnodes={lo}:{hi}", f"--nproc-per-node={nproc_per_node}",
            f"--max-restarts={max_restarts}", "--rdzv-backend=c10d", f"--rdzv-endpoint={rdzv_endpoint}",
            f"--rdzv-id={rdzv_id}", *([f"--rdzv-conf={rdzv_conf}"] if rdzv_conf else []),
            *([f"--local-addr={local_addr}"] if local_addr else []), "-m", module, *train_args]


def slurm_hostfile_lines(nodes: Sequence[str], slots: int) -> list[str]:
    """Hostfile lines for the deepspeed `--launcher slurm` variant, from `scontrol show hostnames`."""
    if slots < 1:
        raise UserError(f"slots per node must be >= 1 (got {slots})")
    if not nodes:
        raise UserError("no SLURM nodes given (is SLURM_JOB_NODELIST set? run inside sbatch/salloc)")
    return [f"{n} slots={slots}" for n in nodes]


def mpirun_cmd(hosts: Sequence[Host], train_args: Sequence[str], master_addr: str,
               master_port: int = DEFAULT_MASTER_PORT, ifname: Optional[str] = None,
               python: str = "python", module: str = "zerotrain") -> list[str]:
    """OpenMPI: `mpirun -np W -H h1:s1,h2:s2 ...` starting every rank directly.

    torch.distributed reads RANK/WORLD_SIZE/LOCAL_RANK, which OpenMPI does not set (DeepSpeed's
    own MPI discovery needs mpi4py), so each rank maps OpenMPI's variables in a `bash -c` prologue.
    MASTER_ADDR/PORT and the interface variables are passed with -x.
    """
    cmd = ["mpirun", "-np", str(world_size(hosts)), "-H", ",".join(f"{h.name}:{h.slots}" for h in hosts),
           "--bind-to", "none", "--map-by", "slot",
           "-x", f"MASTER_ADDR={master_addr}", "-x", f"MASTER_PORT={master_port}", "-x", "PATH", "-x", "PYTHONPATH"]
    if ifname:
        for k, v in ifname_env(ifname).items():
            cmd += ["-x", f"{k}={v}"]
        cmd += ["--mca", "btl_tcp_if_include", ifname, "--mca", "oob_tcp_if_include", ifname]
    inner = ("RANK=$OMPI_COMM_WORLD_RANK WORLD_SIZE=$OMPI_COMM_WORLD_SIZE LOCAL_RANK=$OMPI_COMM_WORLD_LOCAL_RANK "
             "LOCAL_WORLD_SIZE=$OMPI_COMM_WORLD_LOCAL_SIZE CROSS_RANK=$OMPI_COMM_WORLD_NODE_RANK "
             f"exec {shlex.quote(python)} -u -m {module} {shell_join(train_args)}").strip()
    return cmd + ["bash", "-c", inner]


# ----------------------------------------------------------------------------------------------
# watching a pdsh launch: which host failed

# pdsh reports a host whose remote command failed as "pdsh@<launcher>: <host>: ssh exited with exit code N".
_PDSH_EXIT_RE = re.compile(r"^pdsh@[^:]+: (?P<host>[^:\s]+): ssh exited with exit code (?P<code>\d+)")


def parse_pdsh_failure(line: str) -> Optional[tuple[str, int]]:
    """(host, exit code) from pdsh's per-host failure line, else None."""
    m = _PDSH_EXIT_RE.match(line.strip())
    return (m["host"], int(m["code"])) if m else None


def describe_exit(code: int) -> str:
    """'exit 1' or 'killed by SIGKILL' for a remote launcher's exit code (ssh reports 256-N for signal N)."""
    import signal as _signal
    if code > 128:
        try:
            return f"a rank was killed by {_signal.Signals(256 - code).name}" if code > 192 else \
                f"killed by {_signal.Signals(code - 128).name}"
        except ValueError:
            pass
    return f"exit code {code}"


def lost_host_line(host: str, code: int) -> str:
    """The one line that names a lost host."""
    return f"zerotrain launch: lost host {host} ({describe_exit(code)}); the job is stopping on every host"


def env_from_scheduler(environ: dict[str, str]) -> dict[str, str]:
    """RANK/LOCAL_RANK/WORLD_SIZE (+ LOCAL_WORLD_SIZE, CROSS_RANK) from SLURM or OpenMPI variables,
    for ranks started directly by srun/mpirun; {} when RANK is already set or no scheduler is seen.
    MASTER_ADDR/MASTER_PORT must come from the job script (both launch recipes export them)."""
    if "RANK" in environ:
        return {}
    for prefix, rank, local, world, local_size, node in (
            ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_SIZE",
             "OMPI_COMM_WORLD_LOCAL_SIZE", "OMPI_COMM_WORLD_NODE_RANK"),
            ("SLURM_PROCID", "SLURM_PROCID", "SLURM_LOCALID", "SLURM_NTASKS", "SLURM_NTASKS_PER_NODE", "SLURM_NODEID")):
        if prefix in environ:
            out = {"RANK": environ[rank], "LOCAL_RANK": environ.get(local, "0"), "WORLD_SIZE": environ.get(world, "1")}
            # SLURM_NTASKS_PER_NODE can read "4(x2)"; keep only a plain number
            if environ.get(local_size, "").isdigit():
                out["LOCAL_WORLD_SIZE"] = environ[local_size]
            if environ.get(node, "").isdigit():
                out["CROSS_RANK"] = environ[node]
            return out
    return {}
