"""`zerotrain train --resume` through the CLI for every feature that changes what a checkpoint holds, as a user
does it, on 2 CPU ranks under torchrun: a straight 6-step run A that checkpoints at step 3, then a fresh output
B holding only A's step-3 checkpoint (and A's files up to step 3) resumed to step 6. B must really resume
(start at step 4: A's step 1-3 records kept as they were), its steps 4-6 must be A's, and B must finish
(final/ written). Each feature on DeepSpeed and FSDP, the embedded corpus and tokenizer:
- --pp 2, --tp 2 and --sp 2: a tiny Llama from scratch (GPT-2 cannot be split by DeepSpeed AutoTP);
- --ep 2: a tiny Qwen3-MoE from scratch (8 experts, top-2, its router loss on), whose metrics hold the router loss
  and the tokens per expert, and whose checkpoint `zerotrain export` turns into final/'s model;
- LoRA (--lora-r, adapters on named modules): pretrained tiny GPT-2 (Conv1D c_attn/c_fc, tied head) and tiny
  Llama (q_proj/v_proj/down_proj) weights, LoRA needs --model DIR;
- QAT (--qat, both schemes): a tiny Llama from scratch (torchao fake-quantizes nn.Linear only, not GPT-2's
  Conv1D); group size 16 divides its widths (64, 176).
"""
from __future__ import annotations

import json
import math
import shutil
import sys
from pathlib import Path

import pytest

from tests.support.launch import rank_env, torchrun
from tests.support.matrix import cells
from zerotrain.checkpoint.store import data_record
from zerotrain.data.datasets import TEXT_PACKING

pytestmark = pytest.mark.multirank

COMMON = ["--seq-len", "32", "--pack", "--micro-batch", "2", "--grad-accum", "2",
          "--lr", "1e-3", "--max-steps", "6", "--save-every", "3", "--dist-timeout", "120"]
SCRATCH, PRETRAINED = "--model-config", "--model"  # a tiny preset from scratch / its saved random weights
LORA = ["--lora-r", "4", "--lr", "1e-2"]  # the lr at which LoRA's B (zero at start) really moves (test_lora)
CASES = {  # name: (how the model is given, tiny preset, feature + backend flags)
    # DeepSpeed's pipeline engine runs ZeRO 0-1 (AutoTP 0-2); FSDP tp/pp stage 1-3 (zerotrain/plan/parallel_rules.py)
    "pp2-deepspeed": (SCRATCH, "tiny-llama", ["--pp", "2", "--backend", "deepspeed", "--stage", "1"]),
    "pp2-fsdp": (SCRATCH, "tiny-llama", ["--pp", "2", "--backend", "fsdp", "--stage", "3"]),
    "tp2-deepspeed": (SCRATCH, "tiny-llama", ["--tp", "2", "--backend", "deepspeed", "--stage", "1"]),
    "tp2-fsdp": (SCRATCH, "tiny-llama", ["--tp", "2", "--backend", "fsdp", "--stage", "3"]),
    "sp2-fsdp": (SCRATCH, "tiny-llama", ["--sp", "2", "--backend", "fsdp", "--stage", "3"]),
    "sp2-deepspeed": (SCRATCH, "tiny-llama", ["--sp", "2", "--backend", "deepspeed", "--stage", "2"]),
    # expert parallelism: FSDP2 (transformers' dispatch) and DeepSpeed's AutoEP (ZeRO 0-2; docs/moe.md)
    "ep2-fsdp": (SCRATCH, "tiny-qwen3-moe", ["--ep", "2", "--backend", "fsdp", "--stage", "3"]),
    "ep2-deepspeed": (SCRATCH, "tiny-qwen3-moe", ["--ep", "2", "--backend", "deepspeed", "--stage", "2"]),
    # composed layouts (issue 52; 4 ranks): tp x pp and sp x tp on FSDP2
    "tp2-pp2-fsdp": (SCRATCH, "tiny-llama", ["--tp", "2", "--pp", "2", "--backend", "fsdp", "--stage", "3"]),
    "sp2-tp2-fsdp": (SCRATCH, "tiny-llama", ["--sp", "2", "--tp", "2", "--backend", "fsdp", "--stage", "3"]),
    # LoRA and QAT
    "lora-gpt2-deepspeed": (PRETRAINED, "tiny-gpt2",
                            [*LORA, "--lora-targets", "c_attn,c_fc", "--backend", "deepspeed", "--stage", "3"]),
    "lora-llama-fsdp": (PRETRAINED, "tiny-llama",
                        [*LORA, "--lora-targets", "q_proj,v_proj,down_proj", "--backend", "fsdp", "--stage", "2"]),
    "qat-int4-deepspeed": (SCRATCH, "tiny-llama", ["--qat", "int4-weight", "--quant-group-size", "16",
                                                   "--backend", "deepspeed", "--stage", "2"]),
    "qat-int8dyn-fsdp": (SCRATCH, "tiny-llama", ["--qat", "int8-dynamic-int4-weight", "--quant-group-size", "16",
                                                 "--backend", "fsdp", "--stage", "3"]),
}
SLOW = {"pp2-deepspeed", "tp2-deepspeed", "lora-gpt2-deepspeed", "qat-int4-deepspeed", "sp2-deepspeed",
        "pp2-fsdp", "tp2-fsdp", "lora-llama-fsdp", "ep2-deepspeed", "tp2-pp2-fsdp", "sp2-tp2-fsdp"}
