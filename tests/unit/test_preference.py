"""Preference tuning without ranks: pairs tokenized and batched exactly as TRL 1.16's DPOTrainer does (TRL's own
_prepare_dataset and DataCollatorForPreference are the reference), the losses against numbers computed by hand,
and the one-line refusals."""
from __future__ import annotations

import math
import types

import pytest
import torch

from tests.support.make_pref_data import pairs, tiny_tokenizer
from zerotrain.config.load import build_config
from zerotrain.data import preference as pref_data
from zerotrain.errors import ConfigError, UserError
from zerotrain.train.preference import PreferenceLoss
from zerotrain.tasks import task_spec


def _trl_tokenized(rows: list[dict], tokenizer, max_length: int):
    """TRL 1.16's DPOTrainer._prepare_dataset on these rows (its own code; the trainer object is only read for
    its tokenizer)."""
    import datasets
    from trl import DPOConfig
    from trl.trainer.dpo_trainer import DPOTrainer

    args = DPOConfig(output_dir="/tmp/zt-trl-unused", max_length=max_length, use_cpu=True, report_to=[])
    stub = types.SimpleNamespace(_tokenizer=tokenizer)
    datasets.disable_progress_bars()
    return DPOTrainer._prepare_dataset(stub, datasets.Dataset.from_list(rows), tokenizer, args, "train")


def _ours(rows: list[dict], tokenizer, seq_len: int, template=None):
    import datasets

    ds = datasets.Dataset.from_list(rows)
    return pref_data.tokenize_pairs(ds, tokenizer, template, seq_len, None, f"test-{seq_len}-{id(tokenizer)}")


def _bpe():
    from zerotrain.assets.demo import build_tokenizer

    return build_tokenizer()


def _chat_without_prompt(n: int) -> list[dict]:
    """Conversational rows whose prompt turns sit at the start of chosen and rejected (TRL extracts them)."""
    out = []
    for r in pairs(n, seed=3, conversational=True):
        out.append({"chosen": r["prompt"] + r["chosen"], "rejected": r["prompt"] + r["rejected"]})
    return out


def _lengthen(row: dict) -> None:
    long = " ".join(["tell me about the old river"] * 12)
    if isinstance(row.get("prompt"), str):
        row["prompt"] = long + " " + row["prompt"]
    elif "prompt" in row:
        row["prompt"][0]["content"] = long + " " + row["prompt"][0]["content"]
    elif isinstance(row["chosen"], str):
        row["chosen"], row["rejected"] = long + " " + row["chosen"], long + " " + row["rejected"]
    else:
        for side in ("chosen", "rejected"):
            row[side][0]["content"] = long + " " + row[side][0]["content"]


@pytest.mark.parametrize("case", ["words-bos", "words", "bpe", "chat", "chat-implicit-prompt", "text-implicit-prompt"])
def test_pairs_tokenize_as_trl(case):
    seq_len = 24  # some pairs are truncated, one prompt is long enough to be dropped
    if case == "bpe":  # byte-level BPE: tokens may merge across the prompt/completion boundary
        tok, rows, seq_len = _bpe(), pairs(12, seed=1), 64
    elif case.startswith("chat"):
        tok = tiny_tokenizer(add_bos=True)
        rows = pairs(8, seed=2, conversational=True) if case == "chat" else _chat_without_prompt(8)
    elif case == "text-implicit-prompt":
        tok = tiny_tokenizer(add_bos=False)
        rows = [{"chosen": r["prompt"] + r["chosen"], "rejected": r["prompt"] + r["rejected"]} for r in pairs(8)]
    else:
        tok, rows = tiny_tokenizer(add_bos=case == "words-bos"), pairs(12, seed=1)
    _lengthen(rows[0])  # its prompt fills --seq-len: dropped by both
    template = tok.chat_template if case.startswith("chat") else None
    want = _trl_tokenized(rows, tok, seq_len)
    got, stats = _ours(rows, tok, seq_len, template)
    assert len(got) == len(want) and stats.kept == len(want) and stats.dropped == len(rows) - len(want)
    for key in ("prompt_ids", "chosen_ids", "rejected_ids"):
        assert got[key] == want[key], key
    assert stats.dropped >= 1 and stats.kept >= 4
    assert stats.truncated == sum(len(p) + max(len(c), len(r)) > seq_len for p, c, r in
                                  zip(got["prompt_ids"], got["chosen_ids"], got["rejected_ids"]))


