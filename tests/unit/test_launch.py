"""Unit tests for zerotrain.launch.launchers: hostfile parsing and errors, .deepspeed_env, world layout,
generated launch commands (deepspeed/pdsh, SLURM, OpenMPI), pdsh failure parsing, the scripts' syntax."""
from __future__ import annotations

import base64
import json
import shlex
import shutil
import socket
import subprocess
from pathlib import Path

import pytest

from zerotrain.cli import main as cli_main
from zerotrain.launch import launchers as L

REPO = Path(__file__).resolve().parents[2]


# ---------------------------------------------------------------- hostfile

def test_parse_hostfile_comments_blank_and_trailing_comment():
    text = "# cluster\n\nnode1 slots=4\n  node2   slots=2   # second\n"
    assert L.parse_hostfile(text) == [L.Host("node1", 4), L.Host("node2", 2)]
    assert L.world_size(L.parse_hostfile(text)) == 6


@pytest.mark.parametrize("text, needle", [
    ("node1\n", "hostfile:1: expected 'HOST slots=N'"),
    ("node1 slots=2 gpus=4\n", "expected 'HOST slots=N'"),      # DeepSpeed would ignore 'gpus=4' silently
    ("node1 slots=0\n", "slots must be a positive integer"),
    ("node1 slots=two\n", "slots must be a positive integer"),
    ("node1 slots=1\nnode2 slots=1\nnode1 slots=2\n", "hostfile:3: host node1 is listed twice (first on line 1)"),
    ("# only comments\n\n", "no hosts"),
])
def test_parse_hostfile_errors_are_one_line(text, needle):
    with pytest.raises(ValueError) as e:
        L.parse_hostfile(text)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_read_hostfile_missing(tmp_path):
    with pytest.raises(ValueError, match="not found"):
        L.read_hostfile(tmp_path / "nope")


def test_hostfile_example_is_the_single_node_line():
    hosts = L.read_hostfile(REPO / "hostfile.example")
    assert hosts == [L.Host("localhost", 2)]
    # every commented-out example in it is a valid line too
    examples = [ln.lstrip("# ").rstrip() for ln in (REPO / "hostfile.example").read_text().splitlines()
                if ln.startswith("# ") and "slots=" in ln and not ln.startswith("#  ")]
    for ex in examples:
        if L._HOST_RE.match(ex.split("#")[0].strip()):
            L.parse_hostfile(ex)


def test_deepspeed_parses_our_hostfiles_the_same():
    runner = pytest.importorskip("deepspeed.launcher.runner")
    text = "node1 slots=4\nnode2 slots=2\n"
    assert dict(runner._parse_hostfile(text.splitlines(True))) == {h.name: h.slots for h in L.parse_hostfile(text)}


# ---------------------------------------------------------------- reachability (loopback only)

def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again when the socket closes


@pytest.mark.skipif(shutil.which("ssh") is None, reason="no ssh client")
def test_unreachable_host_is_named_in_one_line():
    res = L.check_hosts(["127.0.0.1", "localhost"], timeout=3, port=_closed_port(), skip_local=False)
    lines = L.unreachable_lines(res)
    assert len(lines) == 2
    assert lines[0].startswith("host 127.0.0.1: not reachable over passwordless ssh (")
    assert "Connection refused" in lines[0] and "\n" not in lines[0]


def test_check_hosts_skip_local_and_order():
    res = L.check_hosts([L.Host("localhost", 1), L.Host("127.0.0.1", 1)], skip_local=True)
    assert res == {"localhost": None, "127.0.0.1": None}
    assert L.ssh_check_cmd("n1", 2.5, 2222) == ["ssh", "-o", "BatchMode=yes", "-o", "ConnectTimeout=2",
                                                 "-p", "2222", "n1", "true"]


# ---------------------------------------------------------------- .deepspeed_env

