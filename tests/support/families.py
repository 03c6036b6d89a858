"""Tiny models of the families users bring, built locally from real HF configs (dropout 0).

Each is saved with save_pretrained and trained through the real from_pretrained path:
- gpt2:    Conv1D projections, tied embeddings, learned positions.
- llama:   RMSNorm, rotary, grouped-query attention (4 query / 2 key-value heads), untied head.
- qwen2:   q/k/v biases and sliding-window attention (window 16 < the tests' 32 tokens, every layer).
- mistral, qwen2-alternating (not in FAMILIES, so not in the whole matrix: the pipeline mask tests):
  a sliding window (16) on every block, and full / sliding blocks alternating (`layer_types`).
- mixtral, qwen3-moe: mixtures of experts (4 experts top-2 / 8 experts top-2, fused 3-D expert weights,
  a router per block, the router load-balancing loss on as zerotrain trains them by default); deepseek-v3:
  DeepSeek-style (latent attention, a dense first block, 8 routed experts top-2 + a shared expert, no router loss); qwen3-moe-top1 (SPARSE_MOE): 16 experts top-1, so a small micro-batch leaves experts idle;
  gpt-oss, phimoe (ROUTER_MOE): 4 experts top-2 behind a module named `router` (gpt-oss: biased router and experts;
  Phi-MoE: sparsemixer routing, jitter 0).
- bert, roberta: an encoder BODY (BertModel / RobertaModel) is saved, and the tests load it with
  AutoModelForSequenceClassification, so the classification head is initialised at load time, as
  with a hub checkpoint (the all-MiniLM-L6-v2 path).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

VOCAB = 1024
NUM_LABELS = 2
_SMALL = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128, vocab_size=VOCAB)
_ENCODER = dict(_SMALL, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, max_position_embeddings=64)


@dataclass(frozen=True)
class Family:
    name: str
    task: str
    """'causal-lm' or 'seq-cls' (a fresh head on a saved body)."""
    config: Callable[[], Any]
    """The HF config of what is saved (for seq-cls: the body)."""
    body: str = ""
    """seq-cls: the transformers class of the saved body."""
    block: str = ""
    """The transformer-block class zerotrain must pick (model_info.block_classes)."""


def _gpt2():
    from transformers import GPT2Config

    return GPT2Config(n_layer=2, n_head=4, n_embd=64, n_positions=256, vocab_size=VOCAB, bos_token_id=0,
                      eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)


def _llama():
    from transformers import LlamaConfig

    return LlamaConfig(**_SMALL, num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False,
                       bos_token_id=0, eos_token_id=0)


def _qwen2():
    from transformers import Qwen2Config

    # max_window_layers 0: every layer is a sliding-window layer
    return Qwen2Config(**_SMALL, num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False,
                       use_sliding_window=True, sliding_window=SLIDING_WINDOW, max_window_layers=0,
                       bos_token_id=0, eos_token_id=0)


def _mistral():
    from transformers import MistralConfig

    return MistralConfig(**_SMALL, num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False,
                         sliding_window=SLIDING_WINDOW, bos_token_id=0, eos_token_id=0)


def _qwen2_alternating():
    from transformers import Qwen2Config

    return Qwen2Config(**_SMALL, num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False,
                       use_sliding_window=True, sliding_window=SLIDING_WINDOW,
                       layer_types=["full_attention", "sliding_attention"], bos_token_id=0, eos_token_id=0)


def _bert():
    from transformers import BertConfig

    return BertConfig(**_ENCODER, pad_token_id=0)


def _roberta():
    from transformers import RobertaConfig

    # RoBERTa's positions start after the pad id: max_position_embeddings covers seq + 2
    return RobertaConfig(**_ENCODER, pad_token_id=1, bos_token_id=0, eos_token_id=2)


def _qwen2_mqa():
    from transformers import Qwen2Config

    # full attention in every block, one key/value head (multi-query): sequence parallelism repeats it per rank
    return Qwen2Config(**_SMALL, num_key_value_heads=1, max_position_embeddings=256, tie_word_embeddings=False,
                       use_sliding_window=False, bos_token_id=0, eos_token_id=0)


def _mixtral():
    from transformers import MixtralConfig

    # 4 experts, top-2 routing in every block; the router's aux loss off (transformers' default)
    return MixtralConfig(**_SMALL, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                         max_position_embeddings=256, tie_word_embeddings=False, bos_token_id=0, eos_token_id=0)


def _qwen3_moe(experts: int = 8, top_k: int = 2):
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(**_SMALL, num_key_value_heads=2, head_dim=16, moe_intermediate_size=64, num_experts=experts,
                          num_experts_per_tok=top_k, max_position_embeddings=256, tie_word_embeddings=False,
                          bos_token_id=0, eos_token_id=0)


def _deepseek_v3():
    from transformers import DeepseekV3Config

    # DeepSeek-style: multi-head latent attention, block 0 dense, block 1 a mixture of 8 routed experts (top-2)
    # plus one shared expert every token goes through; transformers defines no router loss for it
    return DeepseekV3Config(**_SMALL, moe_intermediate_size=32, num_key_value_heads=4,
                            n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, n_group=1, topk_group=1,
                            first_k_dense_replace=1, q_lora_rank=None, kv_lora_rank=16, qk_rope_head_dim=8,
                            qk_nope_head_dim=8, v_head_dim=16, max_position_embeddings=256, tie_word_embeddings=False,
                            bos_token_id=0, eos_token_id=0)


def _qwen3_moe_sparse():
    return _qwen3_moe(experts=16, top_k=1)


def _gpt_oss():
    from transformers import GptOssConfig

    # 4 experts top-2 with biased expert projections, a router with a bias (`router`, not `gate`), attention sinks,
    # sliding and full attention blocks alternating; transformers' router loss on (0.001)
    return GptOssConfig(**{**_SMALL, "intermediate_size": 64}, num_key_value_heads=2, head_dim=16, num_local_experts=4,
                        num_experts_per_tok=2, sliding_window=SLIDING_WINDOW, max_position_embeddings=256,
                        rope_parameters={"rope_type": "default", "rope_theta": 150000.0},
                        tie_word_embeddings=False, bos_token_id=0, eos_token_id=0, pad_token_id=0)


def _phimoe():
    from transformers import PhimoeConfig

    # 4 experts top-2 routed by sparsemixer (`router`, an nn.Linear); its jitter noise 0: in training it then picks
    # the top-2 deterministically (Gumbel sampling over one unmasked logit), so one process and 2 ranks agree
    return PhimoeConfig(**_SMALL, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                        router_jitter_noise=0.0, input_jitter_noise=0.0, max_position_embeddings=256,
                        tie_word_embeddings=False, bos_token_id=0, eos_token_id=0, pad_token_id=0)


SLIDING_WINDOW = 16
FAMILIES: dict[str, Family] = {f.name: f for f in [
    Family("gpt2", "causal-lm", _gpt2, block="GPT2Block"),
    Family("llama", "causal-lm", _llama, block="LlamaDecoderLayer"),
    Family("qwen2", "causal-lm", _qwen2, block="Qwen2DecoderLayer"),
    Family("mixtral", "causal-lm", _mixtral, block="MixtralDecoderLayer"),
    Family("qwen3-moe", "causal-lm", _qwen3_moe, block="Qwen3MoeDecoderLayer"),
    Family("deepseek-v3", "causal-lm", _deepseek_v3, block="DeepseekV3DecoderLayer"),
    Family("bert", "seq-cls", _bert, body="BertModel", block="BertLayer"),
    Family("roberta", "seq-cls", _roberta, body="RobertaModel", block="RobertaLayer"),
]}
MASKED_DECODERS: dict[str, Family] = {f.name: f for f in [
    Family("mistral", "causal-lm", _mistral, block="MistralDecoderLayer"),
    Family("qwen2-alternating", "causal-lm", _qwen2_alternating, block="Qwen2DecoderLayer"),
]}
"""Decoders whose blocks need their own mask (pipeline_parts builds it per block)."""
SPARSE_MOE: dict[str, Family] = {"qwen3-moe-top1": Family("qwen3-moe-top1", "causal-lm", _qwen3_moe_sparse,
                                                          block="Qwen3MoeDecoderLayer")}
"""A mixture of experts routing each token to 1 of 16 experts: a micro-batch of fewer than 16 tokens leaves some
expert without a token on every rank (the ZeRO-3 hang of the MoE trackers)."""
ROUTER_MOE: dict[str, Family] = {f.name: f for f in [
    Family("gpt-oss", "causal-lm", _gpt_oss, block="GptOssDecoderLayer"),
    Family("phimoe", "causal-lm", _phimoe, block="PhimoeDecoderLayer"),
]}
"""Mixtures of experts whose router is named `router`, not `gate` (tests/multirank/test_moe.py's matrix; not in
FAMILIES, so the whole family matrix does not grow)."""
GQA_DECODERS: dict[str, Family] = {"qwen2-mqa": Family("qwen2-mqa", "causal-lm", _qwen2_mqa, block="Qwen2DecoderLayer")}
"""A decoder with fewer key/value heads than a sequence-parallel size of 2 (one: multi-query attention)."""


def make_model_dir(family: str, path: str | Path, seed: int = 0) -> Path:
    """Save the family's tiny model (seq-cls: only the body) with seeded random weights."""
    import transformers

    fam = {**FAMILIES, **MASKED_DECODERS, **GQA_DECODERS, **SPARSE_MOE, **ROUTER_MOE}[family]
    torch.manual_seed(seed)
    cls = getattr(transformers, fam.body) if fam.body else transformers.AutoModelForCausalLM
    model = cls(fam.config()) if fam.body else cls.from_config(fam.config())
    path = Path(path)
    model.save_pretrained(str(path), safe_serialization=True)
    return path


