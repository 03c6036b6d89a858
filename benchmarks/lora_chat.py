"""LoRA on chat data: zerotrain vs HF Trainer + peft at ZeRO-3, and packed vs padded rows, side by side.

    .venv/bin/python benchmarks/lora_chat.py --rounds 2 --out /tmp/lora.md     # ~15 min on 2 cores

Job: the locally built `small-llama` (4 layers x 256, GQA, vocab 4096) with its tokenizer, a synthetic
chat corpus of 1-2 turns (sentences of zerotrain's embedded corpus as the turns, so lengths vary),
chatml, LoRA r=16 alpha=32 all-linear, 2 ranks over gloo, ZeRO-3, micro-batch 4, seq-len 512, AdamW lr
2e-4 constant, 16 optimizer steps, bf16 where the CPU has native bf16 kernels (fp32 elsewhere).
Runners, interleaved per round (order rotated each round):
  zerotrain   `zerotrain train --lora-r 16 --stage 3` (padded rows, one sample each)
  hf_trainer  benchmarks/peers/hf_trainer_lora.py: HF Trainer + peft on zerotrain's tokenized rows, with
              the ds_config.json that round's zerotrain run wrote (the same DeepSpeed config)
  packed      the zerotrain run with --packing (several samples per 512-token row)
Per run: the median step time after 4 warm-up steps (zerotrain: metrics.jsonl step_time_s;
HF Trainer: time between optimizer-step ends on rank 0), and zerotrain's real (non-padding)
tokens/s. Speed ratio = HF step time / zerotrain step time from the same round (>= 1.0: zerotrain
faster); packing gain = packed real tokens/s / padded real tokens/s.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO))
from zerotrain.util import free_port  # noqa: E402

PRESET, SEQ, MICRO, STEPS, WARMUP, LR, R = "small-llama", 512, 4, 16, 4, 2e-4, 16


def env() -> dict:
    e = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
             OMP_NUM_THREADS="1", MLFLOW_TRACKING_URI="")
    e["PYTHONPATH"] = str(REPO)
    return e


def torchrun(args: list[str], log: Path, timeout: float = 900) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
           f"--master_port={free_port()}", *args]
    with open(log, "w") as f:
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env(), cwd=REPO, timeout=timeout).returncode
    if rc != 0:
        raise SystemExit(f"failed ({rc}): {' '.join(cmd)}; see {log}")


def chat_corpus(path: Path, n: int = 1200) -> Path:
    from zerotrain.assets.demo import CORPUS

    sentences = [s.strip() + "." for s in Path(CORPUS).read_text().replace("\n", " ").split(".") if len(s.strip()) > 20]
    rows = []
    for i in range(n):  # 1-2 turns of one corpus sentence each way: samples of ~50-250 tokens
        msgs = [{"role": "system", "content": "Answer in the style of the corpus."}] if i % 2 else []
        for t in range(1 + i % 2):
            k = (i * 7 + t * 13) % len(sentences)
            msgs.append({"role": "user", "content": sentences[k][:40 + (i * 11) % 160]})
            msgs.append({"role": "assistant", "content": sentences[(k + 1) % len(sentences)]})
        rows.append({"messages": msgs})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def zerotrain_run(work: Path, name: str, mdir: Path, data: Path, precision: str, packing: bool) -> dict:
    out = work / name
    args = ["-m", "zerotrain", "train", "--model", str(mdir), "--data", str(data), "--chat-template", "chatml",
            "--lora-r", str(R), "--lora-alpha", str(2 * R), "--stage", "3", "--micro-batch", str(MICRO),
            "--seq-len", str(SEQ), "--lr", str(LR), "--schedule", "constant", "--max-steps", str(STEPS),
            "--precision", precision, "--no-save-final", "--output", str(out), "--overwrite"]
    torchrun(args + (["--packing"] if packing else []), work / f"{name}.log")
    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in recs if "step_time_s" in r][WARMUP:]
    return {"step_time_s": statistics.median(r["step_time_s"] for r in steps),
            "tokens_per_s": statistics.median(r["tokens_per_s"] for r in steps),
            "ds_config": str(out / "ds_config.json")}


def hf_run(work: Path, name: str, mdir: Path, data: Path, precision: str, ds_config: str) -> dict:
    prefix = work / name
    job = {"model": str(mdir), "data": str(data), "ds_config": ds_config, "seq_len": SEQ, "micro_batch": MICRO,
           "steps": STEPS, "r": R, "alpha": 2 * R, "bf16": precision == "bf16"}
    torchrun([str(HERE / "peers" / "hf_trainer_lora.py"), json.dumps(job), str(prefix)], work / f"{name}.log")
    ends = json.loads(Path(f"{prefix}.rank0.json").read_text())["step_ends"]
    gaps = [b - a for a, b in zip(ends, ends[1:])][WARMUP - 1:]
    return {"step_time_s": statistics.median(gaps)}


def med(xs: list[float]) -> str:
    return f"{statistics.median(xs):.3f} [{min(xs):.3f}-{max(xs):.3f}]"


def main() -> int:
    import torch

    from zerotrain.assets.demo import ensure_tiny_model

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", required=True)
    ap.add_argument("--work", default="/tmp/zt_lora_bench")
    a = ap.parse_args()
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    precision = "bf16" if torch.ops.mkldnn._is_mkldnn_bf16_supported() else "fp32"
    mdir = ensure_tiny_model(PRESET)
    data = chat_corpus(work / "chat.jsonl")
    zerotrain_run(work, "warm", mdir, data, precision, packing=False)  # JIT ops, caches: never timed
    rows: list[dict] = []
    order = ["zerotrain", "hf_trainer", "packed"]
    for rnd in range(a.rounds):
        res: dict = {}
        for runner in order[rnd % 3:] + order[:rnd % 3]:
            t0 = time.time()
            if runner == "hf_trainer":
                ds = res.get("zerotrain", {}).get("ds_config") or str(work / "warm" / "ds_config.json")
                res[runner] = hf_run(work, f"r{rnd}_hf", mdir, data, precision, ds)
            else:
                res[runner] = zerotrain_run(work, f"r{rnd}_{runner}", mdir, data, precision, runner == "packed")
            print(f"round {rnd} {runner}: {res[runner]} ({time.time() - t0:.0f} s)", flush=True)
        rows.append(res)
    zt = [r["zerotrain"]["step_time_s"] for r in rows]
    hf = [r["hf_trainer"]["step_time_s"] for r in rows]
    pad_tok = [r["zerotrain"]["tokens_per_s"] for r in rows]
    pack_tok = [r["packed"]["tokens_per_s"] for r in rows]
    cpu = platform.processor() or platform.machine()
    md = [f"## LoRA on chat data (ZeRO-3, 2 CPU ranks, {precision}, {a.rounds} rounds, {time.strftime('%Y-%m-%d')})", "",
          f"Machine: {os.cpu_count()} cores ({cpu}), torch {torch.__version__}. Job and method: "
          "benchmarks/lora_chat.py (small-llama, LoRA r=16 all-linear, chatml chat corpus, micro-batch 4, "
          f"seq-len {SEQ}, median step time after {WARMUP} warm-up steps of {STEPS}).", "",
          "| runner | step time s, median [min-max] over rounds | real tokens/s |", "|---|---|---|",
          f"| zerotrain (padded rows) | {med(zt)} | {med(pad_tok)} |",
          f"| HF Trainer + peft, same DeepSpeed config | {med(hf)} | - |",
          f"| zerotrain --packing | {med([r['packed']['step_time_s'] for r in rows])} | {med(pack_tok)} |", "",
          f"Speed ratio HF step time / zerotrain step time, per round: {med([h / z for h, z in zip(hf, zt)])} "
          "(>= 1.0: zerotrain is faster).",
          f"Packing: real tokens/s packed / padded, per round: {med([p / q for p, q in zip(pack_tok, pad_tok)])}.", ""]
    Path(a.out).write_text("\n".join(md) + "\n")
    Path(f"{a.out}.json").write_text(json.dumps(rows, indent=1))
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