def test_batches_equal_trl_collator():
    from trl.trainer.dpo_trainer import DataCollatorForPreference

    tok = tiny_tokenizer(add_bos=True)
    got, _ = _ours(pairs(6, seed=4), tok, 20)
    rows = [got[i] for i in range(4)]
    ours = pref_data.collate_pairs(rows, tok.eos_token_id, 20)
    theirs = DataCollatorForPreference(pad_token_id=tok.eos_token_id, max_length=20)(
        [{k: r[k] for k in ("prompt_ids", "chosen_ids", "rejected_ids")} for r in rows])
    for key in ("input_ids", "attention_mask", "completion_mask"):
        assert torch.equal(ours[key], theirs[key]), key
    assert ours["pair_index"].tolist() == [r["index"] for r in rows] == [0, 1, 2, 3]


def test_max_prompt_len_keeps_the_prompts_end():
    tok = tiny_tokenizer(add_bos=False)
    rows = pairs(4, seed=5)
    full, _ = _ours(rows, tok, 64)
    import datasets

    cut, stats = pref_data.tokenize_pairs(datasets.Dataset.from_list(rows), tok, None, 64, 3, "test-maxprompt")
    assert stats.prompt_cut == sum(len(p) > 3 for p in full["prompt_ids"]) > 0
    for a, b in zip(full["prompt_ids"], cut["prompt_ids"]):
        assert b == a[-3:]
    assert cut["chosen_ids"] == full["chosen_ids"]


# --- the losses against numbers computed by hand ---------------------------------------------------------
# One pair: policy log-probs chosen -10 (4 completion tokens), rejected -12 (5); reference -11 and -11.
def _loss(task: str, **kw) -> PreferenceLoss:
    base = dict(pair=task_spec(task).preference, beta=0.1, loss="sigmoid", label_smoothing=0.0, rpo_alpha=0.0,
                simpo_gamma=0.5)
    return PreferenceLoss(**{**base, **kw})


def _one_pair(spec: PreferenceLoss) -> tuple[float, float, float]:
    t = lambda x: torch.tensor([x], dtype=torch.float64)  # noqa: E731
    losses, rc, rr = spec.pair_losses(t(-10.0), t(-12.0), t(4.0), t(5.0), t(-11.0), t(-11.0))
    return float(losses[0]), float(rc[0]), float(rr[0])


@pytest.mark.parametrize("spec, loss, chosen_reward, rejected_reward", [
    # DPO: z = 0.1 x ((-10+11) - (-12+11)) = 0.2; -log sigmoid(0.2) = log(1 + e^-0.2)
    (_loss("dpo"), 0.5981388693815918, 0.1, -0.1),
    # cDPO, e = 0.1: 0.9 log(1 + e^-0.2) + 0.1 log(1 + e^0.2)
    (_loss("dpo", label_smoothing=0.1), 0.9 * 0.5981388693815918 + 0.1 * 0.7981388693815918, 0.1, -0.1),
    # IPO: (1/4 - (-1)/5 - 1/(2 x 0.1))^2 = (0.45 - 5)^2
    (_loss("dpo", loss="ipo"), 20.7025, 0.1, -0.1),
    # SimPO, beta 2, gamma 0.5: z = 2 x (-10/4 - -12/5) - 0.5 = -0.7; log(1 + e^0.7); rewards 2 x the means
    (_loss("simpo", beta=2.0), 1.1031860488854576, -5.0, -4.8),
    # ORPO, lambda 0.1: log odds = (-2.5 + 2.4) - (log(1 - e^-2.5) - log(1 - e^-2.4)); -0.1 log sigmoid(that)
    (_loss("orpo"), -0.1 * math.log(1 / (1 + math.exp(-((-2.5 + 2.4) - (math.log(1 - math.exp(-2.5))
                                                                         - math.log(1 - math.exp(-2.4))))))),
     -0.25, -0.24),
])
def test_pair_losses_by_hand(spec, loss, chosen_reward, rejected_reward):
    got = _one_pair(spec)
    assert got == pytest.approx((loss, chosen_reward, rejected_reward), rel=1e-12, abs=1e-12)


