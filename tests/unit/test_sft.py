"""Chat / prompt-completion data (zerotrain/data/sft.py): assistant-only labels against a mask written out by
hand, the loss of a two-sample chat batch computed by hand, packing that keeps documents apart (a packed
row's loss equals its documents run one by one, on GPT-2 and Llama), format detection and one-line errors."""
from __future__ import annotations

import json

import pytest
import torch

import tests.support.families as families
from zerotrain.data import sft
from zerotrain.errors import UserError

WORDS = ["user", "assistant", "system", "hi", "there", "hello", "how", "are", "you", "fine", "thanks", "be",
         "brief", "ok", "bye", "good"]
SPECIAL = ["<|im_start|>", "<|im_end|>", "<pad>"]


def word_tokenizer():
    """Word-level tokenizer: one token per word, so an expected label mask can be written by hand."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(SPECIAL + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<|im_end|>")
    fast.add_special_tokens({"additional_special_tokens": SPECIAL[:2]})
    return fast


def ids(tok, words: str) -> list[int]:
    return tok.convert_tokens_to_ids(words.split())


CHAT_A = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"},
          {"role": "assistant", "content": "hello"}]
CHAT_B = [{"role": "user", "content": "how are you"}, {"role": "assistant", "content": "fine thanks"},
          {"role": "user", "content": "ok bye"}, {"role": "assistant", "content": "bye"}]


def test_chat_labels_are_the_assistant_turns_only():
    tok = word_tokenizer()
    enc = sft.encode({"messages": [CHAT_A, CHAT_B]}, "chat", tok, sft.CHATML, 64, False, "truncate", "text")
    I = sft.IGNORE  # noqa: E741
    S, E = tok.convert_tokens_to_ids("<|im_start|>"), tok.convert_tokens_to_ids("<|im_end|>")
    # written out by hand: <|im_start|> role words <|im_end|> per turn; labels on the assistant's words + its <|im_end|>
    assert enc.input_ids[0] == [S, *ids(tok, "system be brief"), E, S, *ids(tok, "user hi there"), E,
                                S, *ids(tok, "assistant hello"), E]
    assert enc.labels[0] == [I, I, I, I, I, I, I, I, I, I, I, I, *ids(tok, "hello"), E]
    assert enc.labels[1] == [I] * 8 + [*ids(tok, "fine thanks"), E] + [I] * 7 + [*ids(tok, "bye"), E]
    everything = sft.encode({"messages": [CHAT_A]}, "chat", tok, sft.CHATML, 64, True, "truncate", "text")
    assert everything.labels[0] == everything.input_ids[0]  # --train-on-prompt


def test_loss_of_a_two_sample_chat_batch_counts_assistant_tokens_only(tmp_path):
    """The product's batch (collate) through the model's own loss == cross-entropy over the hand-picked tokens."""
    import transformers

    from zerotrain.data.text import collate

    tok = word_tokenizer()
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, intermediate_size=64,
        vocab_size=len(tok))).eval()
    enc = sft.encode({"messages": [CHAT_A, CHAT_B]}, "chat", tok, sft.CHATML, 64, False, "truncate", "text")
    batch = collate([{"input_ids": i, "labels": lab} for i, lab in zip(enc.input_ids, enc.labels)], tok.pad_token_id)
    with torch.no_grad():
        loss = model(**batch).loss
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    # by hand: position t predicts token t+1; only assistant tokens (hello <|im_end|> / fine thanks <|im_end|>
    # bye <|im_end|>) are targets
    E = tok.convert_tokens_to_ids("<|im_end|>")
    targets = {0: {12: ids(tok, "hello")[0], 13: E},
               1: {8: ids(tok, "fine")[0], 9: ids(tok, "thanks")[0], 10: E, 18: ids(tok, "bye")[0], 19: E}}
    terms = [torch.nn.functional.cross_entropy(logits[b, t - 1], torch.tensor(y), reduction="sum")
             for b, tt in targets.items() for t, y in tt.items()]
    assert batch["input_ids"][1, 18] == ids(tok, "bye")[0]
    torch.testing.assert_close(loss, torch.stack(terms).mean(), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_packed_row_loss_equals_its_documents_run_one_by_one(tmp_path, family):
    import transformers

    from zerotrain.data.text import collate

    model = transformers.AutoModelForCausalLM.from_pretrained(str(families.make_model_dir(family, tmp_path / family)))
    model.eval()
    assert sft.supports_packing(type(model))
    g = torch.Generator().manual_seed(3)
    docs = [torch.randint(1, families.VOCAB, (n,), generator=g).tolist() for n in (7, 12, 5)]
    rows = sft.pack(docs, docs, seq_len=32)
    assert len(rows["input_ids"]) == 1 and rows["position_ids"][0] == [*range(7), *range(12), *range(5)]
    batch = collate([{k: v[0] for k, v in rows.items()}], pad_id=0)
    assert "attention_mask" not in batch and int(batch.pop("real_tokens")) == 24 and batch["use_cache"] is False
    with torch.no_grad():
        packed = model(**batch).loss
        per_doc = [model(input_ids=torch.tensor([d]), labels=torch.tensor([d])).loss for d in docs]
        crossing = model(input_ids=batch["input_ids"], labels=batch["labels"], use_cache=False,
                         position_ids=batch["position_ids"],
                         attention_mask=torch.ones_like(batch["input_ids"])).loss  # one causal mask over all
    weights = torch.tensor([len(d) - 1 for d in docs], dtype=torch.float32)
    expected = (torch.stack(per_doc) * weights).sum() / weights.sum()
    torch.testing.assert_close(packed, expected, rtol=1e-5, atol=1e-6)
    assert abs(float(crossing) - float(expected)) > 1e-4  # the test can fail: attention across documents shows


def test_prompt_completion_and_alpaca_rows():
    tok = word_tokenizer()
    I = sft.IGNORE  # noqa: E741
    pc = sft.encode({"prompt": ["how are you"], "completion": ["fine thanks"]}, "prompt-completion", tok, None,
                    64, False, "truncate", "text")
    E = tok.eos_token_id
    assert pc.input_ids[0] == ids(tok, "how are you fine thanks") + [E]
    assert pc.labels[0] == [I, I, I, *ids(tok, "fine thanks"), E]
    alpaca = sft.encode({"instruction": ["how are"], "input": ["you"], "output": ["good"]}, "prompt-completion",
                        tok, None, 64, False, "truncate", "text")
    assert alpaca.input_ids[0] == ids(tok, "how are you good") + [E]
    assert alpaca.labels[0] == [I, I, I, *ids(tok, "good"), E]


def test_truncation_cuts_or_drops_and_counts():
    tok = word_tokenizer()
    rows = {"messages": [CHAT_A, CHAT_B]}
    cut = sft.encode(rows, "chat", tok, sft.CHATML, 16, False, "truncate", "text")
    assert cut.truncated == 1 and all(len(x) <= 16 for x in cut.input_ids)  # CHAT_B (20 tokens) cut, still has "fine thanks"
    dropped = sft.encode(rows, "chat", tok, sft.CHATML, 16, False, "drop", "text")
    assert dropped.dropped == 1 and len(dropped.input_ids) == 1
    nothing_left = sft.encode({"messages": [CHAT_A]}, "chat", tok, sft.CHATML, 10, False, "truncate", "text")
    assert nothing_left.dropped == 1 and not nothing_left.input_ids  # the answer was cut off: nothing to learn


def test_format_detection_and_one_line_errors(tmp_path):
    assert sft.detect_format(["messages"], "text", "auto", "d") == "chat"
    assert sft.detect_format(["prompt", "completion"], "text", "auto", "d") == "prompt-completion"
    assert sft.detect_format(["instruction", "input", "output"], "text", "auto", "d") == "prompt-completion"
    assert sft.detect_format(["text"], "text", "auto", "d") == "text"
    assert sft.detect_format(["foo"], "text", "auto", "d") == "text"  # the data check then names --text-column
    with pytest.raises(UserError, match="--data-format chat: --data d has no 'messages'"):
        sft.detect_format(["text"], "text", "chat", "d")
    tok = word_tokenizer()
    with pytest.raises(UserError, match="row 2: message 0 lacks a 'role' or 'content'"):
        sft.encode({"messages": [CHAT_A, [{"content": "hi"}]]}, "chat", tok, sft.CHATML, 64, False, "truncate", "text")
    with pytest.raises(UserError, match="the tokenizer has none; pass --chat-template chatml"):
        sft.chat_template(tok, None)
    bad = tmp_path / "bad.jinja"
    bad.write_text("{% for m in messages %}{{ m['nope'] | undefined_filter }}{% endfor %}")
    with pytest.raises(UserError, match="row 1: the chat template failed to render it"):
        sft.encode({"messages": [CHAT_A]}, "chat", tok, sft.chat_template(tok, str(bad)), 64, False, "truncate", "text")


def test_prepare_data_chat_file_with_packing_reports_stats(tmp_path):
    from zerotrain.config.load import build_config
    from zerotrain.data.datasets import prepare_data

    tok = word_tokenizer()
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps({"messages": m}) + "\n" for m in [CHAT_A, CHAT_B] * 10))
    cfg = build_config(overrides={"data.path": str(path), "data.seq_len": 48, "data.chat_template": "chatml",
                                  "data.packing": "separate"})
    data = prepare_data(cfg, tok)
    assert "(chat)" in data.description and "20 samples (0 truncated, 0 dropped" in data.description
    assert "efficiency" in data.description
    row = data.train[0]
    assert set(row) == {"input_ids", "labels", "position_ids"} and len(row["input_ids"]) <= 48
    assert row["position_ids"][0] == 0 and 0 in row["position_ids"][1:]  # at least two samples share the row
