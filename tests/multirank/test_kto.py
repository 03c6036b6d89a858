"""KTO through the CLI on 2 real ranks, against TRL 1.16's KTOTrainer in one process.

Every cell runs `zerotrain train --task kto` under torchrun (2 ranks x micro-batch 4 = a global batch of 8 rows)
and compares each of its 4 steps with KTOTrainer (loss_type "kto") on the same model, rows, batch (8), AdamW and
constant LR (tests/support/trl_reference.py --method kto; fp32): the loss, kl and log-probs within 1e-5 relative;
the rewards, beta x a difference of two log-probs, within 1e-5 of beta x |log-prob|.

The data order. zerotrain shuffles the training rows every epoch (data/datasets.py ResumableSampler: torch's
DistributedSampler, shuffled by --seed and the epoch); 2 ranks take alternate places of one global order, which is
what DistributedSampler gives one process (num_replicas 1) for the same seed and epoch. TRL's KTOTrainer reads its
set in file order (KTOConfig's sequential sampling) and pairs each row with the previous row of its batch for the KL
estimate. So TRL's file holds, for every epoch the run reaches, the rows in that global order (computed here from
DistributedSampler(num_replicas=1)): each TRL batch of 8 is then one zerotrain step's global batch, and its +1
rotation is zerotrain's KL pairing over the global batch.

CI: DeepSpeed ZeRO-3 GPT-2 with --desirable-weight 1.5 (and TRL's class-balance warning under zerotrain's flag
names; evaluation equal to TRL's at steps 2 and 4: an eval set of 8 rows is one TRL eval batch, whose rotation is
zerotrain's over the eval set), FSDP2 stage 3 LoRA Llama (the reference: the adapters disabled) with grad-accum 2
(2 micro-batches of 2 rows per rank: its KL over the global batch is TRL's one-process figure) trained 2 steps then
resumed to 4. Slow: full Llama on DeepSpeed, full GPT-2 on FSDP2, grad-accum 2 on DeepSpeed, --precompute-ref
(resumed past the epochs it first computed), paired data unpaired by rule, chat messages.
"""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

from tests.support.launch import REPO, rank_env, run, torchrun
from tests.support.make_pref_data import pairs, tiny_model
from zerotrain.model.lora import SEED_OFFSET

pytestmark = pytest.mark.multirank

STEPS, ROWS, GLOBAL, LR, SEED = 4, 8, 8, 1e-3, 42
TRL_REFERENCE = str(REPO / "tests" / "support" / "trl_reference.py")
UNDESIRABLE = (1, 4, 6)
"""Rows labelled false: 5 desirable and 3 undesirable (TRL's class-balance warning fires with equal weights)."""


def unpaired_rows(conversational: bool = False) -> list[dict]:
    """ROWS {prompt, completion, label} rows: each pair's chosen (label true) or rejected (label false)."""
    rows = []
    for i, p in enumerate(pairs(ROWS, conversational=conversational)):
        good = i not in UNDESIRABLE
        rows.append({"prompt": p["prompt"], "completion": p["chosen"] if good else p["rejected"], "label": good})
    return rows


def data_order(n: int, epochs: int) -> list[int]:
    """zerotrain's global data order over `epochs` epochs (module docstring)."""
    from torch.utils.data import DistributedSampler

    order = []
    for epoch in range(epochs):
        sampler = DistributedSampler(range(n), num_replicas=1, rank=0, shuffle=True, seed=SEED, drop_last=True)
        sampler.set_epoch(epoch)
        order += list(sampler)
    return order


