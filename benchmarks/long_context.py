"""Long context: the longest sequence that trains within a fixed memory limit per rank (issue #32).

    .venv/bin/python benchmarks/long_context.py --limit-gib 3 [--start 1024] [--max-seq 65536]
        [--only zt-sp2,zt-sp1,hf-z3,hf-alst] [--out benchmarks/results/long_context.json]

For every configuration the sequence length doubles from --start until a trial exceeds the limit, fails,
times out, or passes --max-seq; the answer is the longest length that trained within the limit. Each trial is
ONE `torchrun --nproc_per_node 2` launch (2 CPU ranks, gloo, a free master port) in its own session, under a
wall-clock timeout (--trial-timeout) and a memory watch: the whole process group is killed when the timeout
runs out or when any rank's resident set goes over the limit (so a too-long trial costs seconds, not the
machine). Configurations (all fp32, DeepSpeed ZeRO-3, AdamW, micro-batch 1, grad-accum 1, 2 optimizer steps,
OMP_NUM_THREADS=1 per rank):

  zt-sp2   `python -m zerotrain train --sp 2` + the memory reducers in REDUCERS (passed only when
           `python -m zerotrain train --help` lists them): the 2 ranks train ONE sample of seq_len tokens
           per step, each rank holding seq_len/2 of it (Ulysses attention). Global batch: 1 x seq_len tokens.
  zt-sp1   `python -m zerotrain train` (sp 1, plain data parallel): EVERY rank trains its own sample of
           seq_len tokens per step. Global batch: 2 x seq_len tokens. Same seq_len per sample, so per rank
           it holds 2x the tokens of zt-sp2 (that is the point: what sp buys at a fixed per-rank memory).
  hf-z3    HF Trainer + DeepSpeed ZeRO-3 (the HF docs' ZeRO-3 block), no sp: as zt-sp1, 2 x seq_len tokens.
  hf-alst  HF Trainer + DeepSpeed ZeRO-3 + ALST/Ulysses sp=2 through accelerate's ParallelismConfig
           (sp_backend="deepspeed", sp_size=2): as zt-sp2, 1 x seq_len tokens.
  Not in the default set: zt-sp2-plain (sp=2 without the reducers: what the reducers add; the like of
  hf-alst, whose HF integration swaps attention only, no tiled MLP or tiled loss) and zt-sp2-gc (zt-sp2
  plus --gradient-checkpointing).

Model: a Llama built here from a config (hidden 256, 4 layers, 8 heads, 4 kv heads, intermediate 688, vocab
32000, max positions >= --max-seq, untied head; random init, seed 0) with zerotrain's embedded BPE tokenizer
(4096 tokens; the model's 32000-row vocab only sizes the embedding and the logits), saved with
save_pretrained under --workdir. Data: zerotrain's embedded corpus repeated until it fills the trial's blocks
(packed to seq_len with EOS between lines).

The limit used for benchmarks/results/long_context.{json,md}: 4.5 GiB, chosen from probe trials so that the best
configuration's answer stays <= 32k and no configuration sits within ~0.35 GiB of the limit at a doubling
point (probe peaks, largest rank: zt-sp2 2.18 / 2.76 GiB at 8k / 16k, so ~3.9 at 32k and ~6 at 64k; hf-alst
2.98 / 5.17; zt-sp1 4.88 / 8.65; hf-z3 4.95 / 8.55). Every rank carries ~1.3 GiB of process overhead (torch,
DeepSpeed, transformers, the model and its ZeRO-3 state) before any activation.

Memory: peak RSS (VmHWM from /proc/self/status) of each rank process, the largest rank. zerotrain: VmHWM at the
end of the last optimizer step (metrics.jsonl `peak_mem_bytes`, already the max over ranks), plus the
whole-run peak per rank (peak_rank{R}.json via $ZEROTRAIN_MODEL_STATE_DIR, which also covers the end-of-run
checkpoint save); HF peers: VmHWM read right after trainer.train() on each rank. A trial counts as
"exceeded" when that peak is over the limit (or the watch killed it). Step time: the second optimizer step
(the first pays one-time costs); tokens/s = global tokens per step / that time.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

from launching import (  # noqa: E402 - benchmarks/ is the script's folder
    descendants, first_error, free_port, kill_tree, llama_dir, offline_workdir, rss_bytes, step_records, trial_env)

REPO = Path(__file__).resolve().parents[1]
PY = sys.executable
GIB = 1024**3

REDUCERS = ["--tiled-mlp", "--chunked-loss"]
"""zerotrain memory reducers for zt-sp2, passed only when `zerotrain train --help` lists each of them."""

CONFIGS = {
    "zt-sp2": {"kind": "zerotrain", "sp": 2, "reducers": True, "label": "zerotrain sp=2 + reducers"},
    "zt-sp1": {"kind": "zerotrain", "sp": 1, "reducers": False, "label": "zerotrain sp=1 (data parallel)"},
    "hf-z3": {"kind": "hf", "sp": 1, "label": "HF Trainer + DeepSpeed ZeRO-3"},
    "hf-alst": {"kind": "hf", "sp": 2, "label": "HF Trainer + ZeRO-3 + ALST/Ulysses sp=2"},
    "zt-sp2-plain": {"kind": "zerotrain", "sp": 2, "reducers": False,
                     "label": "zerotrain sp=2, no reducers"},
    "zt-sp2-gc": {"kind": "zerotrain", "sp": 2, "reducers": True, "gc": True,
                  "label": "zerotrain sp=2 + reducers + grad. checkpointing"},
}
DEFAULT_ONLY = "zt-sp2,zt-sp1,hf-z3,hf-alst"
WORLD = 2
STEPS = 2
MODEL = dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
             intermediate_size=688, vocab_size=32000, tie_word_embeddings=False)


def env() -> dict:
    return trial_env(REPO)


# ---------------------------------------------------------------- model and data

def build_model(workdir: Path, max_pos: int) -> Path:
    """The Llama + tokenizer directory (built once per max_pos, then reused)."""
    return llama_dir(workdir / f"llama-h256-l4-v32000-p{max_pos}", **MODEL, max_position_embeddings=max_pos)


def corpus_tokens(model_dir: Path) -> int:
    """Tokens (EOS after each line) in one copy of zerotrain's embedded corpus."""
    from transformers import AutoTokenizer

    from zerotrain.assets.demo import CORPUS

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    lines = [ln for ln in Path(CORPUS).read_text().splitlines() if ln.strip()]
    return sum(len(x) + 1 for x in tok(lines)["input_ids"])


