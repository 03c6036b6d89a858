"""Preference data and tiny model dirs for the TRL reference (tests/support/trl_reference.py).

- write_pairs: n deterministic {"prompt", "chosen", "rejected"} rows of short English strings (or the
  conversational form: message lists), lengths varying so that padding is exercised.
- tiny_model: families.make_model_dir plus a word-level tokenizer saved next to it, so that
  AutoTokenizer.from_pretrained(dir) works offline (make_model_dir saves the weights and config only).

The tokenizer (ids < families.VOCAB): one token per word or punctuation mark (whitespace / punctuation split,
so a leading space never makes a token and prompt + " completion" tokenizes as prompt's ids + completion's ids).
id 0 "<|endoftext|>" is bos and eos (the configs say bos_token_id = eos_token_id = 0), 1 "<unk>",
2/3 "<|im_start|>"/"<|im_end|>" for the chat template; no pad token (TRL then pads with eos).
- gpt2 style: no BOS added by the tokenizer (as GPT-2's), chat template without BOS.
- llama style: the tokenizer prepends BOS (id 0) to every encoded text (as Llama's), the chat template
  starts with {{ bos_token }}.
"""
from __future__ import annotations

import json
import random
from pathlib import Path

BOS_EOS = "<|endoftext|>"
UNK = "<unk>"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
SPECIAL = [BOS_EOS, UNK, IM_START, IM_END]
ROLES = ["system", "user", "assistant"]
PUNCT = ["?", ".", ","]
PROMPT_WORDS = ["tell", "me", "about", "the", "red", "house", "near", "old", "river", "why", "do", "birds", "sing",
                "in", "morning", "what", "is", "a", "good", "name", "for", "small", "dog", "how", "can", "i", "cook",
                "rice", "quickly", "explain", "rain", "to", "child", "please", "write", "short", "poem", "on", "snow",
                "which", "city", "has", "best", "food", "where", "should", "we", "go", "this", "summer"]
ANSWER_WORDS = ["it", "was", "built", "long", "ago", "they", "are", "happy", "try", "max", "or", "buddy", "boil",
                "water", "first", "then", "add", "salt", "clouds", "drop", "falls", "soft", "white", "quiet", "night",
                "rome", "paris", "tokyo", "beach", "mountains", "green", "blue", "fast", "slow", "yes", "no", "maybe",
                "because", "light", "warm", "cold", "bread", "sun", "moon", "stars", "sleep", "walk", "read", "books"]
WORDS = list(dict.fromkeys(ROLES + PUNCT + PROMPT_WORDS + ANSWER_WORDS))

_CHAT = ("{% for message in messages %}" + IM_START + " {{ message['role'] }} {{ message['content'] }} " + IM_END
         + " {% endfor %}{% if add_generation_prompt %}" + IM_START + " assistant {% endif %}")


def _sentence(rng: random.Random, words: list[str], lo: int, hi: int) -> str:
    return " ".join(rng.choice(words) for _ in range(rng.randint(lo, hi)))


def pairs(n: int = 8, seed: int = 0, conversational: bool = False) -> list[dict]:
    """n deterministic rows: prompt 5-12 words + '?', chosen / rejected 3-10 words + '.', chosen != rejected.

    Standard rows: chosen / rejected start with a space (prompt + chosen is the whole text, as TRL joins them).
    Conversational rows: prompt [user message], chosen / rejected [assistant message]."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        prompt = _sentence(rng, PROMPT_WORDS, 5, 12) + " ?"
        chosen = _sentence(rng, ANSWER_WORDS, 3, 10) + " ."
        rejected = chosen
        while rejected == chosen:
            rejected = _sentence(rng, ANSWER_WORDS, 3, 10) + " ."
        if conversational:
            rows.append({"prompt": [{"role": "user", "content": prompt}],
                         "chosen": [{"role": "assistant", "content": chosen}],
                         "rejected": [{"role": "assistant", "content": rejected}]})
        else:
            rows.append({"prompt": prompt, "chosen": " " + chosen, "rejected": " " + rejected})
    return rows


def write_pairs(path: str | Path, n: int = 8, seed: int = 0, conversational: bool = False) -> Path:
    """Write pairs(n, seed, conversational) as .jsonl (one row a line)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in pairs(n, seed, conversational)))
    return path


def tiny_tokenizer(add_bos: bool = False):
    """The word-level tokenizer described in the module docstring (a PreTrainedTokenizerFast)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(SPECIAL + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    if add_bos:
        tok.post_processor = processors.TemplateProcessing(single=f"{BOS_EOS} $A", pair=f"{BOS_EOS} $A $B",
                                                           special_tokens=[(BOS_EOS, 0)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS_EOS, eos_token=BOS_EOS, unk_token=UNK,
                                   additional_special_tokens=[IM_START, IM_END])
    fast.chat_template = ("{{ bos_token }}" if add_bos else "") + _CHAT
    return fast


def tiny_model(family: str, path: str | Path) -> Path:
    """tests.support.families.make_model_dir(family, path), plus the tiny tokenizer saved into the same dir
    (llama: BOS-adding variant)."""
    from tests.support.families import VOCAB, make_model_dir

    path = make_model_dir(family, path)
    tok = tiny_tokenizer(add_bos=family == "llama")
    assert len(tok) <= VOCAB
    tok.save_pretrained(str(path))
    return path
