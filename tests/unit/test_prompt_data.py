"""GRPO's prompt set (zerotrain/data/prompts.py): prompts tokenized exactly as TRL 1.16's GRPOTrainer._tokenize_prompts
does (TRL's own method is the reference), left truncation, extra columns kept for the reward functions, and the
one-line refusals."""
from __future__ import annotations

import pytest
import torch

from tests.support.make_pref_data import pairs, tiny_tokenizer
from zerotrain.data import prompts as P
from zerotrain.data.sft import chat_template
from zerotrain.errors import UserError


def _trl_prompt_ids(prompts: list, tokenizer, template=None) -> list[list[int]]:
    """TRL 1.16's GRPOTrainer._tokenize_prompts on these prompts (its own code; the trainer object holds only what
    the method reads)."""
    from trl.trainer.grpo_trainer import GRPOTrainer

    t = object.__new__(GRPOTrainer)
    t.processing_class, t.chat_template, t.tools, t.chat_template_kwargs = tokenizer, template, None, {}
    t.environment_factories, t._is_vlm = None, False
    ids, _, _ = GRPOTrainer._tokenize_prompts(t, prompts)
    return [list(x) for x in ids]


def _ds(rows: list[dict]):
    import datasets

    datasets.disable_progress_bars()
    return datasets.Dataset.from_list(rows)


def _bpe():
    from zerotrain.assets.demo import build_tokenizer

    return build_tokenizer()


def _rows(n: int, conv: bool, seed: int = 0) -> list[dict]:
    """GRPO rows: the prompt of each pair plus an answer column and a number column (reward kwargs)."""
    return [{"prompt": r["prompt"], "answer": f"ans{i}", "level": i % 3}
            for i, r in enumerate(pairs(n, seed=seed, conversational=conv))]


@pytest.mark.parametrize("case", ["words-bos", "words", "bpe", "chat-bos", "chat-bpe-chatml"])
def test_prompts_tokenize_as_trl(case):
    conv = case.startswith("chat")
    tok = _bpe() if "bpe" in case else tiny_tokenizer(add_bos=case.endswith("bos"))
    template = chat_template(tok, "chatml" if case.endswith("chatml") else None) if conv else None
    rows = _rows(9, conv, seed=4)
    ds = _ds(rows)
    assert P.conversational(ds) is conv
    out, stats = P.tokenize_prompts(ds, tok, template, None, f"t-{case}-{id(tok)}")
    expected = _trl_prompt_ids([r["prompt"] for r in rows], tok, template)
    assert [list(x) for x in out["prompt_ids"]] == expected
    assert stats.rows == 9 and stats.dropped == 0 and stats.truncated == 0
    assert stats.longest == max(len(e) for e in expected)
    if conv:  # the text is TRL's maybe_apply_chat_template prompt, tokenized without adding special tokens
        from trl.data_utils import maybe_apply_chat_template

        text = maybe_apply_chat_template({"prompt": rows[0]["prompt"]}, tok, chat_template=template)["prompt"]
        assert tok(text, add_special_tokens=False)["input_ids"] == expected[0]
        if case == "chat-bos":  # the template's BOS is not doubled by the tokenizer's
            assert expected[0].count(tok.bos_token_id) == 1


def test_left_truncation_keeps_the_last_tokens_and_columns_pass_through():
    tok = tiny_tokenizer(add_bos=True)
    rows = _rows(6, conv=False, seed=1)
    rows[2]["prompt"] = ""  # BOS only: one token, kept
    full = _trl_prompt_ids([r["prompt"] for r in rows], tok)
    out, stats = P.tokenize_prompts(_ds(rows), tok, None, 5, "t-cut")
    assert [list(x) for x in out["prompt_ids"]] == [f[-5:] for f in full]
    assert stats.truncated == sum(len(f) > 5 for f in full) and stats.truncated >= 4
    assert stats.longest == 5 and "cut to --max-prompt-len 5" in stats.line()
    assert out["prompt"] == [r["prompt"] for r in rows]
    assert out["answer"] == [r["answer"] for r in rows] and out["level"] == [r["level"] for r in rows]
    assert out["prompt_index"] == list(range(6))


def test_empty_prompts_are_dropped_and_indices_stay_the_rows():
    tok = tiny_tokenizer(add_bos=False)
    rows = _rows(5, conv=False, seed=2)
    rows[1]["prompt"] = ""
    rows[3]["prompt"] = "   "
    out, stats = P.tokenize_prompts(_ds(rows), tok, None, None, "t-empty")
    assert out["prompt_index"] == [0, 2, 4]
    assert out["answer"] == ["ans0", "ans2", "ans4"]
    assert stats.rows == 3 and stats.dropped == 2 and "2 empty dropped" in stats.line()


def test_collate_pads_left_and_hands_the_columns_over():
    tok = tiny_tokenizer(add_bos=False)
    rows = _rows(3, conv=True, seed=3)
    out, _ = P.tokenize_prompts(_ds(rows), tok, chat_template(tok, None), None, "t-collate")
    batch = P.collate_prompts([out[i] for i in range(3)], pad_id=99)
    lens = [len(x) for x in out["prompt_ids"]]
    assert [t.tolist() for t in batch["prompt_ids"]] == [list(x) for x in out["prompt_ids"]]
    width = max(lens)
    assert batch["input_ids"].shape == (3, width) and batch["attention_mask"].sum(1).tolist() == lens
    for i, n in enumerate(lens):
        assert batch["input_ids"][i, width - n:].tolist() == list(out["prompt_ids"][i])
        assert (batch["input_ids"][i, :width - n] == 99).all()
    assert batch["prompt_index"].tolist() == [0, 1, 2] and batch["prompt_index"].dtype == torch.long
    assert batch["prompt"] == [r["prompt"] for r in rows]
    assert batch["columns"] == {"answer": ["ans0", "ans1", "ans2"], "level": [0, 1, 2]}


def _one_line(e: pytest.ExceptionInfo) -> str:
    text = str(e.value)
    assert "\n" not in text
    return text


def test_refusals_are_one_line():
    tok = tiny_tokenizer()
    with pytest.raises(UserError) as e:
        P.tokenize_prompts(_ds([{"question": "why ?", "answer": "x"}]), tok, None, None, "t-r1")
    assert "'prompt' column" in _one_line(e) and "question, answer" in str(e.value)
    with pytest.raises(UserError) as e:
        P.tokenize_prompts(_ds([{"prompt": "a", "prompt_index": 3}]), tok, None, None, "t-r2")
    assert "'prompt_index'" in _one_line(e)
    mixed = [{"prompt": [{"role": "user", "content": "why ?"}]}, {"prompt": [{"content": "no role"}]}]
    with pytest.raises(UserError) as e:
        P.tokenize_prompts(_ds(mixed), tok, chat_template(tok, None), None, "t-r3")
    assert "--data row 2" in _one_line(e)
    with pytest.raises(UserError) as e:
        P.tokenize_prompts(_ds([{"prompt": "why ?"}]), tok, None, 0, "t-r4")
    assert "--max-prompt-len 0" in _one_line(e)
    with pytest.raises(UserError) as e:
        P.tokenize_prompts(_ds([{"prompt": ""}]), tok, None, None, "t-r5")
    assert "no token" in _one_line(e)