def test_env_file_merge_and_format(tmp_path):
    f = tmp_path / ".deepspeed_env"
    f.write_text("PYTHONPATH=/shared/code\nGLOO_SOCKET_IFNAME=old\n")
    env = L.write_env_file(f, L.ifname_env("eth1"))
    assert env == {"PYTHONPATH": "/shared/code", "GLOO_SOCKET_IFNAME": "eth1", "NCCL_SOCKET_IFNAME": "eth1"}
    text = f.read_text()
    # the launcher splits every line on '=': no comments, no blank lines
    assert all("=" in ln and not ln.startswith("#") for ln in text.splitlines()) and "\n\n" not in text


def test_env_file_the_launcher_reads_it(tmp_path):
    """Round-trip through the same parsing the deepspeed runner uses (split on the first '=')."""
    f = tmp_path / ".deepspeed_env"
    L.write_env_file(f, {"GLOO_SOCKET_IFNAME": "ztnet0", "X": "a=b"})
    parsed = dict(line.split("=", maxsplit=1) for line in f.read_text().splitlines(True))
    assert {k: v.strip() for k, v in parsed.items()} == {"GLOO_SOCKET_IFNAME": "ztnet0", "X": "a=b"}


def test_env_file_errors(tmp_path):
    f = tmp_path / ".deepspeed_env"
    f.write_text("# a comment\n")
    with pytest.raises(ValueError, match="no comments"):
        L.read_env_file(f)
    with pytest.raises(ValueError, match="not a network interface"):
        L.ifname_env("eth0; rm -rf /")


# ---------------------------------------------------------------- world layout

def _e(rank, node, host="vm", addr=None):
    return {"rank": rank, "local_rank": 0, "node_rank": node, "host": host, "addr": addr}


def test_world_layout_two_hosts():
    text = L.format_world_layout([_e(0, 0, addr="10.231.0.1"), _e(1, 1, addr="10.231.0.2")])
    assert text.splitlines() == ["world: 2 hosts x 1 rank = 2 ranks",
                                 "  node 0  10.231.0.1 (vm)  ranks 0",
                                 "  node 1  10.231.0.2 (vm)  ranks 1"]


def test_world_layout_uneven_and_by_hostname():
    entries = [dict(_e(r, None, host=h)) for r, h in [(0, "a"), (1, "a"), (2, "b")]]
    assert L.format_world_layout(entries).splitlines() == [
        "world: 2 hosts (2+1 ranks) = 3 ranks", "  node 0  a  ranks 0,1", "  node 1  b  ranks 2"]


def test_world_layout_single_process():
    assert L.format_world_layout().startswith("world: 1 host x 1 rank = 1 rank")


def test_local_identity_from_launcher_env():
    me = L.local_identity({"RANK": "3", "LOCAL_RANK": "1", "CROSS_RANK": "1"})
    assert (me["rank"], me["local_rank"], me["node_rank"]) == (3, 1, 1)
    assert L.local_identity({"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_NODE_RANK": "1"})["rank"] == 2
    assert L.local_identity({"GROUP_RANK": "0"})["node_rank"] == 0


# ---------------------------------------------------------------- generated commands

HOSTS = [L.Host("node1", 2), L.Host("node2", 2)]
TRAIN = ["train", "--stage", "3", "--output", "runs/my run"]


def test_deepspeed_cmd_pdsh_no_ssh_and_other_launchers():
    assert L.deepspeed_cmd("hf", TRAIN, "node1") == [
        "deepspeed", "--hostfile", "hf", "--master_addr", "node1", "--master_port", "29500",
        "--module", "zerotrain", *TRAIN]
    cmd = L.deepspeed_cmd("hf", TRAIN, "127.0.0.1", 1234, node_rank=1)
    assert cmd[cmd.index("--no_ssh"):cmd.index("--module")] == ["--no_ssh", "--node_rank", "1"]
    assert "--launcher" in L.deepspeed_cmd("hf", TRAIN, "n", launcher="slurm")


