"""Start-up to the first step and peak RSS per rank, for two corpus sizes 10x apart: `zerotrain train --streaming`
(issue 54) beside the map-style `--data` path on the smaller corpus.

    .venv/bin/python benchmarks/data_scale.py --sizes-mb 50,500 --out benchmarks/results/data_scale

Each corpus is a JSONL of synthetic documents (random words of the embedded demo's vocabulary, 40-400 words each,
seeded), written once to --work. Each run is `zerotrain train` under torchrun on 2 CPU ranks (the embedded
small-gpt2, seq 128, micro-batch 4, 2 steps, DeepSpeed ZeRO-2), with a hook in every rank
(benchmarks/data_scale.py --rank-job) that records the wall-clock time (time.time()) when the first optimizer step
ends and the rank's peak RSS (VmHWM) then. Start-up is that time minus the moment the driver launched torchrun.
Writes OUT.json (every run) and OUT.md (the table). Run it with nothing else on the machine.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent


def write_corpus(path: Path, mb: int, seed: int = 0) -> int:
    """A JSONL of about `mb` MiB of synthetic documents; returns the number of rows."""
    if path.exists() and path.stat().st_size >= mb * 2**20:
        return sum(1 for _ in path.open())
    words = (REPO / "zerotrain" / "assets" / "corpus.txt").read_text().split()
    rng = random.Random(seed)
    rows, size = 0, 0
    with path.open("w") as f:
        while size < mb * 2**20:
            line = json.dumps({"text": " ".join(rng.choices(words, k=rng.randint(40, 400)))}) + "\n"
            f.write(line)
            size += len(line)
            rows += 1
    return rows


def rank_job(out: str, argv: list[str]) -> None:
    """One rank: `zerotrain train` with the time and peak RSS at the end of the first optimizer step recorded."""
    from zerotrain import cli
    from zerotrain.train import trainer
    from zerotrain.util import peak_rss_bytes

    inner = trainer.Trainer._train_step
    seen: dict = {}

    def step(self, *args, **kwargs):  # noqa: ANN001
        result = inner(self, *args, **kwargs)
        if not seen:
            seen.update(first_step_end=time.time(), peak_rss_at_first_step=peak_rss_bytes(), rank=self.engine.rank)
            stream = getattr(self, "stream", None)
            seen["rows_tokenized_by_first_step"] = stream.source.tokenized if stream is not None else None
        return result

    trainer.Trainer._train_step = step
    code = cli.main(argv)
    seen["peak_rss_end"] = peak_rss_bytes()
    Path(f"{out}.rank{seen.get('rank', os.environ.get('RANK', 0))}.json").write_text(json.dumps(seen))
    sys.exit(code)


def launch(out: Path, corpus: Path, streaming: bool, timeout: float) -> dict:
    from zerotrain.launch.subprocess_run import run_with_timeout
    from zerotrain.util import free_port

    run_dir = Path(f"{out}.run")
    args = ["train", "--data", str(corpus), "--seq-len", "128", "--micro-batch", "4", "--grad-accum", "1",
            "--max-steps", "2", "--stage", "2", "--backend", "deepspeed", "--output", str(run_dir), "--overwrite",
            "--no-save-final"]
    if streaming:
        args += ["--streaming", "--shuffle-buffer", "1000"]
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", TRANSFORMERS_VERBOSITY="error", PYTHONWARNINGS="ignore",
               HF_DATASETS_CACHE=str(Path(f"{out}.cache")),  # a cold datasets cache: map-style tokenizes every run
               PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--nnodes=1",
           "--master_addr=127.0.0.1", f"--master_port={free_port()}", str(Path(__file__).resolve()), "--rank-job",
           str(out), *args]
    t0 = time.time()
    res = run_with_timeout(cmd, timeout, env=env, cwd=REPO, merge_stderr=True)
    wall = time.time() - t0
    ranks = [json.loads(p.read_text()) for p in sorted(out.parent.glob(out.name + ".rank*.json"))]
    if res.returncode != 0 or len(ranks) != 2:
        raise SystemExit(f"data_scale.py: run failed (exit {res.returncode}):\n{res.stdout[-3000:]}")
    return {"startup_s": max(r["first_step_end"] for r in ranks) - t0, "wall_s": wall,
            "peak_rss_mib_per_rank": [round(r["peak_rss_at_first_step"] / 2**20, 1) for r in ranks],
            "rows_tokenized_by_first_step": [r["rows_tokenized_by_first_step"] for r in ranks]}


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--rank-job":
        rank_job(sys.argv[2], sys.argv[3:])
        return 0
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes-mb", default="50,500")
    ap.add_argument("--map-style-mb", type=int, default=50, help="also time the map-style path on this corpus size "
                    "(0: not)")
    ap.add_argument("--work", default=str(Path(tempfile.gettempdir()) / "zt-data-scale"))
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--out", required=True, help="OUT.json and OUT.md are written")
    args = ap.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    sizes = [int(x) for x in args.sizes_mb.split(",")]
    corpora = {mb: work / f"corpus_{mb}mb.jsonl" for mb in sizes}
    rows = {mb: write_corpus(p, mb) for mb, p in corpora.items()}
    runs = []
    for mb in sizes:
        runs.append({"path": "streaming", "corpus_mb": round(corpora[mb].stat().st_size / 2**20, 1), "rows": rows[mb],
                     **launch(work / f"stream_{mb}", corpora[mb], True, args.timeout)})
        print(json.dumps(runs[-1]), flush=True)
    if args.map_style_mb:
        mb = args.map_style_mb
        path = corpora.get(mb) or work / f"corpus_{mb}mb.jsonl"
        n = rows.get(mb) or write_corpus(path, mb)
        runs.append({"path": "map-style", "corpus_mb": round(path.stat().st_size / 2**20, 1), "rows": n,
                     **launch(work / f"map_{mb}", path, False, args.timeout)})
        print(json.dumps(runs[-1]), flush=True)
    stream = [r for r in runs if r["path"] == "streaming"]
    lo, hi = stream[0], stream[-1]
    lines = ["| path | corpus | rows | start-up to the first step | peak RSS per rank at step 1 | rows tokenized by step 1 "
             "(per rank) |", "| --- | --- | --- | --- | --- | --- |"]
    for r in runs:
        lines.append(f"| {r['path']} | {r['corpus_mb']:,.1f} MiB | {r['rows']:,} | {r['startup_s']:.1f} s | "
                     + " / ".join(f"{x:,.1f} MiB" for x in r["peak_rss_mib_per_rank"]) + " | "
                     + " / ".join("-" if x is None else f"{x:,}" for x in r["rows_tokenized_by_first_step"]) + " |")
    ratio_t = hi["startup_s"] / lo["startup_s"]
    ratio_m = max(hi["peak_rss_mib_per_rank"]) / max(lo["peak_rss_mib_per_rank"])
    lines += ["", f"Streaming, the larger corpus against the smaller: start-up {ratio_t:.2f}x, peak RSS {ratio_m:.2f}x "
              "(largest rank)."]
    Path(f"{args.out}.json").write_text(json.dumps({"runs": runs, "startup_ratio": ratio_t, "rss_ratio": ratio_m},
                                                   indent=1))
    Path(f"{args.out}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
