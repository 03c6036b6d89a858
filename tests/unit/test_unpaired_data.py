"""KTO's rows and reward models' pairs without ranks: tokenized, unpaired and batched exactly as TRL 1.16's
KTOTrainer / RewardTrainer do (TRL's own _prepare_dataset and collators are the reference), the KL partners the same
whatever the split over ranks and micro-batches, and the one-line refusals of bad rows."""
from __future__ import annotations

import types

import pytest
import torch

from tests.support.make_pref_data import pairs, tiny_tokenizer
from zerotrain.data import preference as pref_data
from zerotrain.data import unpaired
from zerotrain.errors import UserError


def _dataset(rows: list[dict]):
    import datasets

    datasets.disable_progress_bars()
    return datasets.Dataset.from_list(rows)


def _unpaired_rows(n: int, seed: int, conversational: bool = False) -> list[dict]:
    """n rows of prompt, completion, label: pairs' chosen (desirable) and rejected (undesirable) alternating."""
    return [{"prompt": r["prompt"], "completion": r["chosen"] if i % 2 else r["rejected"], "label": bool(i % 2)}
            for i, r in enumerate(pairs(n, seed=seed, conversational=conversational))]


def _trl_kto(rows: list[dict], tokenizer, max_length: int):
    """TRL 1.16's KTOTrainer._prepare_dataset on these rows, without its KL column (zerotrain pairs KL rows per
    global batch, tests below)."""
    from trl import KTOConfig
    from trl.trainer.kto_trainer import KTOTrainer

    args = KTOConfig(output_dir="/tmp/zt-trl-unused", max_length=max_length, use_cpu=True, report_to=[])
    stub = types.SimpleNamespace(_tokenizer=tokenizer, calculate_KL=False, desirable_weight=1.0,
                                 undesirable_weight=1.0)
    return KTOTrainer._prepare_dataset(stub, _dataset(rows), tokenizer, args, "train")


@pytest.mark.parametrize("case", ["words-bos", "chat", "paired", "paired-implicit-prompt"])
def test_rows_tokenize_and_unpair_as_trl(case):
    seq_len = 24
    tok = tiny_tokenizer(add_bos=case != "paired")
    if case == "chat":
        rows = _unpaired_rows(10, seed=2, conversational=True)
    elif case == "paired":
        rows = pairs(6, seed=3)
    elif case == "paired-implicit-prompt":
        rows = [{"chosen": r["prompt"] + r["chosen"], "rejected": r["prompt"] + r["rejected"]} for r in pairs(6, seed=4)]
    else:
        rows = _unpaired_rows(10, seed=1)
    long = " ".join(["tell me about the old river"] * 12)
    if isinstance(rows[0]["prompt" if "prompt" in rows[0] else "chosen"], str):
        key = "prompt" if "prompt" in rows[0] else "chosen"
        rows[0][key] = long + " " + rows[0][key]
        if key == "chosen":
            rows[0]["rejected"] = long + " " + rows[0]["rejected"]
    else:
        rows[0]["prompt"][0]["content"] = long  # its prompt fills --seq-len: dropped by both
    want = _trl_kto(rows, tok, seq_len)
    ds = _dataset(rows)
    unpaired.check_columns(ds)
    flat = unpaired.unpair(ds, f"test-{case}")
    template = tok.chat_template if case == "chat" else None
    got, stats = unpaired.tokenize_rows(flat, tok, template, seq_len, None, f"test-{case}-{id(tok)}")
    assert len(got) == len(want) == stats.kept and stats.dropped >= 1
    for key in ("prompt_ids", "completion_ids", "label"):
        assert got[key] == want[key], key
    assert got["index"] == list(range(len(got)))  # renumbered after the drop: the loaders' and tables' row ids
    assert f"{sum(want['label'])} desirable" in stats.line(seq_len)


def test_batches_equal_trl_collator_with_trls_own_kl_rotation():
    """One micro-batch holding a whole global batch: the KL rows are TRL's +1 rotation, padded as TRL pads."""
    from trl.trainer.kto_trainer import DataCollatorForUnpairedPreference

    tok = tiny_tokenizer(add_bos=True)
    got, _ = unpaired.tokenize_rows(_dataset(_unpaired_rows(6, seed=5)), tok, None, 20, None, "test-collate")
    order = list(range(6))
    rows = unpaired.WithPartners(got, unpaired.rotated_partners(order, 6))
    ours = unpaired.collate_unpaired([rows[i] for i in order], tok.eos_token_id, 20)
    completions = [got[i]["completion_ids"] for i in order]
    theirs = DataCollatorForUnpairedPreference(pad_token_id=tok.eos_token_id, max_length=20)(
        [{"prompt_ids": got[i]["prompt_ids"], "completion_ids": got[i]["completion_ids"], "label": got[i]["label"],
          "KL_completion_ids": kl} for i, kl in zip(order, completions[-1:] + completions[:-1])])
    for key in ("input_ids", "attention_mask", "completion_mask"):
        assert torch.equal(ours[key], theirs[key]), key
        assert torch.equal(ours[f"kl_{key}"], theirs[f"KL_{key}"]), key
    assert torch.equal(ours["label"], theirs["label"])
    assert ours["kl_index"].tolist() == [5, 0, 1, 2, 3, 4]