def test_pdsh_cmd_matches_deepspeed_world_info():
    cmd = L.pdsh_cmd(HOSTS, TRAIN, "node1", 29501, workdir="/shared/w", python="/venv/bin/python",
                     env={"GLOO_SOCKET_IFNAME": "eth1"})
    assert cmd[:6] == ["pdsh", "-S", "-f", "1024", "-w", "node1,node2"]
    remote = cmd[6]
    assert remote.startswith("export GLOO_SOCKET_IFNAME=eth1; cd /shared/w; /venv/bin/python -u -m deepspeed.launcher.launch")
    assert "--node_rank=%n" in remote and "--master_addr=node1 --master_port=29501" in remote
    assert shlex.split(remote)[-len(TRAIN):] == TRAIN
    info = remote.split("--world_info=")[1].split()[0]
    assert json.loads(base64.urlsafe_b64decode(info)) == {"node1": [0, 1], "node2": [0, 1]}
    enc = pytest.importorskip("deepspeed.launcher.runner").encode_world_info
    assert info == enc({"node1": [0, 1], "node2": [0, 1]})


def test_slurm_torchrun_cmd():
    cmd = L.slurm_torchrun_cmd(TRAIN, procs_per_node=4, master_port=29600)
    assert cmd[:5] == ["srun", "--ntasks-per-node=1", "--kill-on-bad-exit=1", "bash", "-c"]
    inner = cmd[5]
    for part in ["torchrun --nnodes=$SLURM_NNODES --node_rank=$SLURM_NODEID", "--nproc_per_node=4",
                 "--rdzv_backend=c10d", "--rdzv_id=$SLURM_JOB_ID", "--rdzv_endpoint=$MASTER_ADDR:29600",
                 "-m zerotrain train --stage 3 --output 'runs/my run'"]:
        assert part in inner
    with pytest.raises(ValueError):
        L.slurm_torchrun_cmd(TRAIN, 0)


def test_slurm_hostfile_lines():
    assert L.slurm_hostfile_lines(["gpu01", "gpu02"], 8) == ["gpu01 slots=8", "gpu02 slots=8"]
    with pytest.raises(ValueError, match="SLURM_JOB_NODELIST"):
        L.slurm_hostfile_lines([], 8)


def test_mpirun_cmd():
    cmd = L.mpirun_cmd(HOSTS, TRAIN, "node1", ifname="ib0", python="/venv/bin/python")
    assert cmd[:5] == ["mpirun", "-np", "4", "-H", "node1:2,node2:2"]
    joined = " ".join(cmd[:-1])
    for part in ["-x MASTER_ADDR=node1", "-x MASTER_PORT=29500", "-x GLOO_SOCKET_IFNAME=ib0",
                 "--mca btl_tcp_if_include ib0", "--mca oob_tcp_if_include ib0"]:
        assert part in joined
    inner = cmd[-1]
    assert "RANK=$OMPI_COMM_WORLD_RANK WORLD_SIZE=$OMPI_COMM_WORLD_SIZE LOCAL_RANK=$OMPI_COMM_WORLD_LOCAL_RANK" in inner
    assert inner.endswith("exec /venv/bin/python -u -m zerotrain train --stage 3 --output 'runs/my run'")


@pytest.mark.skipif(shutil.which("bash") is None, reason="no bash")
def test_generated_inner_commands_are_valid_shell():
    for inner in (L.slurm_torchrun_cmd(TRAIN, 2)[-1], L.mpirun_cmd(HOSTS, TRAIN, "n")[-1]):
        subprocess.run(["bash", "-n", "-c", inner], check=True)


# ---------------------------------------------------------------- pdsh failure lines

def test_parse_pdsh_failure_and_describe():
    assert L.parse_pdsh_failure("pdsh@vm: 10.231.0.2: ssh exited with exit code 247\n") == ("10.231.0.2", 247)
    assert L.parse_pdsh_failure("10.231.0.2: step 3 loss 1.0") is None
    assert L.describe_exit(247) == "a rank was killed by SIGKILL"
    assert L.describe_exit(1) == "exit code 1"
    assert "lost host node2" in L.lost_host_line("node2", 1)


# ---------------------------------------------------------------- CLI and scripts

