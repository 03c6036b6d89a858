"""`zerotrain launch`: check the hosts, then run the deepspeed launcher over them and watch it.

    zerotrain launch --hostfile hostfile --master-addr node1 --ifname eth0 -- train --stage 3 --output runs/x
    zerotrain launch --hostfile hostfile --check              # only the reachability check + layout
    zerotrain launch --hostfile hostfile --print slurm -- train ...   # show a launch command, run nothing
    zerotrain launch --elastic 1:2 --max-restarts 3 --nproc-per-node 8 --rdzv-endpoint node1:29400 \
        -- train --stage 3 --save-every 100 --output runs/x      # on every host: restarts by itself

--elastic runs torchrun under torch's elastic agent on this host (no hostfile, no ssh: start the same command
on every host, e.g. with srun). When a worker dies the agent stops the rest and starts the worker group again
(up to --max-restarts times) on the hosts still there; the ranks' `--resume auto` continues from the newest
complete checkpoint, keeping the global batch on a smaller world (zerotrain/plan/resolve.py keep_global_batch).

Before launching: every hostfile entry must answer `ssh -o BatchMode=yes` (in parallel, short
timeout; one line per bad host), and `--ifname` is written to `.deepspeed_env` as
GLOO_SOCKET_IFNAME/NCCL_SOCKET_IFNAME, which the launcher exports on every host. While running:
when a host fails, its name is printed in one line, and if the other hosts have not ended
`--grace` seconds later (e.g. a rank stuck outside a collective, where --dist-timeout cannot
reach it) the launcher is told to stop them all (it runs `pkill` on every host through pdsh).
"""
from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from ..errors import UserError
from ..launch import launchers as L


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--hostfile", default=None,
                   help="lines 'HOST slots=N' (see hostfile.example); needed except with --elastic")
    p.add_argument("--master-addr", default=None,
                   help="address of the first host as the others reach it (default: the first hostfile entry)")
    p.add_argument("--master-port", type=int, default=L.DEFAULT_MASTER_PORT)
    p.add_argument("--ifname", default=None,
                   help="network interface every host uses for the job (e.g. eth0); written to .deepspeed_env")
    p.add_argument("--ssh-timeout", type=float, default=5.0, help="seconds for each host's ssh check")
    p.add_argument("--grace", type=float, default=30.0,
                   help="seconds after a host fails before the remaining hosts are stopped")
    p.add_argument("--check", action="store_true", help="only check the hosts and print the layout")
    p.add_argument("--print", dest="print_launcher", choices=["deepspeed", "pdsh", "slurm", "mpi", "torchrun"],
                   default=None, help="print the launch command for this launcher and exit (torchrun: --elastic's)")
    p.add_argument("--elastic", default=None, metavar="MIN:MAX",
                   help="run under torch's elastic agent on this host: a job of MIN..MAX nodes that restarts its "
                        "workers by itself (start the same command on every host)")
    p.add_argument("--max-restarts", type=int, default=3, help="--elastic: worker-group restarts before giving up")
    p.add_argument("--nproc-per-node", type=int, default=None,
                   help="--elastic: ranks on this host (default: its GPUs, or 1 without GPUs)")
    p.add_argument("--rdzv-endpoint", default=None, metavar="HOST:PORT",
                   help="--elastic: the rendezvous (default --master-addr or 127.0.0.1, port 29400); the host "
                        "with this address hosts it: if that host is lost, the job is")
    p.add_argument("--rdzv-id", default="zerotrain", help="--elastic: the job's id, the same on every host")
    p.add_argument("--local-addr", default=None, metavar="ADDR",
                   help="--elastic: this host's address as the other hosts reach it (default: its hostname, which "
                        "must resolve to such an address on every host)")
    p.add_argument("--rdzv-conf", default=None, metavar="K=V,...",
                   help="--elastic: torchrun's rendezvous settings, e.g. last_call_timeout=5 (seconds the rendezvous "
                        "waits for more nodes once MIN have joined; torch's default 30)")
    p.add_argument("rest", nargs=argparse.REMAINDER, metavar="-- train ARGS",
                   help="the zerotrain command the ranks run, e.g. -- train --stage 3")


