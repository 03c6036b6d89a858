"""What a --streaming resume costs (zerotrain/data/streaming.py): it re-reads the rank's stream from the epoch's start
and skips the consumed rows untokenized. Times, on one process, reading + skipping N rows of a JSONL corpus (with a
shuffle buffer) against reading + tokenizing + packing the same N rows (what the stream does while training), with the
embedded demo tokenizer; and the rows tokenized before the first micro-batch. Writes the raw figures as JSON.

    python benchmarks/streaming_replay.py --rows 200000 --out benchmarks/results/streaming_replay.json
"""
from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
import time
from pathlib import Path

WORDS = "the cat sat on a mat while dogs ran far away under bright blue skies and green hills".split()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=200_000)
    ap.add_argument("--words", type=int, default=60, help="words per row (mean)")
    ap.add_argument("--shuffle-buffer", type=int, default=10_000)
    ap.add_argument("--out", default="benchmarks/results/streaming_replay.json")
    args = ap.parse_args()

    from zerotrain.assets.demo import build_tokenizer
    from zerotrain.config.load import build_config
    from zerotrain.data.streaming import Position, StreamLoader, prepare_stream

    rng = random.Random(0)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "corpus.jsonl"
        with path.open("w") as f:
            for i in range(args.rows):
                n = rng.randint(args.words // 2, args.words * 3 // 2)
                f.write(json.dumps({"text": f"doc{i} " + " ".join(rng.choice(WORDS) for _ in range(n))}) + "\n")
        size = path.stat().st_size
        cfg = build_config(overrides={"data.path": str(path), "data.streaming": True, "run.max_steps": 1,
                                      "data.seq_len": 512, "data.shuffle_buffer": args.shuffle_buffer})
        source = prepare_stream(cfg, build_tokenizer()).train

        t = time.perf_counter()
        skipped = sum(1 for _ in source.blocks(0, 1, 0, Position(args.rows, 0)))  # every row skipped: 0 blocks
        skip_s = time.perf_counter() - t
        assert skipped == 0 and source.skipped == args.rows

        t = time.perf_counter()
        blocks = sum(1 for _ in source.blocks(0, 1, 0))
        train_s = time.perf_counter() - t

        source.tokenized = 0
        t = time.perf_counter()
        next(StreamLoader(source, 0, 1, 4, list, agree=lambda full: full))
        first_s = time.perf_counter() - t
    out = {"rows": args.rows, "corpus_bytes": size, "shuffle_buffer": args.shuffle_buffer, "seq_len": 512,
           "skip_all_rows_s": round(skip_s, 3), "skip_rows_per_s": round(args.rows / skip_s),
           "tokenize_and_pack_all_rows_s": round(train_s, 3), "tokenize_rows_per_s": round(args.rows / train_s),
           "blocks": blocks, "first_micro_batch_s": round(first_s, 3), "rows_tokenized_before_first_batch":
           source.tokenized, "cpus": os.cpu_count()}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