@pytest.mark.parametrize("world, micro", [(1, 8), (2, 4), (2, 2), (4, 1)])
def test_kl_partners_depend_on_the_global_batch_only(world, micro):
    """The same rows and partners per optimizer step however the global batch of 8 is split over ranks and
    micro-batches (grad-accum = 8 / (world x micro)); every partner is another row of the same step."""
    from zerotrain.data.datasets import PreparedData, reader_for, train_loader

    tok = tiny_tokenizer(add_bos=False)
    rows, _ = unpaired.tokenize_rows(_dataset(_unpaired_rows(20, seed=6)), tok, None, 32, None, "test-partners")
    data = PreparedData(rows, None, None, None, tok.eos_token_id, "", pair_len=32,
                        reader=reader_for("unpaired-completions"))

    def steps(world: int, micro: int) -> list[set]:
        accum = 8 // (world * micro)
        per_rank = [list(train_loader(data, r, world, micro, seed=7, epoch=1, global_batch=8)) for r in range(world)]
        out = []
        for s in range(len(per_rank[0]) // accum):
            batches = [b for r in range(world) for b in per_rank[r][s * accum:(s + 1) * accum]]
            out.append({(i, k) for b in batches for i, k in zip(b["row_index"].tolist(), b["kl_index"].tolist())})
        return out

    got, want = steps(world, micro), steps(1, 8)
    assert got == want and len(got) == 20 // 8
    for step in got:
        ids = {i for i, _ in step}
        assert len(ids) == 8 and {k for _, k in step} == ids and all(i != k for i, k in step)


def test_eval_rows_pair_with_the_previous_row():
    from zerotrain.data.datasets import PreparedData, eval_loader, reader_for

    tok = tiny_tokenizer(add_bos=False)
    rows, _ = unpaired.tokenize_rows(_dataset(_unpaired_rows(5, seed=8)), tok, None, 32, None, "test-eval")
    data = PreparedData(rows, rows, None, None, tok.eos_token_id, "", pair_len=32,
                        reader=reader_for("unpaired-completions"))
    seen = {}
    for rank in range(2):
        for b in eval_loader(data, rank, 2, 2):
            for i, k, ok in zip(b["row_index"].tolist(), b["kl_index"].tolist(), b["valid"].tolist()):
                if ok:
                    seen[i] = k
    assert seen == {i: (i - 1) % 5 for i in range(5)}


@pytest.mark.parametrize("rows, match", [
    ([{"prompt": "a", "completion": "b", "label": 1}, {"prompt": "a", "completion": "c", "label": 0}],
     r"--data row 1: 'label' is 1; kto's label is true"),
    ([{"prompt": "a", "completion": "b", "label": True}, {"prompt": "a", "completion": "c", "label": True}],
     r"--data: every row is desirable \(true\); kto .* needs rows of both labels"),
    ([{"prompt": "a", "completion": "b"}], r"--data: kto reads rows of prompt, completion and label .* missing 'label'"),
])
def test_bad_rows_are_one_line(rows, match):
    ds = _dataset(rows)
    with pytest.raises(UserError, match=match) as e:
        unpaired.check_columns(ds)
        unpaired.check_labels(unpaired.unpair(ds, "test-bad"), "--data", both=True)
    assert "\n" not in str(e.value)


def test_reward_pairs_keep_their_margin_and_drop_what_is_longer_than_seq_len():
    """TRL's RewardTrainer: prompt + chosen / prompt + rejected as whole sequences (the DPO pair's prompt and
    completion ids joined), pairs longer than max_length filtered out, the margin column passed to the loss."""
    from trl import RewardConfig
    from trl.trainer.reward_trainer import RewardTrainer

    tok = tiny_tokenizer(add_bos=True)
    rows = [{**r, "margin": 0.25 * i} for i, r in enumerate(pairs(10, seed=9))]
    rows[2]["chosen"] = rows[2]["chosen"] + " and the old river" * 8  # longer than seq_len: dropped by both
    seq_len = 24
    args = RewardConfig(output_dir="/tmp/zt-trl-unused", max_length=seq_len, use_cpu=True, report_to=[])
    want = RewardTrainer._prepare_dataset(types.SimpleNamespace(), _dataset(rows), tok, args, "train")
    got, stats = pref_data.tokenize_pairs(_dataset(rows), tok, None, seq_len, None, "test-reward", drop_long=True)
    assert len(got) == len(want) == stats.kept == 10 - stats.dropped and stats.dropped >= 1 and stats.truncated == 0
    assert [p + c for p, c in zip(got["prompt_ids"], got["chosen_ids"])] == want["chosen_ids"]
    assert [p + r for p, r in zip(got["prompt_ids"], got["rejected_ids"])] == want["rejected_ids"]
    batch = pref_data.collate_pairs([got[i] for i in range(3)], tok.eos_token_id, seq_len)
    assert batch["margin"].tolist() == [rows[i]["margin"] for i in got["index"][:3]]
    bad = [dict(rows[0], margin="big")]
    with pytest.raises(UserError, match=r"--data row 1: 'margin' is 'big'; a pair's margin is a number"):
        pref_data.tokenize_pairs(_dataset(bad), tok, None, seq_len, None, "test-reward-bad", drop_long=True)