LINES_PER_DOC = 100
"""Corpus lines joined into one line (one text) of the data file. Found by this benchmark: zerotrain's --pack
then packed each datasets.map batch of 1000 texts on its own and dropped each batch's remainder, so with the
corpus's short lines (~48 tokens) --seq-len 65536 found no block at all. Fixed since (pack_blocks in
zerotrain/data/datasets.py carries the remainder across the whole dataset); the results were measured with
these long lines, kept so the data stays the same for every configuration and for reruns."""


def data_file(workdir: Path, tokens_needed: int, per_copy: int) -> Path:
    """A .txt of the embedded corpus repeated enough times for tokens_needed (+10%) tokens, LINES_PER_DOC
    corpus lines per line."""
    from zerotrain.assets.demo import CORPUS

    copies = max(1, math.ceil(tokens_needed * 1.1 / per_copy))
    out = workdir / f"corpus_x{copies}_d{LINES_PER_DOC}.txt"
    if not out.is_file():
        lines = [ln.strip() for ln in Path(CORPUS).read_text().splitlines() if ln.strip()] * copies
        docs = [" ".join(lines[i:i + LINES_PER_DOC]) for i in range(0, len(lines), LINES_PER_DOC)]
        out.write_text("\n".join(docs) + "\n")
    return out


def zerotrain_reducers() -> list[str]:
    """The REDUCERS that this checkout's `zerotrain train --help` lists (checked at run time)."""
    res = subprocess.run([PY, "-m", "zerotrain", "train", "--help"], capture_output=True, text=True, env=env(),
                         cwd=REPO, timeout=120)
    return [f for f in REDUCERS if re.search(rf"(?<![\w-]){re.escape(f)}(?![\w-])", res.stdout)]


