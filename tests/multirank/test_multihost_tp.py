"""Tensor parallelism across a real two-host cluster: tp=2 inside each host x dp=2 across the hosts.

scripts/netns_cluster.sh builds two hosts with two slots each (network namespaces with their own sshd
on 10.231.0.1/.2); `deepspeed --hostfile H --module zerotrain train --tp 2` reaches both through pdsh +
ssh. Ranks are ordered tensor-parallel innermost, so each tensor-parallel group (every layer's
all-reduce) stays inside one host and only the data-parallel gradient reduction crosses the network;
the world layout line must say so. The losses equal one plain process with the same global batch.

Needs root, `ip netns`, sshd and pdsh (.ci/multihost_setup.sh installs them); otherwise it skips.
Its own module: the cluster here has 2 slots per host, tests/multirank/test_multihost.py's has 1, and a module's
cluster is torn down before the next module's comes up.
"""
from __future__ import annotations

import pytest

from tests.multirank.test_multihost import (
    DEEPSPEED,
    HOST1,
    HOST2,
    PY,
    _assert_same_losses,
    _cluster_skip_reason,
    _losses,
    netns_cluster,
)
from tests.support.launch import free_port, run
from zerotrain.launch import launchers as L

pytestmark = pytest.mark.multirank

STEPS = 6
GLOBAL_BATCH = 4  # micro 2 x dp 2 on the cluster; micro 4 in the one process
TRAIN = ["--model-config", "tiny-llama", "--backend", "fsdp", "--stage", "2", "--max-steps", str(STEPS),
         "--schedule", "constant", "--lr", "1e-3", "--seq-len", "64", "--dist-timeout", "30", "--save-every", "3"]


@pytest.fixture(scope="module")
def cluster4(tmp_path_factory):
    """Two hosts x two slots; torn down afterwards whatever happened."""
    reason = _cluster_skip_reason()
    if reason:
        pytest.skip(reason)
    with netns_cluster(tmp_path_factory, slots=2, suffix="4") as hosts:
        yield hosts


@pytest.mark.slow  # CI time (issue 51): tp x dp on 4 ranks is CI (tests/multirank/test_tensor_parallel.py), so is the
# two-host launch through pdsh + ssh (tests/multirank/test_multihost.py) and the tp-groups-inside-a-host line
# (tests/unit/test_launch.py)
def test_tp_inside_hosts_dp_across_same_losses_as_one_process(cluster4, tmp_path):
    one = tmp_path / "one"
    run([PY, "-m", "zerotrain", "train", "--output", str(one), "--micro-batch", str(GLOBAL_BATCH), *TRAIN],
        timeout=300, check=True)
    out = tmp_path / "cluster"
    cmd = L.deepspeed_cmd(str(cluster4["hostfile"]), ["train", "--tp", "2", "--micro-batch", str(GLOBAL_BATCH // 2),
                                                      "--output", str(out), *TRAIN], HOST1, free_port())
    cmd[0] = DEEPSPEED
    res = run(cmd, timeout=400, cwd=cluster4["dir"], check=True)
    log = res.stdout + res.stderr
    assert f"{HOST1}: " in log and f"{HOST2}: " in log and "dist_world_size=4" in log
    assert "world: 2 hosts x 2 ranks = 4 ranks" in log, log[-3000:]
    assert "tensor-parallel groups of 2 inside a host: ranks 0-1 on node 0, ranks 2-3 on node 1" in log, log[-3000:]
    assert "data-parallel 2 x tensor-parallel 2" in log
    _assert_same_losses(_losses(out), _losses(one), range(1, STEPS + 1))
    assert (out / "final" / "config.json").is_file()
    assert (out / "checkpoints" / "latest").read_text().strip() == f"global_step{STEPS}"