def test_beta_defaults_per_task():
    for task, beta in (("dpo", 0.1), ("simpo", 2.0), ("orpo", 0.1)):
        cfg = build_config(overrides={"model.task": task, "data.path": "x.jsonl"})
        assert PreferenceLoss.from_config(cfg).beta == beta


# --- refusals -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("overrides, needle", [
    ({"model.task": "dpo", "parallel.tp": 2}, "--task dpo with --tp 2"),
    ({"model.task": "simpo", "parallel.ep": 2}, "--task simpo with --ep 2"),
    ({"model.task": "dpo", "quant.qat": "int4-weight"}, "--qat int4-weight"),
    ({"model.task": "dpo", "data.packing": "separate"}, "--packing"),
])
def test_config_refusals(overrides, needle):
    with pytest.raises(ConfigError, match=needle.replace("-", r"\-")):
        build_config(overrides=overrides)


@pytest.mark.parametrize("overrides, setting", [
    ({"pref.beta": 0.2}, "pref.beta"),
    ({"model.task": "simpo", "pref.ref_model": "x"}, "pref.ref_model"),
    ({"model.task": "dpo", "pref.simpo_gamma": 1.0}, "pref.simpo_gamma"),
    ({"model.task": "dpo", "pref.loss": "ipo", "pref.label_smoothing": 0.1}, "pref.label_smoothing"),
    ({"model.task": "dpo", "data.text_column": "body"}, "data.text_column"),
])
def test_settings_that_mean_nothing_are_refused(overrides, setting):
    from zerotrain.config.rules import unused_settings

    cfg = build_config(overrides=overrides)
    with pytest.raises(ConfigError, match=setting.replace(".", r"\.")):
        unused_settings(cfg, "deepspeed", 3, "cpu")


@pytest.mark.parametrize("row, needle", [
    ({"prompt": "a ?", "chosen": " b .", "rejected": 3}, "row 2: 'rejected' must be a string"),
    ({"prompt": [{"role": "user", "content": "a"}], "chosen": " b", "rejected": " c"}, "row 2: 'prompt' must be a string"),
])
def test_bad_rows_name_the_row(row, needle):
    with pytest.raises(UserError, match=needle.replace("(", r"\(").replace("?", r"\?")):
        pref_data.tokenize_pair(row, 2, tiny_tokenizer(), None)


def test_a_pair_without_a_preference_is_refused():
    import datasets

    rows = [pairs(1)[0], {"prompt": "a ?", "chosen": " b .", "rejected": " b ."}]
    with pytest.raises(UserError, match="row 2: chosen and rejected are the same"):
        pref_data.tokenize_pairs(datasets.Dataset.from_list(rows), tiny_tokenizer(), None, 64, None, "test-same")


def test_missing_columns_are_named():
    import datasets

    ds = datasets.Dataset.from_list([{"prompt": "a", "chosen": "b", "other": "c"}])
    with pytest.raises(UserError, match="missing 'rejected'"):
        pref_data.tokenize_pairs(ds, tiny_tokenizer(), None, 64, None, "test-missing")


def test_reference_of_another_vocabulary_is_refused(tmp_path):
    from transformers import LlamaConfig

    from zerotrain.train.reference import RefModelBuilder

    LlamaConfig(vocab_size=512, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                intermediate_size=32).save_pretrained(tmp_path)
    policy = LlamaConfig(vocab_size=1024)
    with pytest.raises(UserError, match="its vocabulary has 512 tokens, the policy's 1024"):
        RefModelBuilder(str(tmp_path), policy).check()