def test_cli_launch_print_and_errors(tmp_path, capsys):
    hf = tmp_path / "hostfile"
    hf.write_text("node1 slots=2\nnode2 slots=2\n")
    assert cli_main(["launch", "--hostfile", str(hf), "--print", "mpi", "--", *TRAIN]) == 0
    assert capsys.readouterr().out.startswith("mpirun -np 4 -H node1:2,node2:2")
    assert cli_main(["launch", "--hostfile", str(tmp_path / "missing"), "--check"]) == 2
    assert "not found" in capsys.readouterr().err
    assert cli_main(["launch", "--hostfile", str(hf), "--print", "deepspeed"]) == 2
    assert "nothing to launch" in capsys.readouterr().err


SCRIPTS = ["netns_cluster.sh", "cluster_up.sh", "cluster_down.sh", "launch_single_node.sh",
           "launch_multi_node.sh", "launch_slurm.sbatch", "launch_mpi.sh", "slurm_elastic.sbatch"]


@pytest.mark.parametrize("name", SCRIPTS)
def test_scripts_parse(name):
    path = REPO / "scripts" / name
    assert path.is_file(), f"missing scripts/{name}"
    subprocess.run(["bash", "-n", str(path)], check=True)


def test_ci_setup_script_parses():
    subprocess.run(["bash", "-n", str(REPO / ".ci" / "multihost_setup.sh")], check=True)