def _train_args(rest: list[str]) -> list[str]:
    args = rest[1:] if rest[:1] == ["--"] else rest
    if not args:
        raise UserError("nothing to launch; give the rank command after --, e.g. -- train --stage 3 --output runs/x")
    return args


def run(args: argparse.Namespace) -> int:
    if args.elastic is not None or args.print_launcher == "torchrun":
        return run_elastic(args)
    if args.hostfile is None:
        raise UserError("zerotrain launch needs --hostfile HOSTFILE (or --elastic MIN:MAX to run under torch's "
                        "elastic agent on this host)")
    for flag, value in (("--nproc-per-node", args.nproc_per_node), ("--rdzv-endpoint", args.rdzv_endpoint),
                        ("--rdzv-conf", args.rdzv_conf), ("--local-addr", args.local_addr)):
        if value is not None:
            raise UserError(f"{flag} is a setting of --elastic; pass --elastic MIN:MAX, or drop {flag}")
    hosts = L.read_hostfile(args.hostfile)
    master = args.master_addr or hosts[0].name
    if args.print_launcher:
        print(L.shell_join(_command(args, hosts, master, _train_args(args.rest))))
        return 0

    per_host = ", ".join(f"{h.name} x{h.slots}" for h in hosts)
    print(f"zerotrain launch: {len(hosts)} host(s), {L.world_size(hosts)} ranks: {per_host}; master {master}",
          flush=True)
    bad = L.unreachable_lines(L.check_hosts(hosts, timeout=args.ssh_timeout))
    if bad:
        for line in bad:
            print(f"zerotrain launch: {line}", file=sys.stderr)
        return 1
    print("zerotrain launch: every host answers over ssh", flush=True)
    if args.ifname:
        env = L.write_env_file(Path.cwd() / L.ENV_FILE_NAME, L.ifname_env(args.ifname))
        print(f"zerotrain launch: {L.ENV_FILE_NAME}: {' '.join(f'{k}={v}' for k, v in env.items())}", flush=True)
    elif len(hosts) > 1 and not _env_has_ifname():
        print(f"zerotrain launch: warning: no GLOO_SOCKET_IFNAME/NCCL_SOCKET_IFNAME in {L.ENV_FILE_NAME}; "
              "pass --ifname if ranks fail to connect (e.g. 'Gloo connectFullMesh failed')", file=sys.stderr)
    if args.check:
        return 0
    cmd = _command(args, hosts, master, _train_args(args.rest))
    # the `deepspeed` script may not be on PATH (venv not activated): run its module with this python
    return supervise([sys.executable, "-m", "deepspeed.launcher.runner", *cmd[1:]], args.grace)


ELASTIC_RDZV_PORT = 29400


def elastic_train_args(train: list[str]) -> tuple[list[str], list[str]]:
    """The ranks' command under --elastic, and the lines to print about it: a restarted worker group must
    resume from the newest complete checkpoint (--resume auto, added when absent); a run that never saves
    restarts from step 0 (said)."""
    notes = []
    resume = [a for a in train if a == "--resume" or a.startswith("--resume=")]
    if not resume:
        train = [*train, "--resume", "auto"]
        notes.append("--resume auto added to the ranks' command: a restarted worker group continues from the newest "
                     "complete checkpoint")
    else:
        i = train.index(resume[0])
        value = resume[0].split("=", 1)[1] if "=" in resume[0] else (train[i + 1] if i + 1 < len(train) else "")
        if value != "auto":
            raise UserError(f"--elastic: the ranks' command has --resume {value or 'latest'}; a restarted worker "
                            "group needs --resume auto (resume when a checkpoint exists, start fresh when not)")
    if not any(a == "--save-every" or a.startswith("--save-every=") for a in train):
        notes.append("warning: no --save-every in the ranks' command: a restart recomputes from step 0 (pass "
                     "--save-every N to lose at most N steps)")
    return train, notes