# ---------------------------------------------------------------- one trial

def _tree_rss(root: int) -> dict[int, int]:
    """{pid: VmRSS bytes} of every descendant of root (torchrun's ranks, in sessions of their own)."""
    return {pid: rss for pid in descendants(root) if (rss := rss_bytes(pid)) is not None}


def launch(cmd: list[str], log: Path, timeout: float, limit: int) -> dict:
    """Run cmd in its own session; kill the group on timeout or when a process's RSS passes `limit`."""
    t0 = time.monotonic()
    watched_max, killed = 0, None
    with open(log, "w") as sink:
        proc = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT, env=env(), cwd=REPO,
                                start_new_session=True)
        while proc.poll() is None:
            ranks = _tree_rss(proc.pid)  # the ranks (and any helper they start)
            if ranks:
                watched_max = max(watched_max, max(ranks.values()))
            if ranks and max(ranks.values()) > limit:
                killed = "exceeded"
            elif time.monotonic() - t0 > timeout:
                killed = "timeout"
            if killed:
                kill_tree(proc)
                break
            time.sleep(0.25)
    return {"rc": proc.returncode, "killed": killed, "wall_s": round(time.monotonic() - t0, 1),
            "watched_max_rss_bytes": watched_max}


def error_line(log: Path) -> str:
    """The first exception line in the log (the root cause; torchrun's ChildFailedError summary skipped)."""
    lines = log.read_text(errors="replace").splitlines()
    if first_error(lines):
        return first_error(lines)
    for ln in lines:
        if "Signal" in ln or "exitcode" in ln or "Killed" in ln:
            return ln.strip()[:500]
    return (lines[-1].strip() if lines else "(no output)")[:500]


def torchrun() -> list[str]:
    return [PY, "-m", "torch.distributed.run", f"--nproc_per_node={WORLD}", "--nnodes=1",
            "--master_addr=127.0.0.1", f"--master_port={free_port()}"]


def zerotrain_trial(cfg: dict, seq: int, model_dir: Path, data: Path, tdir: Path, reducers: list[str],
                    timeout: float, limit: int) -> dict:
    state = tdir / "state"
    cmd = [*torchrun(), "-m", "zerotrain", "train", "--model", str(model_dir), "--data", str(data),
           "--seq-len", str(seq), "--micro-batch", "1", "--grad-accum", "1", "--max-steps", str(STEPS),
           "--stage", "3", "--precision", "fp32", "--sp", str(cfg["sp"]), "--lr", "1e-4", "--schedule", "constant",
           "--output", str(tdir / "run"), "--overwrite", "--no-save-final", "--log-every", "1",
           *(reducers if cfg.get("reducers") else []), *(["--gradient-checkpointing"] if cfg.get("gc") else [])]
    os.environ["ZEROTRAIN_MODEL_STATE_DIR"] = str(state)  # record_run_peak -> state/peak_rank{R}.json
    try:
        r = launch(cmd, tdir / "log.txt", timeout, limit)
    finally:
        os.environ.pop("ZEROTRAIN_MODEL_STATE_DIR", None)
    r["cmd"] = " ".join(cmd[cmd.index("-m", 1):])
    recs = step_records(tdir / "run" / "metrics.jsonl")
    r["step_s"] = [rec["step_time_s"] for rec in recs]
    r["tokens_per_step"] = int(recs[-1]["tokens"]) if recs else None
    r["loss"] = [rec.get("loss") for rec in recs]
    r["peak_rss_bytes"] = int(recs[-1]["peak_mem_bytes"]) if recs else None  # VmHWM after the last step, max rank
    r["run_peak_rss_bytes_per_rank"] = [json.loads(p.read_text())["peak_rss_bytes"]
                                        for p in sorted(state.glob("peak_rank*.json"))]
    shutil.rmtree(tdir / "run" / "checkpoints", ignore_errors=True)  # the end-of-run checkpoint: ~300 MB each
    return r