def test_env_from_scheduler():
    assert L.env_from_scheduler({"RANK": "0", "SLURM_PROCID": "3"}) == {}
    assert L.env_from_scheduler({}) == {}
    assert L.env_from_scheduler({"SLURM_PROCID": "3", "SLURM_LOCALID": "1", "SLURM_NTASKS": "4",
                                 "SLURM_NTASKS_PER_NODE": "2", "SLURM_NODEID": "1"}) == {
        "RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "CROSS_RANK": "1"}
    assert L.env_from_scheduler({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2",
                                 "SLURM_NTASKS_PER_NODE": "4(x2)"})["WORLD_SIZE"] == "2"


def _fake_bin(tmp_path: Path, name: str, body: str) -> None:
    f = tmp_path / "bin" / name
    f.parent.mkdir(exist_ok=True)
    f.write_text("#!/bin/sh\n" + body)
    f.chmod(0o755)


def test_slurm_sbatch_dry_run_both_variants(tmp_path):
    import os
    import sys
    _fake_bin(tmp_path, "scontrol", 'printf "gpu01\\ngpu02\\n"\n')
    env = dict(os.environ, PATH=f"{tmp_path / 'bin'}:{os.environ['PATH']}", SLURM_JOB_NODELIST="gpu[01-02]",
               SLURM_JOB_ID="77", PROCS_PER_NODE="4", DRY_RUN="1", PYTHON=sys.executable, TMPDIR=str(tmp_path))
    env.pop("SLURM_SUBMIT_DIR", None)
    script = str(REPO / "scripts" / "launch_slurm.sbatch")
    out = subprocess.run(["bash", script, "--stage", "3"], env=env, capture_output=True, text=True, check=True).stdout
    assert "srun --ntasks-per-node=1 --kill-on-bad-exit=1 bash -c" in out
    assert "--nproc_per_node=4" in out and "--rdzv_endpoint=$MASTER_ADDR:29500 -m zerotrain train --stage 3" in out
    assert (tmp_path / "zerotrain-hostfile.77").read_text() == "gpu01 slots=4\ngpu02 slots=4\n"
    out = subprocess.run(["bash", script, "--stage", "3"], env=dict(env, LAUNCHER="deepspeed"),
                         capture_output=True, text=True, check=True).stdout
    assert "deepspeed --launcher slurm --hostfile" in out and "--master_addr gpu01" in out
    assert "scripts/zerotrain_main.py train --stage 3" in out


def test_slurm_elastic_saves_on_sigterm_then_requeues(tmp_path):
    """The elastic SLURM recipe: srun runs `zerotrain launch --elastic` on every node; the batch shell's SIGTERM
    (--signal=B:TERM@120) reaches srun first, the job is requeued only after srun ended (the ranks' save),
    and the script exits with the ranks' code. srun and scontrol are stand-ins that log what they were asked."""
    import os
    import signal
    import sys
    import time
    log = tmp_path / "log"
    _fake_bin(tmp_path, "scontrol", f'if [ "$1" = requeue ]; then echo "requeue $2" >> {log}; '
                                    'else printf "gpu01\\ngpu02\\n"; fi\n')
    _fake_bin(tmp_path, "srun", f'echo "srun $*" >> {log}\ntrap \'echo "srun got TERM" >> {log}; sleep 1; '
                                'exit 143\' TERM\nwhile true; do sleep 0.1; done\n')
    env = dict(os.environ, PATH=f"{tmp_path / 'bin'}:{os.environ['PATH']}", SLURM_JOB_NODELIST="gpu[01-02]",
               SLURM_JOB_ID="77", SLURM_NNODES="2", PROCS_PER_NODE="4", MIN_NODES="1", PYTHON=sys.executable)
    script = str(REPO / "scripts" / "slurm_elastic.sbatch")
    dry = subprocess.run(["bash", script, "--stage", "3"], env=dict(env, DRY_RUN="1"), capture_output=True,
                         text=True, check=True).stdout
    assert "launch --elastic 1:2 --max-restarts 3 --nproc-per-node 4 --rdzv-endpoint gpu01:29400" in dry, dry
    assert dry.rstrip().endswith("-- train --stage 3")
    job = subprocess.Popen(["bash", script, "--stage", "3"], env=env, stdout=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not (log.is_file() and "srun " in log.read_text()):
        time.sleep(0.1)
    job.send_signal(signal.SIGTERM)
    out, _ = job.communicate(timeout=30)
    assert job.returncode == 143, out
    assert log.read_text().splitlines()[1:] == ["srun got TERM", "requeue 77"], log.read_text()


def test_mpi_and_multi_node_scripts_dry_run(tmp_path):
    import os
    import sys
    hf = tmp_path / "hostfile"
    hf.write_text("node1 slots=2\nnode2 slots=2\n")
    env = dict(os.environ, HOSTFILE=str(hf), IFNAME="eth1", DRY_RUN="1", PYTHON=sys.executable)
    out = subprocess.run(["bash", str(REPO / "scripts" / "launch_mpi.sh"), "--stage", "2"], env=env,
                         capture_output=True, text=True, check=True).stdout
    assert out.startswith("mpirun -np 4 -H node1:2,node2:2") and "btl_tcp_if_include eth1" in out
    out = subprocess.run(["bash", str(REPO / "scripts" / "launch_multi_node.sh"), "--stage", "2"], env=env,
                         capture_output=True, text=True, check=True).stdout
    assert out.startswith(f"deepspeed --hostfile {hf} --master_addr node1") and out.rstrip().endswith("train --stage 2")
    env.pop("HOSTFILE")
    out = subprocess.run(["bash", str(REPO / "scripts" / "launch_single_node.sh"), "--stage", "2"], env=env,
                         capture_output=True, text=True, check=True).stdout
    assert "--no_ssh --node_rank 0 --master_addr 127.0.0.1" in out and "hostfile.example" in out


@pytest.mark.parametrize("axis, name, what", [("sp", "sequence", "every attention all-to-alls"),
                                              ("tp", "tensor", "every layer all-reduces")])
def test_world_layout_names_where_model_parallel_groups_lie(axis, name, what):
    """sp and tp groups are the innermost ranks: inside a host when each host has a multiple of their degree ranks,
    else warned (tp's inside-a-host line is also what the slow two-host cell, tests/multirank/test_multihost_tp.py,
    reads from a real cluster)."""
    from zerotrain.distributed.layout import WorldLayout

    two_by_two = [_e(r, r // 2, addr=f"10.0.0.{r // 2}") for r in range(4)]
    assert L.format_world_layout(two_by_two, WorldLayout(4, **{axis: 2})).splitlines()[-1] == \
        f"  {name}-parallel groups of 2 inside a host: ranks 0-1 on node 0, ranks 2-3 on node 1"
    one_each = [_e(r, r, addr=f"10.0.0.{r}") for r in range(2)]
    assert L.format_world_layout(one_each, WorldLayout(2, **{axis: 2})).splitlines()[-1] == (
        f"  warning: {name}-parallel group ranks 0-1 spans nodes [0, 1]: {what} over the network; give every host a "
        f"multiple of --{axis} ranks")
