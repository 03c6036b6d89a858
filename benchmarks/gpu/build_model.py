"""Build a random-init Llama model directory (HF save_pretrained + tokenizer) and a text data file, offline.

    python benchmarks/gpu/build_model.py --out /tmp/llama1b --data /tmp/data.jsonl            # ~1.1B Llama
    python benchmarks/gpu/build_model.py --out /tmp/t --data /tmp/d.jsonl --size tiny          # CPU test

The tokenizer is zerotrain's embedded byte-level BPE (zerotrain.assets.demo.build_tokenizer, trained on
the shipped corpus in well under a second); the model's vocabulary is kept at the architecture's size
(32000 for the 1B sizes), larger than the tokenizer's, so the embedding and head cost what a real Llama's do.
The data file is the shipped corpus, its paragraphs shuffled and repeated --repeat times, as JSON lines
{"text": ...}: every runner tokenizes and packs it through zerotrain's own pipeline.

`--config-only` writes just config.json (for `zerotrain train --model-config`: from-scratch sizing runs
build the weights under zero.Init on the device, nothing is written to disk).
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

# hidden, layers, heads, kv heads, intermediate, vocab
SIZES: dict[str, tuple[int, int, int, int, int, int]] = {
    "tiny": (64, 2, 4, 2, 176, 4096),
    "1b": (2048, 22, 32, 4, 5632, 32000),   # TinyLlama-1.1B's shape: 1.10B parameters (untied head)
    "3b": (3072, 28, 24, 8, 8192, 32000),   # 3.02B
    "4b": (3072, 36, 24, 8, 8192, 32000),   # 3.82B
    "5b": (4096, 26, 32, 8, 11008, 32000),  # 4.87B
    "6b": (4096, 30, 32, 8, 11008, 32000),  # 5.58B
    "7b": (4096, 32, 32, 32, 11008, 32000),  # 6.74B (Llama-2-7B's shape)
}


def llama_config(size: str, eos: int, max_pos: int = 4096):
    from transformers import LlamaConfig

    h, n, a, kv, inter, vocab = SIZES[size]
    return LlamaConfig(hidden_size=h, num_hidden_layers=n, num_attention_heads=a, num_key_value_heads=kv,
                       intermediate_size=inter, vocab_size=vocab, max_position_embeddings=max_pos,
                       tie_word_embeddings=False, bos_token_id=eos, eos_token_id=eos, pad_token_id=eos)


def count_params(config) -> int:
    """Parameters of the model built from config (on the meta device: no memory, no time)."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        m = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in m.parameters())


def write_data(path: Path, repeat: int, seed: int = 0) -> int:
    from zerotrain.assets.demo import CORPUS

    paras = [p for p in CORPUS.read_text().splitlines() if p.strip()]
    rows = []
    rng = random.Random(seed)
    for _ in range(repeat):
        chunk = paras[:]
        rng.shuffle(chunk)
        rows += chunk
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in rows))
    return len(rows)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="model directory to write")
    ap.add_argument("--data", default="", help="JSON lines data file to write")
    ap.add_argument("--size", default="1b", choices=list(SIZES))
    ap.add_argument("--repeat", type=int, default=8, help="corpus repetitions in the data file")
    ap.add_argument("--config-only", action="store_true", help="write config.json + tokenizer, no weights")
    ap.add_argument("--device", default="cuda", help="where the random init runs (cuda if available)")
    args = ap.parse_args()
    import torch
    from transformers import AutoModelForCausalLM

    from zerotrain.assets.demo import build_tokenizer

    t0 = time.perf_counter()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer()
    cfg = llama_config(args.size, tok.eos_token_id)
    n = count_params(cfg)
    if args.config_only:
        cfg.save_pretrained(out)
    else:
        dev = args.device if (args.device != "cuda" or torch.cuda.is_available()) else "cpu"
        torch.manual_seed(0)
        with torch.device(dev):
            model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
        model.save_pretrained(out)  # float32 safetensors, like the CPU benchmarks' model
        del model
    tok.save_pretrained(out)
    rows = write_data(Path(args.data), args.repeat) if args.data else 0
    print(json.dumps({"model_dir": str(out), "size": args.size, "params": n, "tokenizer_len": len(tok),
                      "data_rows": rows, "seconds": round(time.perf_counter() - t0, 1)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