def hf_trial(cfg: dict, seq: int, model_dir: Path, data: Path, tdir: Path, timeout: float, limit: int) -> dict:
    job = {"model_dir": str(model_dir), "data": str(data), "seq_len": seq, "sp": cfg["sp"], "steps": STEPS,
           "out": str(tdir / "res")}
    cmd = [*torchrun(), str(REPO / "benchmarks" / "peers" / "hf_long_context.py"), json.dumps(job)]
    r = launch(cmd, tdir / "log.txt", timeout, limit)
    r["cmd"] = "benchmarks/peers/hf_long_context.py " + json.dumps(job)
    peaks = [json.loads(p.read_text()) for p in sorted((tdir / "res").glob("peak_rank*.json"))]
    r["peak_rss_bytes_per_rank"] = [p["peak_rss_bytes"] for p in peaks]
    r["peak_rss_bytes"] = max(r["peak_rss_bytes_per_rank"]) if len(peaks) == WORLD else None
    r["step_s"] = peaks[0]["in_step_s"] if peaks else []
    r["input_shapes_per_rank"] = [p.get("input_shapes") for p in peaks]  # what each rank's model saw
    r["train_loss"] = peaks[0].get("train_loss") if peaks else None
    r["tokens_per_step"] = seq * (WORLD // cfg["sp"]) if peaks else None
    shutil.rmtree(tdir / "res" / "trainer", ignore_errors=True)
    return r


def run_trial(name: str, seq: int, model_dir: Path, per_copy: int, workdir: Path, reducers: list[str],
              timeout: float, limit: int) -> dict:
    cfg = CONFIGS[name]
    samples_per_step = WORLD // cfg["sp"]
    data = data_file(workdir, STEPS * samples_per_step * seq, per_copy)
    tdir = workdir / "trials" / f"{name}-{seq}"
    shutil.rmtree(tdir, ignore_errors=True)
    tdir.mkdir(parents=True)
    if cfg["kind"] == "zerotrain":
        r = zerotrain_trial(cfg, seq, model_dir, data, tdir, reducers, timeout, limit)
    else:
        r = hf_trial(cfg, seq, model_dir, data, tdir, timeout, limit)
    peak = r.get("peak_rss_bytes")
    if r["killed"] == "exceeded" or (peak is not None and peak > limit):
        r["status"] = "exceeded"
    elif r["killed"] == "timeout":
        r["status"] = "timeout"
    elif r["rc"] != 0 or peak is None or len(r["step_s"]) < STEPS:
        r["status"] = "error"
    else:
        r["status"] = "ok"
    if r["status"] in ("error", "timeout") or (r["status"] == "exceeded" and r["rc"] not in (0, None, -9)):
        r["error"] = error_line(tdir / "log.txt")
    if r["status"] == "ok" or (r["step_s"] and len(r["step_s"]) >= STEPS):
        r["step2_s"] = r["step_s"][-1]
        r["tokens_per_s"] = round(r["tokens_per_step"] / r["step2_s"], 1) if r["tokens_per_step"] else None
    r.update(framework=name, label=cfg["label"], seq_len=seq, samples_per_step=samples_per_step,
             tokens_per_rank=seq * samples_per_step // WORLD, log=str(tdir / "log.txt"))
    return r


# ---------------------------------------------------------------- report

def gib(b) -> str:
    return f"{b / GIB:.2f}" if b else "-"


def _secs(x) -> str:
    return f"{x:.2f}" if isinstance(x, (int, float)) else "-"


def markdown(res: dict) -> str:
    order = {n: i for i, n in enumerate(res["configs"])}
    trials = sorted(res["trials"], key=lambda t: (order.get(t["framework"], 99), t["seq_len"]))
    lines = [f"# Long context: longest sequence within {res['limit_gib']} GiB peak RSS per rank",
             "",
             f"2 CPU ranks (gloo), {res['model']}, fp32, ZeRO-3, AdamW, micro-batch 1, grad-accum 1; sequence "
             f"doubled from {res['start']} to at most {res['max_seq']}; trial timeout {res['trial_timeout_s']} s. "
             f"Peak = VmHWM after the last of {STEPS} optimizer steps, largest rank. zerotrain reducers passed: "
             f"{' '.join(res['reducers']) or 'none'}. Run: {res['date']}, {res['wall_s'] / 60:.1f} min"
             + "".join(f"; earlier part: {e['date']}, {(e['wall_s'] or 0) / 60:.1f} min" for e in res.get("earlier_runs", []))
             + ".",
             "",
             "| config | batch per step | longest seq within limit | peak RSS there (GiB) | first failing seq: why |",
             "| --- | --- | --- | --- | --- |"]
    for name in res["configs"]:
        rows = [t for t in trials if t["framework"] == name]
        ok = [t for t in rows if t["status"] == "ok"]
        bad = [t for t in rows if t["status"] != "ok"]
        best = max(ok, key=lambda t: t["seq_len"]) if ok else None
        why = "-"
        if bad:
            b = bad[0]
            why = f"{b['seq_len']}: {b['status']}"
            if b["status"] == "exceeded":
                why += f" ({gib(b.get('peak_rss_bytes') or b.get('watched_max_rss_bytes'))} GiB" + \
                       (", killed by the watch)" if b["killed"] == "exceeded" else ")")
            if b.get("error"):
                why += f" `{b['error'][:160].replace('|', '/')}`"
        elif best is not None and best["seq_len"] * 2 > res["max_seq"]:
            why = f"none up to --max-seq {res['max_seq']}"
        batch = ("1 sample x seq, split over 2 ranks" if CONFIGS[name]["sp"] == 2
                 else "1 sample x seq per rank (2 x seq)")
        lines.append(f"| {CONFIGS[name]['label']} | {batch} | {best['seq_len'] if best else 'none'} | "
                     f"{gib(best['peak_rss_bytes']) if best else '-'} | {why} |")
    lines += ["", "## Every trial", "",
              "| config | seq | status | peak RSS max rank (GiB) | step-2 s | tokens/s (global) |",
              "| --- | --- | --- | --- | --- | --- |"]
    for t in trials:
        lines.append(f"| {t['framework']} | {t['seq_len']} | {t['status']} | "
                     f"{gib(t.get('peak_rss_bytes') or (t.get('watched_max_rss_bytes') if t['status'] == 'exceeded' else None))} | "
                     f"{_secs(t.get('step2_s'))} | "
                     f"{t.get('tokens_per_s') or '-'} |")
    sp1 = {t["seq_len"]: t for t in trials if t["framework"] == "zt-sp1" and t.get("tokens_per_s")}
    sp2 = {t["seq_len"]: t for t in trials if t["framework"] == "zt-sp2" and t.get("tokens_per_s")}
    both = sorted(set(sp1) & set(sp2))
    if both:
        lines += ["", "## zerotrain throughput, sp=1 vs sp=2 at the same sequence length", "",
                  "Global tokens per optimizer step / time of step 2 (sp=1 trains 2 samples per step, sp=2 one). "
                  "Peak RSS: largest rank.", "",
                  "| seq | sp=1 tokens/s | sp=2 tokens/s | sp=2 / sp=1 | sp=1 peak GiB | sp=2 peak GiB |",
                  "| --- | --- | --- | --- | --- | --- |"]
        for s in both:
            a, b = sp1[s], sp2[s]
            lines.append(f"| {s} | {a['tokens_per_s']:.0f} | {b['tokens_per_s']:.0f} | "
                         f"{b['tokens_per_s'] / a['tokens_per_s']:.2f} | {gib(a['peak_rss_bytes'])} | "
                         f"{gib(b['peak_rss_bytes'])} |")
    lines += ["", "Notes: step times are single measurements on a shared 2-core machine (other jobs ran beside parts of "
              "this run): differences under ~20-30% are noise, and attention time grows ~quadratically, so compare "
              "tokens/s only at equal seq. HF's ALST integration (accelerate ParallelismConfig, sp_backend "
              "\"deepspeed\") swaps attention for Ulysses only (no tiled MLP, no tiled logits/loss), so its like "
              "in zerotrain is zt-sp2-plain. Peak RSS includes ~1.3 GiB per rank of process overhead (imports, "
              "model, ZeRO-3 state)."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--limit-gib", type=float, required=True, help="peak RSS limit per rank, GiB")
    p.add_argument("--start", type=int, default=1024, help="first sequence length")
    p.add_argument("--max-seq", type=int, default=65536, help="longest sequence length tried")
    p.add_argument("--only", default=DEFAULT_ONLY, help=f"comma list of {', '.join(CONFIGS)}")
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "long_context.json"),
                   help="raw JSON; the markdown table goes next to it (.md)")
    p.add_argument("--trial-timeout", type=float, default=600.0, help="seconds per trial (one torchrun launch)")
    p.add_argument("--workdir", default="/tmp/zt_long_context", help="model, data and trial logs")
    p.add_argument("--seqs", default=None, help="comma list of sequence lengths to try instead of doubling "
                                                "(every one is run, failures do not stop it; for probing)")
    p.add_argument("--keep", action="store_true", help="keep the trials already in --out except those of the "
                   "--only configs at seq >= --start (to continue or redo part of a run)")
    a = p.parse_args(argv)
    names = [n.strip() for n in a.only.split(",") if n.strip()]
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        p.error(f"unknown config(s) {unknown}; choose from {list(CONFIGS)}")
    limit = int(a.limit_gib * GIB)
    workdir = offline_workdir(a.workdir, REPO)
    t0 = time.time()
    model_dir = build_model(workdir, max(65536, a.max_seq))
    per_copy = corpus_tokens(model_dir)
    reducers = zerotrain_reducers() if any(CONFIGS[n].get("reducers") for n in names) else []
    print(f"model {model_dir}; corpus {per_copy} tokens per copy; zerotrain reducers available: {reducers}",
          flush=True)
    res = {"limit_gib": a.limit_gib, "limit_bytes": limit, "start": a.start, "max_seq": a.max_seq,
           "trial_timeout_s": a.trial_timeout, "configs": names, "reducers": reducers,
           "reducers_wanted": REDUCERS, "world": WORLD, "steps": STEPS,
           "model": "Llama h256 x 4 layers, 8 heads / 4 kv, ffn 688, vocab 32000",
           "model_config": MODEL, "date": time.strftime("%Y-%m-%d %H:%M"), "trials": []}
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if a.keep and out.is_file():  # keep the earlier trials this invocation does not redo
        old = json.loads(out.read_text())
        res["trials"] = [t for t in old["trials"] if t["framework"] not in names or t["seq_len"] < a.start]
        res["configs"] = [*[n for n in old["configs"] if n not in names], *names]
        res["configs"] = [n for n in CONFIGS if n in res["configs"]]
        res["earlier_runs"] = [*old.get("earlier_runs", []), {"date": old["date"], "wall_s": old.get("wall_s")}]
        res["start"] = min(a.start, old.get("start", a.start))

    def save() -> None:
        res["wall_s"] = round(time.time() - t0, 1)
        out.write_text(json.dumps(res, indent=1))
        out.with_suffix(".md").write_text(markdown(res))

    for name in names:
        seqs = [int(s) for s in a.seqs.split(",")] if a.seqs else None
        seq = seqs.pop(0) if seqs else a.start
        while seq <= a.max_seq:
            t = run_trial(name, seq, model_dir, per_copy, workdir, reducers, a.trial_timeout, limit)
            res["trials"].append(t)
            save()
            print(f"{name:9s} seq {seq:6d}: {t['status']:8s} peak {gib(t.get('peak_rss_bytes'))} GiB "
                  f"(watched {gib(t['watched_max_rss_bytes'])}) step2 {t.get('step2_s')} s "
                  f"wall {t['wall_s']} s {t.get('error', '')}", flush=True)
            if seqs is not None:
                if not seqs:
                    break
                seq = seqs.pop(0)
                continue
            if t["status"] != "ok":
                break
            seq *= 2
    save()
    print(out.with_suffix(".md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
