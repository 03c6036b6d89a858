"""--task reward and --task kto refuse what they do not run with, in one line naming the setting and the fix,
before any rank starts (in-process `zerotrain train`, no process group); their own settings are refused on the
other tasks."""
from __future__ import annotations

import json

import pytest

from zerotrain.cli import main
from zerotrain.config.load import build_config
from zerotrain.config.rules import unused_settings
from zerotrain.errors import ConfigError


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    from tests.support.make_pref_data import pairs, tiny_model, write_pairs

    root = tmp_path_factory.mktemp("reward_kto_rules")
    rows = pairs(8)
    (root / "rows.jsonl").write_text("".join(json.dumps({"prompt": r["prompt"], "completion": r["chosen"],
                                                         "label": i % 2 == 0}) + "\n" for i, r in enumerate(rows)))
    (root / "good.jsonl").write_text("".join(json.dumps({"prompt": r["prompt"], "completion": r["chosen"],
                                                         "label": True}) + "\n" for r in rows))
    (root / "margin.jsonl").write_text("".join(json.dumps({**r, "margin": "big" if i == 3 else 1.0}) + "\n"
                                               for i, r in enumerate(rows)))
    model = tiny_model("gpt2", root / "gpt2")
    from transformers import AutoModelForSequenceClassification

    classifier = root / "cls3"
    AutoModelForSequenceClassification.from_pretrained(model, num_labels=3).save_pretrained(classifier)
    from transformers import AutoTokenizer

    AutoTokenizer.from_pretrained(model).save_pretrained(classifier)
    return {"model": str(model), "pairs": str(write_pairs(root / "pairs.jsonl", 8)), "rows": str(root / "rows.jsonl"),
            "good": str(root / "good.jsonl"), "margin": str(root / "margin.jsonl"), "cls3": str(classifier),
            "root": root}


CASES = [
    ("reward", "pairs", ("--beta", 0.2), "pref.beta=0.2 is no reward-model setting"),
    ("reward", "pairs", ("--max-prompt-len", 8), "pref.max_prompt_len=8 is no reward-model setting"),
    ("reward", "pairs", ("--num-labels", 3), "--num-labels 3 with --task reward"),
    ("reward", "pairs", ("--desirable-weight", 2.0), "pref.desirable_weight=2.0 weighs KTO's"),
    ("reward", "pairs", ("--ref-model", "x"), "pref.ref_model=x sets the reference of dpo and kto"),
    ("reward", "pairs", ("--tp", 2), "--task reward with --tp 2: a reward model runs with data parallelism"),
    ("reward", "pairs", ("--packing", "separate"), "--packing"),
    ("reward", "margin", (), "--data row 4: 'margin' is 'big'"),
    ("reward", "rows", (), "'chosen' and 'rejected'"),
    ("reward", "cls3", (), "a sequence classifier with 3 labels; --task reward trains a head of 1"),
    ("kto", "rows", ("--center-rewards-coef", 0.01), "pref.center_rewards_coef=0.01 is the reward model's"),
    ("kto", "rows", ("--dpo-split-forward",), "pref.split_forward=True splits a pair's forward"),
    ("kto", "rows", ("--rpo-alpha", 0.5), "pref.rpo_alpha=0.5 is DPO's loss setting"),
    ("kto", "rows", ("--tp", 2), "--task kto with --tp 2: preference tuning runs with data parallelism (ZeRO 0-3 / "
                                 "FSDP2, LoRA) and sequence parallelism (--sp) only; pass --tp 1"),
    ("kto", "rows", ("--qat", "int4-weight"), "--qat int4-weight"),
    ("kto", "rows", ("--global-batch", 1, "--micro-batch", 1), "--task kto with a global batch of 1"),
    ("kto", "good", (), "every row is desirable (true)"),
    ("kto", "pairs", ("--beta", 0), "--beta 0 with --task kto"),
]


@pytest.mark.parametrize("task, data, args, needle", CASES, ids=[f"{t}-{n[:40]}" for t, _, _, n in CASES])
def test_refused_in_one_line(files, capsys, task, data, args, needle):
    model = files["cls3"] if data == "cls3" else files["model"]
    data = files["pairs"] if data == "cls3" else files[data]
    code = main(["train", "--task", task, "--model", model, "--data", data, "--output", str(files["root"] / "out"),
                 "--max-steps", "1", "--seq-len", "64", *map(str, args)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and needle in err[0], err


def test_their_settings_are_refused_elsewhere():
    for task, setting, value in [("dpo", "pref.desirable_weight", 2.0), ("dpo", "pref.center_rewards_coef", 0.1),
                                 ("causal-lm", "pref.undesirable_weight", 0.5), ("seq-cls", "model.num_labels", 1)]:
        with pytest.raises(ConfigError, match=setting.split(".")[-1] if setting != "model.num_labels" else
                           "--num-labels 1 with --task seq-cls"):
            unused_settings(build_config(overrides={"model.task": task, setting: value}), "deepspeed", 3, "cpu")
    # what they read is accepted
    unused_settings(build_config(overrides={"model.task": "reward", "pref.center_rewards_coef": 0.01}),
                    "deepspeed", 3, "cpu")
    unused_settings(build_config(overrides={"model.task": "kto", "pref.desirable_weight": 1.33, "pref.beta": 0.2,
                                            "pref.precompute_ref": True}), "fsdp", 3, "cpu")


def test_a_one_label_classifier_is_taken_as_it_is_and_a_causal_lm_gets_a_seeded_head(files, tmp_path):
    """--task reward on a 1-label sequence classifier keeps its trained head; on a causal LM the fresh head is the
    same for the same --seed (every rank builds the same one) and its pad id is set after the build (no padding_idx
    freezing the eos row)."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from zerotrain.model.source import data_labels, resolve_model

    scorer = tmp_path / "scorer"
    torch.manual_seed(123)
    saved = AutoModelForSequenceClassification.from_pretrained(files["model"], num_labels=1)
    saved.save_pretrained(scorer)
    AutoTokenizer.from_pretrained(files["model"]).save_pretrained(scorer)

    def build(model: str, seed: int):
        cfg = build_config(overrides={"model": {"name": model, "task": "reward"},
                                      "data": {"path": files["pairs"], "seq_len": 64}, "run": {"seed": seed}})
        return resolve_model(cfg).factory(*data_labels(cfg), seed=seed)()

    kept = build(str(scorer), 7)
    assert torch.equal(kept.score.weight, saved.score.weight) and kept.config.num_labels == 1
    fresh, again, other = build(files["model"], 7), build(files["model"], 7), build(files["model"], 8)
    assert torch.equal(fresh.score.weight, again.score.weight) and not torch.equal(fresh.score.weight,
                                                                                   other.score.weight)
    assert fresh.config.pad_token_id == AutoTokenizer.from_pretrained(files["model"]).eos_token_id  # pad = eos
    from tests.support.make_pref_data import tiny_model

    llama = build(str(tiny_model("llama", tmp_path / "llama")), 7)  # Llama's embedding takes a padding_idx
    assert llama.config.pad_token_id is not None and llama.get_input_embeddings().padding_idx is None
