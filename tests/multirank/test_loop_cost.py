"""The training loop reads nothing from the device on a step it does not log (issue 53): `zerotrain train
--log-every 9` for 9 steps in one process, every read of a tensor's value by zerotrain's own code counted
(tests/support/read_counter.py). Between the end of step 1 and the end of step 8 there is none (no loss, grad norm
or figure read, no collective's result read but the step-boundary exchange's, a host tensor of host numbers);
the logged step 9 reads its loss (the counter counts). On a GPU each such read waits for the device. CPU ranks
cannot tell a device tensor from a host one, so the reads of host tensors are named (HOST_READS)."""
from __future__ import annotations

import json
import sys

import pytest

import tests.support.families as families
from tests.support.launch import REPO, rank_env, run
from tests.support.matrix import cells

pytestmark = pytest.mark.multirank

HOST_READS = {
    "sequence_parallel.py:label_tokens",  # the step's label tokens, counted on the host batch the loader collated
    "text.py:real_tokens",  # its real (not padding) tokens, from the host batch's mask or packed count
    "preemption.py:agree",  # the step-boundary exchange: a CPU tensor of host numbers gathered over gloo
    "fused_loss.py:forward",  # a chunk without labels skipped: tested on CPU only (`not hidden.is_cuda`)
}
"""Reads of host tensors a step makes (free on a GPU run too): the only ones allowed on a step that logs nothing."""


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
         "--no-save-final", "--overwrite"], env=rank_env(ZEROTRAIN_CACHE=str(tmp_path / "cache")), timeout=300,
        check=True)
    got = json.loads(out.read_text())
    assert got["step_ends"] == 9
    quiet = {where for ends, where in got["reads"] if 1 <= ends < 8}  # after step 1 ended, before step 8 ended
    assert quiet <= HOST_READS, f"reads on steps that log nothing: {sorted(quiet - HOST_READS)}"
    logged = [where for ends, where in got["reads"] if ends == 8]  # during step 9, the logged one
    assert logged, "the logged step read nothing: the counter counts nothing"
    records = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == [9] and records[-1]["grad_norm"] > 0
