"""The training loop reads nothing from the device on a step it does not log (issue 53): `zerotrain train
--log-every 9` for 9 steps in one process, every read of a tensor's value by zerotrain's own code recorded with
whether a GPU run would hold that tensor on the device (tests/support/read_counter.py follows parameters, moved
batches and everything computed from them through a torch dispatch mode). Between the end of step 1 and the end of
step 8 there is no read of a device tensor (no loss, grad norm or figure read); the logged step 9 reads its loss
from the device (the tracker sees it). Host reads (the loader's batch, the step-boundary exchange's host numbers)
are free on a GPU too and allowed."""
from __future__ import annotations

import json
import sys

import pytest

import tests.support.families as families
from tests.support.launch import REPO, rank_env, run
from tests.support.matrix import cells

pytestmark = pytest.mark.multirank

CPU_ONLY_READS = {
    "fused_loss.py:forward",  # a chunk without labels skipped: made only when `not hidden.is_cuda`
}
"""Device reads the code makes on CPU only (guarded by the tensor's device): allowed here, never made on a GPU."""


@pytest.mark.parametrize("family,backend", cells([("gpt2", "deepspeed"), ("llama", "fsdp")], slow={"llama-fsdp"},
                                                  ids="-".join))
def test_a_step_that_logs_nothing_reads_nothing_from_the_device(tmp_path, family, backend):
    from zerotrain.assets.demo import build_tokenizer

    model = families.make_model_dir(family, tmp_path / family)
    build_tokenizer(vocab_size=families.VOCAB - 24).save_pretrained(str(model))
    out = tmp_path / "reads.json"
    run([sys.executable, str(REPO / "tests" / "support" / "read_counter.py"), str(out), "train", "--model", str(model),
         "--backend", backend, "--stage", "2" if backend == "deepspeed" else "3", "--seq-len", "32", "--micro-batch",
         "2", "--grad-accum", "2", "--max-steps", "9", "--log-every", "9", "--output", str(tmp_path / "run"),
         "--no-save-final", "--overwrite"], env=rank_env(ZEROTRAIN_CACHE=str(tmp_path / "cache")), timeout=420,
        check=True)
    got = json.loads(out.read_text())
    assert got["step_ends"] == 9
    quiet = {where for ends, where, on_device in got["reads"] if 1 <= ends < 8 and on_device}  # steps 2-8
    assert quiet <= CPU_ONLY_READS, f"device reads on steps that log nothing: {sorted(quiet - CPU_ONLY_READS)}"
    logged = {where for ends, where, on_device in got["reads"] if ends == 8 and on_device} - CPU_ONLY_READS
    assert logged, "the logged step read nothing from the device: the tracker sees nothing"
    records = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == [9] and records[-1]["grad_norm"] > 0