def builder(model_dir: str | Path, task: str, seed: int = 0, gradient_checkpointing: bool = False):
    """zerotrain's ModelBuilder for the saved model: what the engine calls, and what the reference
    calls, so a seq-cls head is initialised from the same seed in both."""
    from transformers import AutoConfig

    from zerotrain.model.source import ModelBuilder, ModelSource
    from zerotrain.tasks import task_spec

    source = ModelSource(task_spec(task), str(model_dir), AutoConfig.from_pretrained(str(model_dir)), tokenizer=None,
                         gradient_checkpointing=gradient_checkpointing)
    return ModelBuilder(source, {"num_labels": NUM_LABELS} if task == "seq-cls" else {}, seed=seed)


def model_inputs(x: torch.Tensor, task: str) -> dict[str, torch.Tensor]:
    """Forward kwargs for token ids x: causal-lm predicts x; seq-cls learns a label read off the
    first token (learnable, and the same in every process)."""
    if task == "seq-cls":
        return {"input_ids": x, "labels": x[:, 0] % NUM_LABELS}
    return {"input_ids": x, "labels": x}


def masked_labels(x: torch.Tensor) -> torch.Tensor:
    """Causal-LM labels with a prompt-like prefix of each row at -100, its length set by the row's first
    token (0 to 3/4 of the row): label-token counts then differ between micro-batches and ranks, as
    assistant-only chat labels do."""
    labels = x.clone()
    for i, row in enumerate(x):
        labels[i, :int(row[0]) % (3 * x.shape[1] // 4)] = -100
    return labels


def frozen_embeddings(build: Callable[[], torch.nn.Module]) -> Callable[[], torch.nn.Module]:
    """The factory with the input embeddings frozen: the first block's input then carries no gradient
    (the case a ZeRO-3 leaf block needs DeepSpeedEngine._guard_leaf_inputs for)."""

    def frozen() -> torch.nn.Module:
        model = build()
        model.get_input_embeddings().requires_grad_(False)
        return model

    return frozen