"""CI resumes through the CLI where the run holds what no engine-level test resumes: sp2 (and the same checkpoint at
sp 1; a layout with dp 1, whose global batch record the resume keeps), ep2 (the MoE metrics, the export of an ep
checkpoint) and QAT (its CLI checks), on FSDP2. The rest is slow: pp2 on DeepSpeed took 80 s of CI, sp2 on DeepSpeed
81 s, LoRA on GPT-2 + DeepSpeed ZeRO-3 60 s; pp2, tp2 and LoRA on FSDP2 took 16 s each (moved for CI time, issue 51).
Each of them resumes exactly in CI at the engine level, on both backends (pp: test_composed_layouts.py and
test_pipeline_deepspeed.py; tp: test_lora_tensor_parallel.py, test_composed_layouts.py and test_deepspeed_tp.py;
LoRA: test_lora.py; DeepSpeed's sp2: test_preference_sp.py; tp x pp and sp x tp: test_composed_layouts.py and
test_sequence_tensor_parallel.py), and the CLI's own resume path (data position, metrics.jsonl continued, final/) is this
module's CI cells' and tests/multirank/test_train.py's."""


def train_rows(path: Path) -> list[dict]:
    return [r for r in map(json.loads, path.read_text().splitlines()) if "loss" in r]


@pytest.fixture(scope="module")
def env(tmp_path_factory) -> dict:
    return rank_env(ZEROTRAIN_CACHE=str(tmp_path_factory.mktemp("cli_resume_cache")))


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    """preset -> a save_pretrained directory of it (random weights, seed 0, the embedded tokenizer), built once."""
    from zerotrain.assets.demo import build_tiny

    built: dict[str, Path] = {}

    def get(preset: str) -> Path:
        if preset not in built:
            built[preset] = build_tiny(tmp_path_factory.mktemp(preset), preset)
        return built[preset]

    return get


def final_files(flags: list[str]) -> list[str]:
    """What final/ holds: the adapter (LoRA), the model and its converted copy (QAT), or the model."""
    if "--lora-r" in flags:
        return ["adapter_config.json", "adapter_model.safetensors"]
    if "--qat" in flags:
        return ["config.json", f"quantized-{flags[flags.index('--qat') + 1]}/config.json"]
    return ["config.json"]


def keep_until(src: Path, dst: Path, step: int) -> None:
    """dst = src as it was right after step `step`'s checkpoint: that checkpoint only, `latest` naming
    it, metrics.jsonl up to it, no final/."""
    shutil.copytree(src, dst)
    ckpts, tag = dst / "checkpoints", f"global_step{step}"
    for p in ckpts.iterdir():
        if p.is_dir() and p.name != tag:
            shutil.rmtree(p)
    (ckpts / "latest").write_text(tag)
    shutil.rmtree(dst / "final", ignore_errors=True)
    lines = (dst / "metrics.jsonl").read_text().splitlines()
    (dst / "metrics.jsonl").write_text("".join(f"{x}\n" for x in lines if json.loads(x)["step"] <= step))