def run_elastic(args: argparse.Namespace) -> int:
    if args.hostfile is not None:
        raise UserError("--elastic runs on this host only (no hostfile, no ssh): drop --hostfile and start the same "
                        "`zerotrain launch --elastic ...` on every host (e.g. srun)")
    if args.max_restarts < 0:
        raise UserError(f"--max-restarts {args.max_restarts}: must be >= 0")
    nnodes = L.parse_elastic(args.elastic or "1:1")
    nproc = args.nproc_per_node
    if nproc is None:
        import torch

        nproc = torch.cuda.device_count() or 1
    if nproc < 1:
        raise UserError(f"--nproc-per-node {nproc}: must be >= 1")
    endpoint = args.rdzv_endpoint or f"{args.master_addr or '127.0.0.1'}:{ELASTIC_RDZV_PORT}"
    train, notes = elastic_train_args(_train_args(args.rest))
    if nnodes[0] != nnodes[1] and any(a == "--streaming" for a in train):
        raise UserError(f"--elastic {args.elastic} with --streaming: a restart on another number of nodes cannot "
                        "resume a stream exactly (its positions are per data-parallel rank); pass --elastic N:N "
                        "(restarts on the same world) or drop --streaming")
    cmd = L.elastic_cmd(train, nnodes, nproc, args.max_restarts, endpoint, args.rdzv_id, python=sys.executable,
                        rdzv_conf=args.rdzv_conf, local_addr=args.local_addr)
    if args.print_launcher:
        print(L.shell_join(cmd))
        return 0
    print(f"zerotrain launch: elastic job of {nnodes[0]}..{nnodes[1]} node(s) x {nproc} rank(s), up to "
          f"{args.max_restarts} restart(s); rendezvous {endpoint} (the host with that address holds it)", flush=True)
    for note in notes:
        print(f"zerotrain launch: {note}", flush=True)
    proc = subprocess.Popen(cmd)
    # the agent handles SIGTERM itself (stops its workers): pass a scheduler's signal on, then wait for it
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, _frame: proc.send_signal(signum))
    return proc.wait()


def _env_has_ifname() -> bool:
    env = L.read_env_file(Path.cwd() / L.ENV_FILE_NAME)
    return any(k in env for k in L.IFNAME_VARS)


def _command(args: argparse.Namespace, hosts: list[L.Host], master: str, train: list[str]) -> list[str]:
    which = args.print_launcher or "deepspeed"
    if which == "deepspeed":
        return L.deepspeed_cmd(args.hostfile, train, master, args.master_port)
    if which == "pdsh":
        env = L.ifname_env(args.ifname) if args.ifname else None
        return L.pdsh_cmd(hosts, train, master, args.master_port, workdir=os.getcwd(), python=sys.executable, env=env)
    if which == "slurm":
        return L.slurm_torchrun_cmd(train, hosts[0].slots, args.master_port)
    return L.mpirun_cmd(hosts, train, master, args.master_port, ifname=args.ifname, python=sys.executable)


def supervise(cmd: list[str], grace: float) -> int:
    """Run the deepspeed launcher, pass its output through, name a lost host, stop the stragglers."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
    lost: list[tuple[str, int]] = []

    def stop_after_grace() -> None:
        deadline = time.monotonic() + grace
        while proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.5)
        if proc.poll() is None:
            print(f"zerotrain launch: hosts still running {grace:.0f}s after {lost[0][0]} failed; stopping them",
                  file=sys.stderr, flush=True)
            proc.send_signal(signal.SIGTERM)  # the launcher's handler pkills the job on every host

    assert proc.stdout is not None
    for line in proc.stdout:
        sys.stdout.write(line)
        failure = L.parse_pdsh_failure(line)
        if failure and failure[1] != 0:
            first = not lost
            lost.append(failure)
            if first:
                print(L.lost_host_line(*failure), file=sys.stderr, flush=True)
                threading.Thread(target=stop_after_grace, daemon=True).start()
    code = proc.wait()
    if lost:
        names = ", ".join(f"{h} ({L.describe_exit(c)})" for h, c in lost)
        print(f"zerotrain launch: job failed; first lost host {lost[0][0]}; hosts that failed: {names}",
              file=sys.stderr, flush=True)
        return code or 1
    return code
