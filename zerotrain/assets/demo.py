"""The embedded model: a small GPT-2 and a BPE tokenizer built locally from the shipped corpus.

Nothing is downloaded. The tokenizer is trained with the `tokenizers` package (well under a second),
wrapped as a transformers `PreTrainedTokenizerFast`; the model is built with `from_config`. Both are
written with `save_pretrained` into a cache directory, and training then loads them back through the
ordinary `from_pretrained` path, exactly as for a hub model.

Every rank may call `ensure_tiny_model` at once (before any process group exists): each builds into
its own temporary directory and renames it into place atomically; the build is deterministic, so
whichever rank wins, the directory is the same.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path

ASSETS = Path(__file__).resolve().parent  # this folder: corpus.txt, sentiment.jsonl
CORPUS = ASSETS / "corpus.txt"
"""The embedded causal-LM text (one paragraph per line)."""
SENTIMENT = ASSETS / "sentiment.jsonl"
"""The embedded seq-cls set: {"text", "label"} with labels "positive"/"negative"."""

EOS = "<|endoftext|>"

# Named tiny architectures for offline tests, benchmarks and the embedded demo (HF config keys of model_type).
TINY_PRESETS: dict[str, dict] = {
    "tiny-gpt2": dict(model_type="gpt2", n_layer=2, n_head=4, n_embd=64, n_positions=256, vocab_size=1024,
                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
    "small-gpt2": dict(model_type="gpt2", n_layer=4, n_head=4, n_embd=256, n_positions=512, vocab_size=4096,
                       resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
    # Llama family (RMSNorm, rotary, GQA: 2 key/value heads for 4 query heads, untied head), the
    # same widths as the GPT-2 presets so benchmarks compare families at one size.
    "tiny-llama": dict(model_type="llama", num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       hidden_size=64, intermediate_size=176, max_position_embeddings=256, vocab_size=1024,
                       tie_word_embeddings=False),
    "small-llama": dict(model_type="llama", num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                        hidden_size=256, intermediate_size=688, max_position_embeddings=512, vocab_size=4096,
                        tie_word_embeddings=False),
    # Qwen2 at small-llama's widths (q/k/v biases, full attention): the second family of benchmarks/quantize.py.
    "small-qwen2": dict(model_type="qwen2", num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                        hidden_size=256, intermediate_size=688, max_position_embeddings=512, vocab_size=4096,
                        tie_word_embeddings=False, use_sliding_window=False),
    # Mixtures of experts (tiny-llama's widths): Qwen3-MoE with 8 experts, top-2, and Mixtral with 4, top-2; both
    # train with their router load-balancing loss (router_aux_loss_coef 0.001) and run under --ep.
    "tiny-qwen3-moe": dict(model_type="qwen3_moe", num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                           head_dim=16, hidden_size=64, intermediate_size=176, moe_intermediate_size=64,
                           num_experts=8, num_experts_per_tok=2, max_position_embeddings=256, vocab_size=1024,
                           tie_word_embeddings=False),
    "tiny-mixtral": dict(model_type="mixtral", num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         hidden_size=64, intermediate_size=88, num_local_experts=4, num_experts_per_tok=2,
                         max_position_embeddings=256, vocab_size=1024, tie_word_embeddings=False),
}

DEMO_PRESET = "small-gpt2"
"""Architecture of the embedded demo model (a name in TINY_PRESETS)."""
_BUILD_VERSION = "1"  # bump when the build recipe changes, so caches are rebuilt


def cache_root() -> Path:
    """Where built models live: $ZEROTRAIN_CACHE, else ~/.cache/zerotrain."""
    return Path(os.environ.get("ZEROTRAIN_CACHE") or Path.home() / ".cache" / "zerotrain")


def build_tokenizer(vocab_size: int = 4096):
    """A byte-level BPE trained on the embedded corpus, as a PreTrainedTokenizerFast (eos = pad = bos)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train([str(CORPUS)], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=EOS, eos_token=EOS, unk_token=EOS,
                                   pad_token=EOS, model_max_length=None)


def build_tiny(out_dir: str | Path, preset: str = DEMO_PRESET, seed: int = 0) -> Path:
    """Write a fresh model (random init, `seed`) + tokenizer with save_pretrained into out_dir."""
    import torch
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM


    tokenizer = build_tokenizer()
    kw = dict(TINY_PRESETS[preset])
    # The corpus has a small vocabulary: size the embedding to the tokenizer (a multiple of 64).
    kw["vocab_size"] = -(-len(tokenizer) // 64) * 64
    eos = tokenizer.eos_token_id
    config = CONFIG_MAPPING[kw.pop("model_type")](bos_token_id=eos, eos_token_id=eos, pad_token_id=eos, **kw)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    out = Path(out_dir)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    if not (out / "config.json").is_file():  # transformers saves on rank 0 only once a process group exists
        raise RuntimeError(f"build_tiny: save_pretrained wrote no model into {out}; call ensure_tiny_model "
                           "before torch.distributed is initialised")
    return out


def _key(preset: str, seed: int) -> str:
    h = hashlib.sha256()
    for part in (_BUILD_VERSION, preset, str(seed), CORPUS.read_bytes()):
        h.update(part if isinstance(part, bytes) else part.encode())
    return h.hexdigest()[:12]


def ensure_tiny_model(preset: str = DEMO_PRESET, seed: int = 0) -> Path:
    """The cached embedded model directory, built on first use (safe to call from every rank at once)."""
    final = cache_root() / "models" / f"{preset}-{_key(preset, seed)}"
    if (final / "config.json").is_file() and (final / "tokenizer.json").is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=final.parent))
    try:
        build_tiny(tmp, preset, seed)
        try:
            os.rename(tmp, final)  # atomic; fails if another rank got there first
        except OSError:
            if not (final / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final