@pytest.mark.parametrize("case", cells(CASES, SLOW))
def test_resume_mid_run_continues_exactly(tmp_path, env, pretrained, case):
    how, preset, flags = CASES[case]
    a, b = tmp_path / "A", tmp_path / "B"
    args = ["-m", "zerotrain", "train", how, str(pretrained(preset)) if how == PRETRAINED else preset, *COMMON,
            *flags]  # the case's flags last: they win (LoRA's --lr)
    nproc = max(2, math.prod(int(flags[i + 1]) for i, f in enumerate(flags) if f in ("--tp", "--pp", "--sp")))
    first = torchrun([*args, "--output", str(a)], env=env, timeout=420, nproc=nproc)
    straight = train_rows(a / "metrics.jsonl")
    assert [r["step"] for r in straight] == list(range(1, 7))
    assert (a / "checkpoints" / "global_step3").is_dir(), sorted(p.name for p in (a / "checkpoints").iterdir())

    keep_until(a, b, 3)
    res = torchrun([*args, "--resume", "--output", str(b)], env=env, timeout=420, nproc=nproc)
    assert "done: 3 steps (to step 6)" in res.stdout + res.stderr, res.stdout[-3000:]  # started at step 4
    resumed = train_rows(b / "metrics.jsonl")
    assert [r["step"] for r in resumed] == list(range(1, 7))
    assert resumed[:3] == straight[:3]  # resumed at step 4: steps 1-3 kept as A wrote them (timings included)
    assert [r["loss"] for r in resumed[3:]] == pytest.approx([r["loss"] for r in straight[3:]], rel=1e-5)
    assert [r["lr"] for r in resumed[3:]] == pytest.approx([r["lr"] for r in straight[3:]], rel=1e-9)
    for name in final_files(flags):
        assert (b / "final" / name).is_file(), (name, sorted(p.name for p in (b / "final").iterdir()))
    assert (b / "checkpoints" / "latest").read_text().strip() == "global_step6"
    # whole-dataset packing, and the global batch a resume keeps on another world size (micro 2 x accum 2 x the
    # data-parallel ranks: 1 under tp/pp/sp 2, 2 otherwise)
    dp = 1 if {"--tp", "--pp", "--sp"} & set(flags) else 2
    assert data_record(b / "checkpoints" / "global_step6") == {"text_packing": TEXT_PACKING, "global_batch": 4 * dp}
    if "--ep" in flags:
        check_moe_run(b, resumed, env)
    if "--qat" in flags:
        check_qat_run(a, b, args, flags, first.stdout + first.stderr, env)
    if case == "sp2-fsdp":
        # sp shards nothing of the model, optimizer or data order: the same step-3 checkpoint resumes on the same 2
        # ranks under --sp 1 (dp 2, micro-batch 1: the same global batch of 4) and its steps 4-6 are the sp=2 run's
        c = tmp_path / "C"
        keep_until(a, c, 3)
        res = torchrun([*args, "--sp", "1", "--micro-batch", "1", "--resume", "--output", str(c)], env=env, timeout=420)
        assert "done: 3 steps (to step 6)" in res.stdout + res.stderr, res.stdout[-3000:]
        other_sp = train_rows(c / "metrics.jsonl")
        assert [r["loss"] for r in other_sp[3:]] == pytest.approx([r["loss"] for r in straight[3:]], rel=1e-5)
        check_crafted_refused(a, tmp_path / "D", args, env)