def write(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.fixture(scope="module")
def kto(tmp_path_factory) -> dict:
    """The module's models, data files (zerotrain's and TRL's, per data set) and a cache of TRL runs."""
    root = tmp_path_factory.mktemp("kto")
    plain, chat = unpaired_rows(), unpaired_rows(conversational=True)
    epochs = math.ceil(STEPS * GLOBAL / ROWS)
    from datasets import Dataset
    from trl.data_utils import unpair_preference_dataset

    paired = pairs(ROWS)
    unpaired = list(unpair_preference_dataset(Dataset.from_list(paired)))  # TRL's own rule: chosen, then rejected
    out = {"root": root, "gpt2": tiny_model("gpt2", root / "gpt2"), "llama": tiny_model("llama", root / "llama"),
           "trl": {}, "data": write(root / "rows.jsonl", plain), "chat": write(root / "chat.jsonl", chat),
           "pairs": write(root / "pairs.jsonl", paired)}
    out["trl-data"] = write(root / "trl-rows.jsonl", [plain[i] for i in data_order(ROWS, epochs)])
    out["trl-chat"] = write(root / "trl-chat.jsonl", [chat[i] for i in data_order(ROWS, epochs)])
    pair_epochs = math.ceil(STEPS * GLOBAL / len(unpaired))
    out["trl-pairs"] = write(root / "trl-pairs.jsonl", [unpaired[i] for i in data_order(len(unpaired), pair_epochs)])
    return out


def trl_run(kto: dict, family: str, *args: str, data: str = "data", eval_every: int = 0) -> dict:
    """TRL's run for this model, data and configuration (once per module)."""
    key = (family, data, eval_every, *args)
    if key not in kto["trl"]:
        out = kto["root"] / f"trl-{len(kto['trl'])}.json"
        evals = ["--eval-data", kto[data], "--eval-every", eval_every] if eval_every else []
        run([sys.executable, TRL_REFERENCE, "--method", "kto", "--model", kto[family], "--data", kto[f"trl-{data}"],
             "--out", out, "--steps", STEPS, "--batch", GLOBAL, "--lr", LR, "--seed", SEED, "--max-length", 128,
             *evals, *args], timeout=300, check=True)
        kto["trl"][key] = json.loads(Path(out).read_text())
    return kto["trl"][key]


def train(kto: dict, out: Path, family: str, *args: str, data: str = "data", nproc: int = 2, micro: int = 4,
          check: bool = True):
    """`zerotrain train --task kto` on nproc ranks (micro-batch x grad-accum x ranks = the global batch of 8)."""
    return torchrun(["-m", "zerotrain", "train", "--task", "kto", "--model", kto[family], "--data", kto[data],
                     "--output", out, "--micro-batch", micro, "--lr", LR, "--schedule", "constant", "--seq-len", 128,
                     "--seed", SEED, "--dist-timeout", 60, *args], env=rank_env(), timeout=400, check=check,
                    nproc=nproc)


def records(out: Path, key: str) -> list[dict]:
    return [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if key in r]


def assert_matches(ours: list[dict], theirs: list[dict], beta: float = 0.1, prefix: str = "") -> None:
    """Each record's figures against TRL's (module docstring); a figure TRL leaves out zerotrain leaves out too."""
    assert ours and [r["step"] for r in ours] == [r["step"] for r in theirs], (ours, theirs)
    names = ("kl", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected")
    for a, b in zip(ours, theirs):
        where = f"step {a['step']}"
        assert a[f"{prefix}loss"] == pytest.approx(b[f"{prefix}loss"], rel=1e-5), where
        assert {k for k in names if prefix + k in a} == {k for k in names if prefix + k in b}, (where, a, b)
        scale = beta * max(abs(b[f"{prefix}logps/chosen"]), abs(b[f"{prefix}logps/rejected"]))
        for k in names:
            mine, want = a[prefix + k], b[prefix + k]
            if k.startswith("rewards") or k == "kl":  # differences of log-probs: to the log-probs' size
                assert mine == pytest.approx(want, rel=1e-5, abs=1e-5 * scale), (where, k)
            else:
                assert mine == pytest.approx(want, rel=1e-5), (where, k)


# --- CI: one launch per backend ---------------------------------------------------------------------------
def test_kto_deepspeed_zero3_weighted_equals_trl_with_eval(kto, tmp_path):
    out = tmp_path / "run"
    res = train(kto, out, "gpt2", "--stage", "3", "--max-steps", STEPS, "--desirable-weight", "1.5",
                "--eval-data", kto["data"], "--eval-every", 2)
    assert "kto beta 0.1, desirable weight 1.5, undesirable weight 1.0; reference: a frozen copy of the starting " \
           "weights" in res.stdout, res.stdout
    # TRL's class-balance warning (5 desirable, 3 undesirable), its ranges, zerotrain's flag names, once
    assert res.stdout.count("--desirable-weight in [0.6, 0.8] OR --undesirable-weight in [1.88, 2.5]") == 1, res.stdout
    theirs = trl_run(kto, "gpt2", "--desirable-weight", "1.5", eval_every=2)
    assert_matches(records(out, "loss"), theirs["steps"])
    assert records(out, "loss")[-1]["kl"] > 0  # the policy moved: a KL above the clamp
    assert [r["step"] for r in theirs["evals"]] == [2, 4], theirs["evals"]
    assert_matches(records(out, "eval_loss"), theirs["evals"], prefix="eval_")
    assert (out / "final" / "model.safetensors").is_file()


def test_kto_fsdp_lora_grad_accum_equals_trl_and_resumes(kto, tmp_path):
    """2 ranks x 2 micro-batches of 2 rows: each step's KL estimate is over the global batch of 8, TRL's one
    process's figure; 2 steps, then resumed to 4."""
    out = tmp_path / "run"
    args = ("--backend", "fsdp", "--stage", "3", "--lora-r", 4, "--grad-accum", 2)
    res = train(kto, out, "llama", *args, "--max-steps", 2, micro=2)
    assert "reference: the policy with its LoRA adapters disabled" in res.stdout, res.stdout
    train(kto, out, "llama", *args, "--max-steps", STEPS, "--resume", micro=2)
    theirs = trl_run(kto, "llama", "--lora-r", "4", "--seed", str(SEED + SEED_OFFSET))
    assert_matches(records(out, "loss"), theirs["steps"])
    assert (out / "final" / "adapter_config.json").is_file()


# --- slow: the rest of the matrix ---------------------------------------------------------------------------
MATRIX = [("deepspeed", "3", "llama"), ("fsdp", "3", "gpt2"), ("deepspeed", "2", "gpt2"), ("deepspeed", "0", "llama"),
          ("fsdp", "1", "llama")]


@pytest.mark.slow
@pytest.mark.parametrize("backend, stage, family", MATRIX, ids=[f"{b}-{f}" if s == "3" else f"{b}-z{s}-{f}"
                                                               for b, s, f in MATRIX])
def test_kto_full_equals_trl(kto, tmp_path, backend, stage, family):
    train(kto, tmp_path, family, "--backend", backend, "--stage", stage, "--max-steps", STEPS)
    assert_matches(records(tmp_path, "loss"), trl_run(kto, family)["steps"])


@pytest.mark.slow
def test_kto_one_process_equals_trl(kto, tmp_path):
    """zerotrain in one process holding the whole batch of 8 (TRL's own setting), Llama, with the undesirable rows'
    weight set (the CI cell sets the desirable one)."""
    train(kto, tmp_path, "llama", "--stage", "3", "--max-steps", STEPS, "--undesirable-weight", "0.8", nproc=1, micro=8)
    assert_matches(records(tmp_path, "loss"), trl_run(kto, "llama", "--undesirable-weight", "0.8")["steps"])


@pytest.mark.slow
def test_kto_grad_accum_equals_one_process_with_the_whole_batch(kto, tmp_path):
    """2 ranks x 2 micro-batches of 2: the KL over the global batch is TRL's (one process, the 8 rows at once)."""
    train(kto, tmp_path, "gpt2", "--stage", "3", "--max-steps", STEPS, "--grad-accum", 2, micro=2)
    assert_matches(records(tmp_path, "loss"), trl_run(kto, "gpt2")["steps"])


@pytest.mark.slow
def test_kto_precomputed_reference_equals_the_live_one_and_resumes(kto, tmp_path):
    """2 steps (2 epochs of KL pairings precomputed), then a resume to 4: the 2 further epochs' KL rows are added;
    the eval set's rows and KL rows come from their own table."""
    evals = ("--eval-data", kto["data"], "--eval-every", 2)
    res = train(kto, tmp_path, "gpt2", "--stage", "3", "--precompute-ref", "--max-steps", 2, *evals)
    assert "reference: precomputed log-probs" in res.stdout, res.stdout
    assert (tmp_path / "reference_logps.pt").is_file()
    train(kto, tmp_path, "gpt2", "--stage", "3", "--precompute-ref", "--max-steps", STEPS, "--resume", *evals)
    theirs = trl_run(kto, "gpt2", eval_every=2)
    assert_matches(records(tmp_path, "loss"), theirs["steps"])
    assert_matches(records(tmp_path, "eval_loss"), theirs["evals"], prefix="eval_")


@pytest.mark.slow
@pytest.mark.parametrize("data", ["pairs", "chat"])
def test_kto_paired_and_chat_data_equal_trl(kto, tmp_path, data):
    """Pairs unpaired by TRL's rule (16 rows: 2 steps an epoch); chat messages rendered with the template."""
    res = train(kto, tmp_path, "llama", "--stage", "3", "--max-steps", STEPS, data=data)
    if data == "pairs":
        assert "8 desirable, 8 undesirable" in res.stdout, res.stdout
    assert_matches(records(tmp_path, "loss"), trl_run(kto, "llama", data=data)["steps"])