def check_crafted_refused(a: Path, d: Path, args: list[str], env: dict) -> None:
    """`--resume` of a checkpoint holding a crafted torch file (its unpickling would call a function): refused by
    the rank that vets that file (each rank vets every other file), in one line naming --trust-checkpoint, every
    rank ends, the function never runs, and `latest` still names the checkpoint (nothing lost)."""
    from tests.unit.test_safe_reads import MARKER_CALL, crafted_file

    keep_until(a, d, 3)
    marker = d.parent / "marker"
    crafted_file(d / "checkpoints" / "global_step3" / "extra.pt", marker)
    res = torchrun([*args, "--resume", "--output", str(d)], env=env, timeout=300, check=False)
    log = res.stdout + res.stderr
    assert res.returncode != 0 and "Traceback" not in log, log[-3000:]
    refusals = [x for x in log.splitlines() if MARKER_CALL in x and "--trust-checkpoint" in x]
    assert len(refusals) == 1 and "zerotrain train: error:" in refusals[0], log[-3000:]
    assert not marker.exists() and (d / "checkpoints" / "latest").read_text().strip() == "global_step3"


def check_qat_run(a: Path, b: Path, args: list[str], flags: list[str], log: str, env: dict) -> None:
    """QAT through the CLI (issue 50 folded test_qat.py's CLI test in here: one launch less): the banner line,
    final/quantized-<scheme>/ of the fake-quantized Linears, `zerotrain export --quantize` of the checkpoint with
    the run's own group size (16, not the default 32) in another scheme, and a resume without --qat refused in one
    line (one process: the preflight refuses it before any process group)."""
    import re

    from transformers import AutoModelForCausalLM

    from tests.support.launch import run
    from zerotrain.model import quant

    scheme = flags[flags.index("--qat") + 1]
    banner = re.search(rf"QAT {scheme}, group size 16: (\d+) fake-quantized Linear layers", log)
    assert banner, log[-3000:]
    layers = int(banner.group(1))
    converted = AutoModelForCausalLM.from_pretrained(b / "final" / f"quantized-{scheme}")
    assert quant.layer_schemes(converted) == {scheme: layers}
    other = "int4-weight" if scheme != "int4-weight" else "int8-dynamic-int4-weight"
    exported = b / "from-ckpt"
    res = run([sys.executable, "-m", "zerotrain", "export", str(a / "checkpoints"), str(exported), "--quantize", other,
               "--serve-timing", "off"], env=env, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert json.loads((exported / "quantization_report.json").read_text())["group_size"] == 16  # the run's own
    assert quant.layer_schemes(AutoModelForCausalLM.from_pretrained(exported)) == {other: layers}
    c = b.parent / "C-no-qat"
    keep_until(a, c, 3)
    plain = [x for i, x in enumerate(args) if x not in ("--qat", "--quant-group-size")
             and args[i - 1] not in ("--qat", "--quant-group-size")]
    # refused by the preflight's resume check before any process group: one process says it as 2 ranks would
    res = run([sys.executable, *plain, "--resume", "--output", str(c)], env=env, timeout=300)
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr[-3000:]
    refusal = f"trained with --qat {scheme} --quant-group-size 16; resume with the same flags"
    assert "zerotrain train: error: " in res.stderr and refusal in res.stderr, res.stderr[-3000:]


def check_moe_run(out: Path, rows: list[dict], env: dict) -> None:
    """A mixture of experts' records: the LM loss + 0.001 x the router loss is the trained loss, every token's
    top-2 counted once per block; and `zerotrain export` of the last checkpoint (experts gathered from their
    ranks) is final/'s model."""
    import torch
    from transformers import AutoModelForCausalLM

    from tests.support.launch import run

    for r in rows:
        assert r["loss"] == pytest.approx(r["lm_loss"] + 0.001 * r["router_aux_loss"], rel=1e-9)
        assert len(r["expert_tokens"]) == 8 and r["expert_imbalance"] >= 1.0
        assert sum(r["expert_tokens"]) == 2 * 2 * r["tokens"]  # 2 blocks x top-2, every token of every rank
    # the router logits were asked for in each forward, not written into the model's config: final/ is as it came
    assert json.loads((out / "final" / "config.json").read_text())["output_router_logits"] is False
    exported = out / "exported"
    run([sys.executable, "-m", "zerotrain", "export", str(out / "checkpoints" / "global_step6"), str(exported)],
        env=env, timeout=300, check=True)
    a, b = (AutoModelForCausalLM.from_pretrained(str(d)).eval() for d in (out / "final", exported))
    x = torch.randint(0, a.config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(a(input_ids=x).logits, b(input_ids=x).logits, rtol=0, atol=0)
