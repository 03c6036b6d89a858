"""DPO on 2 CPU ranks: zerotrain `--task dpo` (DeepSpeed ZeRO-3) against TRL's DPOTrainer + DeepSpeed ZeRO-3.

    .venv/bin/python benchmarks/dpo.py [--rounds 3] [--steps 12] [--warmup 4] [--seq-len 256] [--micro-batch 4]
        [--grad-accum 1] [--pairs 256] [--layers 4] [--hidden 256] [--vocab 4096] [--peers trl,trl-ztzero]
        [--out benchmarks/results/dpo.json] [--workdir /tmp/zt_dpo] [--trial-timeout 600] [--report]

benchmarks/results/dpo.{json,md} come from the defaults (3 rounds x 3 configurations x 12 steps, ~6 min); a smoke
check: `--rounds 1 --steps 3 --warmup 1 --out /tmp/zt_dpo/smoke.json` (~1.5 min).

Every trial is ONE `torchrun --nproc_per_node 2` launch (2 CPU ranks, gloo, a free master port, OMP_NUM_THREADS=1 per
rank) in its own session under a wall-clock timeout (the whole process tree is killed when it runs out). Each round
runs zt, then each --peers configuration (zt, trl, trl-ztzero, zt, trl, ...). A failed trial keeps its error line
in the JSON and the run goes on. The cores are shared: before each trial the run waits until other processes are
quiet, counts the CPU seconds they use during the trial (/proc), and a round in which they used more than --max-others
cores during any trial (or a trial failed) is kept in the JSON but left out of the figures; rounds are run until
--rounds undisturbed ones are in (at most --max-rounds).

  zt    `python -m zerotrain train --task dpo --backend deepspeed --stage 3 --precision fp32` with --micro-batch,
        --grad-accum, --max-steps, --seq-len, --lr 1e-3 --schedule constant --beta 0.1 --clip 1 --weight-decay 0
        --seed 0 --save-every 0 --no-save-final (the end-of-run checkpoint comes after the last timed step and is
        deleted). Reference: zerotrain's default, a frozen copy partitioned like the policy (ZeRO-3).
  trl   benchmarks/peers/trl_dpo.py: trl.DPOTrainer with DPOConfig pinned to the same run (fp32, no gradient
        checkpointing, AdamW lr 1e-3 constant, beta 0.1, clip 1, max_length = seq len, same batch, live reference
        built by TRL under ZeRO-3 with prepare_deepspeed) and the HF docs' DeepSpeed ZeRO-3 block with "auto" values.
        Its sampler gives every rank zerotrain's micro-batches in zerotrain's order (peers/trl_dpo.py
        ZerotrainOrder), so both train on the same pairs step by step.
  trl-ztzero     the same, with the zero_optimization block of the same round's zerotrain trial (its
        ds_config.json: leaf modules, buckets, persistence threshold) instead of the HF docs' block: what is left of
        the gap is the trainers', not the ZeRO-3 settings'.
  trl-dsdefault  (not in the default --peers) the HF docs' block without its three "auto" bucket keys.

Model: the `small-llama` preset of zerotrain.assets.demo.TINY_PRESETS (4 layers, hidden 256, 4 heads / 2 kv, ffn 688,
untied head; --layers/--hidden/--vocab change it; the ffn scales with hidden) with the preset's vocab 4096, not
build_tiny's (build_tiny sizes the vocab to the 742-token corpus tokenizer: 768 rows), so the head and log-softmax
weigh what they do in a real vocabulary; random init (seed 0), written with zerotrain's embedded BPE tokenizer through
launching.save_model_dir (atomic). Data: --pairs deterministic {"prompt", "chosen", "rejected"} rows cut from
zerotrain's embedded corpus (random.Random(0)): the prompt is the start of a corpus line (5-40 words), chosen its
continuation (10-190 words, running into the next lines), rejected 10-190 words from another place in the corpus,
so pairs vary in length and some exceed --seq-len 256 (both tools cut them keeping the start).

Figures per trial, from metrics.jsonl (zerotrain's own; the peer writes the same fields): step_time_s is each step's
wall time, the max over ranks (each rank times its own step with perf_counter, no barrier added: zerotrain from
drawing the step's micro-batches to the end of its optimizer step and the read of the loss, the peer from the
dataloader's next() to on_step_end). Speed: the median step time over steps warmup+1..steps and tokens/s = their
non-padding tokens (both chosen and rejected rows, summed over ranks) / their summed time. Per tool: median [min-max]
over rounds; the ratio peer / zerotrain of median step times is paired within each round, then median [min-max] over
rounds (> 1: zerotrain faster). Training parity: each tool's first-step loss and log-probs, and the largest
difference of the loss between the two tools over all steps of a round (same data, same order).
"""
from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from launching import (
    descendants, first_error, free_port, launch, llama_dir, offline_workdir, run_span, software, step_records,
    trial_env)

REPO = Path(__file__).resolve().parents[1]
PY = sys.executable
WORLD = 2
CONFIGS = {
    "zt": {"label": "zerotrain --task dpo, DeepSpeed ZeRO-3"},
    "trl": {"label": "TRL DPOTrainer + DeepSpeed ZeRO-3, HF docs' ZeRO-3 block (\"auto\")", "zero": "docs"},
    "trl-dsdefault": {"label": "TRL DPOTrainer + DeepSpeed ZeRO-3, DeepSpeed's default buckets", "zero": "defaults"},
    "trl-ztzero": {"label": "TRL DPOTrainer + DeepSpeed ZeRO-3 with zerotrain's zero_optimization block",
                   "zero": "zt"},
}
"""zt first; the peers (--peers): "trl" is the comparison asked for (what HF's DeepSpeed docs give a TRL user);
"trl-ztzero" runs TRL with the very ZeRO-3 block zerotrain chose in the same round (leaf modules, bucket sizes,
persistence threshold; read from that trial's ds_config.json), so what is left of the gap is the trainers'."""
LR, BETA, SEED = 1e-3, 0.1, 0
PAIR_FIELDS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen",
               "logps/rejected")


def env() -> dict:
    return trial_env(REPO, TRL_EXPERIMENTAL_SILENCE="1")


def source_state() -> dict:
    """The checkout zerotrain ran from: HEAD and the files under zerotrain/ that differ from it (read-only git calls;
    --no-optional-locks keeps `status` from refreshing the index)."""
    def git(*args: str) -> str:
        r = subprocess.run(["git", "--no-optional-locks", *args], capture_output=True, text=True, cwd=REPO,
                           check=False)
        return r.stdout.strip() if r.returncode == 0 else ""

    return {"head": git("rev-parse", "HEAD"),
            "zerotrain_changes": git("status", "--porcelain", "--", "zerotrain").splitlines()}


def machine() -> dict:
    import torch

    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
    name = next((ln.split(":", 1)[1].strip() for ln in lscpu.splitlines() if ln.startswith("Model name")), "?")
    vers = {p: importlib.metadata.version(p) for p in ("torch", "deepspeed", "transformers", "trl", "accelerate",
                                                         "datasets")}
    return {"cpu": name, "cores": os.cpu_count(), "mkldnn_bf16": bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()),
            "versions": vers}


# ---------------------------------------------------------------- model and data

def model_shape(layers: int, hidden: int, vocab: int) -> dict:
    from zerotrain.assets.demo import TINY_PRESETS

    shape = dict(TINY_PRESETS["small-llama"])
    base_hidden = shape["hidden_size"]
    shape.update(num_hidden_layers=layers, hidden_size=hidden, vocab_size=vocab,
                 intermediate_size=round(shape["intermediate_size"] * hidden / base_hidden / 8) * 8)
    return shape


def build_model(workdir: Path, shape: dict) -> Path:
    """The Llama + tokenizer directory (built once per shape, then reused)."""
    return llama_dir(workdir / f"llama-l{shape['num_hidden_layers']}-h{shape['hidden_size']}-v{shape['vocab_size']}",
                     **{k: v for k, v in shape.items() if k != "model_type"})


def build_pairs(workdir: Path, n: int) -> Path:
    """n deterministic preference pairs cut from the embedded corpus (see the module docstring)."""
    from zerotrain.assets.demo import CORPUS

    out = workdir / f"pairs-v2-{n}.jsonl"
    if out.is_file():
        return out
    lines = [ln.split() for ln in Path(CORPUS).read_text().splitlines() if ln.strip()]
    words = [w for ln in lines for w in ln]
    starts, at = [], 0
    for ln in lines:
        starts.append(at)
        at += len(ln)
    rng = random.Random(0)
    rows = []
    while len(rows) < n:
        s = rng.choice(starts)
        k, m = rng.randint(5, 40), rng.randint(10, 190)
        o = rng.randrange(0, len(words) - 200)
        prompt = " ".join(words[s:s + k])
        chosen = " " + " ".join(words[s + k:s + k + m])
        rejected = " " + " ".join(words[o:o + rng.randint(10, 190)])
        if chosen.strip() and rejected.strip() and chosen != rejected and len(words) > s + k + m:
            rows.append({"prompt": prompt, "chosen": chosen, "rejected": rejected})
    tmp = out.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tmp.rename(out)
    return out


def pair_lengths(model_dir: Path, data: Path, seq_len: int) -> dict:
    """Token lengths of the pairs (prompt + longer completion, EOS appended) and how many exceed seq_len."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    longest = []
    for line in data.read_text().splitlines():
        r = json.loads(line)
        longest.append(max(len(tok(r["prompt"] + r[s] + tok.eos_token)["input_ids"]) for s in ("chosen", "rejected")))
    return {"pairs": len(longest), "median_tokens": statistics.median(longest), "min_tokens": min(longest),
            "max_tokens": max(longest), "over_seq_len": sum(x > seq_len for x in longest)}


# ---------------------------------------------------------------- one trial

TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds() -> dict[int, float]:
    """{pid: CPU seconds used so far (utime + stime)} of every process, from /proc."""
    out = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                out[int(d)] = (int(fields[11]) + int(fields[12])) / TICK
            except (OSError, ValueError, IndexError):
                pass
    return out


class OthersCpu:
    """CPU seconds used by processes other than this one and a trial's tree (the other users of the shared cores):
    sampled now and then; a process first seen after the start counts whole (it started meanwhile)."""

    def __init__(self, root: int | None = None):
        self.root, self.total = root, 0.0
        self.seen = self._others()

    def _others(self) -> dict[int, float]:
        mine = {os.getpid(), *descendants(os.getpid())}
        return {pid: t for pid, t in cpu_seconds().items() if pid not in mine}

    def sample(self) -> float:
        now = self._others()
        self.total += sum(t - self.seen.get(pid, 0.0) for pid, t in now.items() if t >= self.seen.get(pid, 0.0))
        self.seen = now
        return self.total


def wait_for_quiet(max_wait: float, threshold: float = 0.2, quiet_samples: int = 3) -> dict:
    """Wait (up to max_wait s) until the other processes have used < threshold cores in each of `quiet_samples`
    3-second windows in a row (a test suite leaves short gaps between its processes); what was seen."""
    t0, quiet, busy = time.monotonic(), 0, 0.0
    while True:
        o = OthersCpu()
        time.sleep(3.0)
        busy = o.sample() / 3.0
        quiet = quiet + 1 if busy < threshold else 0
        waited = time.monotonic() - t0
        if quiet >= quiet_samples or waited >= max_wait:
            return {"others_cores_before": round(busy, 2), "waited_for_quiet_s": round(waited, 1)}
        if quiet == 0:
            print(f"  (other processes use {busy:.2f} cores; waiting for quiet, {waited:.0f} s so far)", flush=True)


def launch_counting_others(cmd: list[str], log: Path, timeout: float) -> dict:
    """launching.launch, also counting the CPU seconds that other processes used meanwhile."""
    others = OthersCpu()
    r = launch(cmd, log, timeout, env(), REPO, others.sample)
    other_s = others.sample()
    return {**r, "others_cpu_s": round(other_s, 1),
            "others_cores": round(other_s / r["wall_s"], 2) if r["wall_s"] > 0 else None}


def torchrun() -> list[str]:
    return [PY, "-m", "torch.distributed.run", f"--nproc_per_node={WORLD}", "--nnodes=1", "--master_addr=127.0.0.1",
            f"--master_port={free_port()}"]


def run_trial(name: str, rnd: int, a: argparse.Namespace, model_dir: Path, data: Path, workdir: Path,
              zt_zero: dict | None) -> dict:
    """One trial of configuration `name`; zt_zero: the zero_optimization block of this round's zerotrain trial."""
    tdir = workdir / "trials" / f"r{rnd}-{name}"
    shutil.rmtree(tdir, ignore_errors=True)
    tdir.mkdir(parents=True)
    r: dict = {"config": name, "round": rnd}
    if name == "zt":
        cmd = [*torchrun(), "-m", "zerotrain", "train", "--task", "dpo", "--model", str(model_dir), "--data", str(data),
               "--backend", "deepspeed", "--stage", "3", "--precision", "fp32", "--seq-len", str(a.seq_len),
               "--micro-batch", str(a.micro_batch), "--grad-accum", str(a.grad_accum), "--max-steps", str(a.steps),
               "--lr", str(LR), "--schedule", "constant", "--beta", str(BETA), "--clip", "1.0", "--weight-decay", "0",
               "--seed", str(SEED), "--save-every", "0", "--no-save-final", "--log-every", "1",
               "--output", str(tdir / "run"), "--overwrite"]
        shown = cmd[cmd.index("-m", 1) + 1:]
    else:
        zero = CONFIGS[name]["zero"]
        if zero == "zt":
            if zt_zero is None:
                return {**r, "status": "skipped", "error": "no zerotrain ds_config.json in this round to copy",
                        "step_s": [], "loss": [], "tokens": [], "first_step": {}, "wall_s": 0.0}
            zero = zt_zero
        job = {"model_dir": str(model_dir), "data": str(data), "seq_len": a.seq_len, "micro_batch": a.micro_batch,
               "grad_accum": a.grad_accum, "steps": a.steps, "lr": LR, "beta": BETA, "seed": SEED,
               "out": str(tdir / "run"), "zero": zero, "order": "zerotrain"}
        cmd = [*torchrun(), str(REPO / "benchmarks" / "peers" / "trl_dpo.py"), json.dumps(job)]
        shown = cmd[len(cmd) - 2:]
    r.update(launch_counting_others(cmd, tdir / "log.txt", a.trial_timeout))
    r["cmd"] = " ".join(str(c).replace(str(REPO) + "/", "") for c in shown)
    recs = step_records(tdir / "run" / "metrics.jsonl")
    r["step_s"] = [round(x["step_time_s"], 4) for x in recs]
    r["loss"] = [x.get("loss") for x in recs]
    r["tokens"] = [int(x["tokens"]) for x in recs]
    r["first_step"] = {k: recs[0].get(k) for k in ("loss", *PAIR_FIELDS)} if recs else {}
    if name == "zt":
        cfg = tdir / "run" / "ds_config.json"
        r["zero_optimization"] = json.loads(cfg.read_text()).get("zero_optimization") if cfg.is_file() else None
    else:
        r["in_step_s"] = [round(x["in_step_s"], 4) for x in recs]
        peer = tdir / "run" / "peer.json"
        if peer.is_file():
            meta = json.loads(peer.read_text())
            r["peer"] = {k: meta.get(k) for k in ("trainer_init_s", "train_s", "optimizer", "ref_engine", "pairs",
                                                  "tokenized_pairs")}
            r["zero_optimization"] = (meta.get("policy_ds_config") or {}).get("zero_optimization")
            ref = meta.get("ref_ds_config") or {}
            r["ref_zero_optimization"] = ref.get("zero_optimization")
            r["ref_dotted_keys"] = {k: v for k, v in ref.items() if k.startswith("zero_optimization.")}
    timed = recs[a.warmup:]
    ok = r["rc"] == 0 and len(recs) >= a.steps and bool(timed)
    if timed:
        r["median_step_s"] = round(statistics.median(x["step_time_s"] for x in timed), 4)
        r["tokens_per_s"] = round(sum(x["tokens"] for x in timed) / sum(x["step_time_s"] for x in timed), 1)
        if name != "zt":
            r["median_in_step_s"] = round(statistics.median(x["in_step_s"] for x in timed), 4)
    r["status"] = "ok" if ok else ("timeout" if r["killed"] else "error")
    if not ok:
        lines = (tdir / "log.txt").read_text(errors="replace").splitlines()
        r["error"] = first_error(lines) or "\n".join(ln[:300] for ln in lines[-10:])
    r["log"] = str(tdir / "log.txt")
    shutil.rmtree(tdir / "run" / "checkpoints", ignore_errors=True)  # zerotrain's end-of-run checkpoint
    shutil.rmtree(tdir / "run" / "trainer", ignore_errors=True)
    return r


# ---------------------------------------------------------------- summary and report

def _spread(xs: list[float]) -> dict | None:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)} if xs else None


def clean_rounds(res: dict) -> list[int]:
    """Rounds in which every trial finished and other processes used at most --max-others cores meanwhile."""
    limit = res.get("max_others_cores", 0.1)
    rounds = sorted({t["round"] for t in res["trials"]})
    return [r for r in rounds
            if {t["config"] for t in res["trials"] if t["round"] == r} == set(res["configs"])
            and all((t.get("others_cores") or 0.0) <= limit for t in res["trials"] if t["round"] == r)]


def summarize(res: dict) -> None:
    per = {}
    res["clean_rounds"] = clean = clean_rounds(res)
    res["disturbed_rounds"] = sorted({t["round"] for t in res["trials"]} - set(clean))
    for name in res["configs"]:
        ts = [t for t in res["trials"] if t["config"] == name and t["round"] in clean]
        ok = [t for t in ts if t["status"] == "ok"]
        per[name] = {"median_step_s": _spread([t["median_step_s"] for t in ok]),
                     "tokens_per_s": _spread([t["tokens_per_s"] for t in ok]),
                     "ok": len(ok), "failed": len(ts) - len(ok)}
        if name != "zt":
            per[name]["median_in_step_s"] = _spread([t["median_in_step_s"] for t in ok])
    by: dict[int, dict] = {}
    for t in res["trials"]:
        if t["status"] == "ok" and t["round"] in clean:
            by.setdefault(t["round"], {})[t["config"]] = t
    ratios, parity = {}, []
    for name in res["configs"][1:]:
        pairs = [(v["zt"], v[name]) for _, v in sorted(by.items()) if "zt" in v and name in v]
        xs = [p["median_step_s"] / z["median_step_s"] for z, p in pairs]
        ratios[name] = {**(_spread(xs) or {}), "per_round": [round(x, 3) for x in xs]}
        for z, p in pairs:
            diffs = [abs(x - y) for x, y in zip(z["loss"], p["loss"]) if x is not None and y is not None]
            parity.append({"round": z["round"], "config": name, "steps_compared": len(diffs),
                           "max_abs_loss_diff": max(diffs) if diffs else None,
                           "same_tokens_every_step": z["tokens"] == p["tokens"],
                           "first_step": {"zt": z["first_step"], name: p["first_step"]}})
    res["summary"], res["ratio_over_zt"], res["parity"] = per, ratios, parity


def _fmt(s: dict | None, nd: int = 3) -> str:
    if not s or "median" not in s:
        return "-"
    return f"{s['median']:.{nd}f} [{s['min']:.{nd}f}-{s['max']:.{nd}f}]"


def _num(x, nd: int) -> str:
    return f"{x:.{nd}f}" if isinstance(x, (int, float)) else "-"


def markdown(res: dict) -> str:
    S, R, m = res["summary"], res["ratio_over_zt"], res["machine"]
    v = m["versions"]
    sh, pl = res["model_shape"], res["pair_lengths"]
    lines = [
        "# DPO: zerotrain vs TRL DPOTrainer, DeepSpeed ZeRO-3 on 2 CPU ranks", "",
        f"Machine: {m['cpu']}, {m['cores']} shared cores, no GPU; mkldnn bf16 supported: {m['mkldnn_bf16']}; 2 ranks "
        f"over gloo, OMP_NUM_THREADS=1. {software(v, 'torch', 'deepspeed', 'transformers', 'trl', 'accelerate')}. "
        f"{run_span(res)}; each round runs {', '.join(res['configs'])} in turn; figures from the "
        f"{len(res['clean_rounds'])} undisturbed rounds {res['clean_rounds']}"
        + (f" (rounds {res['disturbed_rounds']} left out: other processes used more than "
           f"{res.get('max_others_cores', 0.1)} cores during a trial, or a trial failed; they stay in the JSON)"
           if res["disturbed_rounds"] else "")
        + ".",
        f"Model: Llama {sh['num_hidden_layers']} layers x {sh['hidden_size']}, {sh['num_attention_heads']} heads / "
        f"{sh['num_key_value_heads']} kv, ffn {sh['intermediate_size']}, vocab {sh['vocab_size']}, untied "
        f"({res['params'] / 1e6:.2f} M parameters), fp32. Data: {pl['pairs']} pairs, prompt + longer completion "
        f"{pl['min_tokens']}-{pl['max_tokens']} tokens (median {pl['median_tokens']}), {pl['over_seq_len']} over the "
        f"seq len. Run: seq len {res['seq_len']}, {res['micro_batch']} pairs per rank per micro-batch "
        f"({2 * res['micro_batch']} rows), grad-accum {res['grad_accum']}, {res['steps']} steps of which the first "
        f"{res['warmup']} are not timed; AdamW lr {LR:g} constant, beta {BETA}, clip 1, live reference model "
        "(ZeRO-3 partitioned), the same pairs in the same order on both sides."
        + (f" zerotrain from commit {res['source']['head'][:10]}"
           + (f" with uncommitted changes to {', '.join(x.split()[-1] for x in res['source']['zerotrain_changes'])}"
              if res["source"].get("zerotrain_changes") else "") + "." if res.get("source") else ""), "",
        "| config | median step time (s) | tokens/s | step time / zerotrain's (paired per round) | ok/failed |",
        "| --- | --- | --- | --- | --- |"]
    for name in res["configs"]:
        s = S[name]
        ratio = "1" if name == "zt" else _fmt(R.get(name), 2)
        lines.append(f"| {name}: {CONFIGS[name]['label']} | {_fmt(s['median_step_s'])} | "
                     f"{_fmt(s['tokens_per_s'], 0)} | {ratio} | {s['ok']}/{s['failed']} |")
    lines += ["", "Median [min-max] over rounds; a trial's figure is the median over its timed steps (tokens/s: their "
              "tokens / their summed time). Ratio > 1: zerotrain is faster. Per round: " + "; ".join(
                  f"{n} {', '.join(f'{x:.2f}' for x in R[n].get('per_round', []))}" for n in R) + ".", ""]
    peers = [n for n in res["configs"] if n != "zt" and S[n].get("median_in_step_s")]
    if peers:
        lines += ["TRL step time without the data fetch (on_step_begin..on_step_end, HF's own window): " + "; ".join(
            f"{n} {_fmt(S[n]['median_in_step_s'])} s" for n in peers) + ".", ""]
    if res["parity"]:
        lines += ["## Same training?", "",
                  ("| round | peer | first-step loss zt / peer | first-step logps/chosen zt / peer | "
                  "largest loss difference, all steps | same tokens every step |"),
                  "| --- | --- | --- | --- | --- | --- |"]
        for p in res["parity"]:
            fz, fp = p["first_step"]["zt"], p["first_step"][p["config"]]
            d = p["max_abs_loss_diff"]
            lines.append(f"| {p['round']} | {p['config']} | {_num(fz.get('loss'), 7)} / {_num(fp.get('loss'), 7)} | "
                         f"{_num(fz.get('logps/chosen'), 4)} / {_num(fp.get('logps/chosen'), 4)} | "
                         f"{'-' if d is None else f'{d:.2e}'} ({p['steps_compared']} steps) | "
                         f"{p['same_tokens_every_step']} |")
        lines += ["", ("The first step's DPO loss is ln 2 = 0.6931472 by construction (policy = reference); the "
                  "log-probs and the later losses are what show the same model, data and updates."), ""]
    busy = [t.get("others_cores") or 0.0 for t in res["trials"] if t["round"] in res["clean_rounds"]]
    lines += [(f"Other processes on the shared cores during the trials used (their CPU seconds / trial wall time) at "
              f"most {max(busy, default=0):.2f} cores in the rounds shown (before each trial the run waits until "
              "they use < 0.2 cores for 9 s)."), ""]
    bad = [t for t in res["trials"] if t["status"] != "ok"]
    if bad:
        lines += ["## Failures", ""] + [f"- round {t['round']} {t['config']}: {t['status']}: "
                                        f"`{(t.get('error') or '').splitlines()[0][:300] if t.get('error') else ''}`"
                                        for t in bad] + [""]
    lines += ["## What each step time covers, and what differs", ""] + res.get("notes", []) + [""]
    return "\n".join(lines)


NOTES = [
    ("- zerotrain: from drawing the step's micro-batches (dataloader + collate) to the end of its optimizer step and "
    "the read of the loss, per rank, max over ranks (metrics.jsonl step_time_s). TRL: from the trainer's "
    "get_batch_samples (dataloader + collate) to on_step_end (after clip, optimizer step, scheduler, zero_grad), per "
    "rank, max over ranks (all-gathered after training). Neither side adds a barrier. Excluded on both sides: "
    "start-up, model builds, dataset tokenization (TRL's dataset map runs in DPOTrainer.__init__, zerotrain's before "
    "its first step), HF's per-step logging after on_step_end, zerotrain's metrics gather (asynchronous, overlapped "
    "with the next step) and its end-of-run checkpoint."),
    ("- Same data, same order, same tokenization: the peer's sampler hands each rank zerotrain's micro-batches, and "
    "the non-padding token counts of every step are compared above. Both pad each micro-batch to its longest row."),
    ("- Head work differs: TRL patches a fused LM head (trl add_fused_lm_head, trl/kernels/chunked_logprob.py; on "
    "CPU its torch fallback, no Triton) that computes the per-token log-probs tile by tile without keeping the "
    "[rows, seq, vocab] logits, plus entropy, mean logits and top-1 flags for its metrics, and recomputes the head "
    "matmul in backward; zerotrain computes the full logits once and each label's log-prob as its logit minus the "
    "logsumexp (its --chunked-loss was not used), keeping the logits for backward: less compute, more memory. "
    "Both run one forward of the 2B rows (chosen and "
    "rejected together) for the policy and one for the reference."),
    ("- Per-step collectives besides ZeRO's: TRL's compute_loss gathers about a dozen metric tensors across ranks "
    "with .item() every micro-batch (inside its step time); zerotrain sends one all_gather per step, not waited for."),
    ("- ZeRO-3 settings differ between zt and trl (see zero_optimization per trial in the JSON): zerotrain makes each "
    "LlamaDecoderLayer a leaf module and picks its own buckets and persistence threshold; the HF docs' block lets HF "
    "fill reduce bucket h*h, prefetch 0.9*h*h, persistence 10*h. TRL's reference engine (prepare_deepspeed) gets the "
    "policy's config with those three keys still \"auto\", which DeepSpeed's config parser drops (so the "
    "reference runs with DeepSpeed's defaults: reduce bucket 5e8, prefetch 5e7, persistence 1e5); TRL's own values "
    "go to top-level dotted keys (\"zero_optimization.reduce_bucket_size\" etc.) that DeepSpeed does not read "
    "(ref_dotted_keys in the JSON). "
    "trl-ztzero takes zerotrain's whole zero_optimization block for both engines."),
    ("- Both use DeepSpeed's AdamW from the config's optimizer block (TRL: HF ignores optim=adamw_torch when the "
    "DeepSpeed config has one; the optimizer class is in the JSON) and a constant LR."),
    "- Shared 2-core machine: run-to-run noise is about +-5-10%; compare the paired ratios, not single numbers.",
]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=3, help="undisturbed rounds wanted")
    p.add_argument("--max-rounds", type=int, default=None, help="rounds run at most (default: --rounds + 3)")
    p.add_argument("--max-others", type=float, default=0.1,
                   help="a round counts only if other processes used at most this many cores during each trial")
    p.add_argument("--steps", type=int, default=12, help="optimizer steps per trial")
    p.add_argument("--warmup", type=int, default=4, help="first steps left out of the speed figures")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--micro-batch", type=int, default=4, help="pairs per rank per micro-batch")
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--pairs", type=int, default=256, help="pairs in the data file")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--peers", default="trl,trl-ztzero",
                   help=f"comma list of the TRL configurations run after zt: {', '.join(list(CONFIGS)[1:])}")
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "dpo.json"),
                   help="raw JSON; the markdown table goes next to it (.md)")
    p.add_argument("--workdir", default="/tmp/zt_dpo", help="model, data and trial logs")
    p.add_argument("--trial-timeout", type=float, default=600.0, help="seconds per trial (one torchrun launch)")
    p.add_argument("--quiet-wait", type=float, default=600.0,
                   help="before each trial, wait up to this many seconds until other processes use < 0.2 cores")
    p.add_argument("--report", action="store_true", help="only rewrite the .md from the JSON in --out")
    a = p.parse_args(argv)
    out = Path(a.out)
    if a.report:
        res = json.loads(out.read_text())
        summarize(res)
        res["notes"] = NOTES
        out.write_text(json.dumps(res, indent=1))
        out.with_suffix(".md").write_text(markdown(res))
        print(out.with_suffix(".md").read_text())
        return 0
    peers = [n.strip() for n in a.peers.split(",") if n.strip()]
    bad = [n for n in peers if n not in CONFIGS or n == "zt"]
    if bad or not peers:
        p.error(f"--peers: unknown {bad}; choose from {list(CONFIGS)[1:]}")
    if a.steps <= a.warmup:
        p.error("--steps must be > --warmup")
    workdir = offline_workdir(a.workdir, REPO)
    t0 = time.time()
    shape = model_shape(a.layers, a.hidden, a.vocab)
    model_dir = build_model(workdir, shape)
    data = build_pairs(workdir, a.pairs)
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        params = sum(x.numel() for x in AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
                     .parameters())
    res = {"date": time.strftime("%Y-%m-%d %H:%M"), "machine": machine(), "source": source_state(), "world": WORLD,
           "rounds": a.rounds,
           "steps": a.steps, "warmup": a.warmup, "seq_len": a.seq_len, "micro_batch": a.micro_batch,
           "grad_accum": a.grad_accum, "configs": ["zt", *peers], "config_labels": {n: CONFIGS[n]["label"] for n in
                                                                                   ["zt", *peers]},
           "model_shape": shape, "params": params, "model_dir": str(model_dir), "data": str(data),
           "pair_lengths": pair_lengths(model_dir, data, a.seq_len), "lr": LR, "beta": BETA, "seed": SEED,
           "trial_timeout_s": a.trial_timeout, "max_others_cores": a.max_others, "trials": []}
    out.parent.mkdir(parents=True, exist_ok=True)
    print(f"model {model_dir} ({params / 1e6:.2f} M); data {data}: {res['pair_lengths']}", flush=True)

    def save() -> None:
        res["wall_s"] = round(time.time() - t0, 1)
        summarize(res)
        res["notes"] = NOTES
        out.write_text(json.dumps(res, indent=1))
        out.with_suffix(".md").write_text(markdown(res))

    rnd = 0
    while len(clean_rounds(res)) < a.rounds and rnd < (a.max_rounds or a.rounds + 3):
        zt_zero = None
        for name in res["configs"]:
            quiet = wait_for_quiet(a.quiet_wait)
            t = run_trial(name, rnd, a, model_dir, data, workdir, zt_zero)
            t.update(quiet)
            if name == "zt":
                zt_zero = t.get("zero_optimization")
            res["trials"].append(t)
            save()
            print(f"round {rnd} {name:12s} {t['status']:7s} median step {t.get('median_step_s')} s "
                  f"tokens/s {t.get('tokens_per_s')} first loss {t['first_step'].get('loss')} wall {t['wall_s']} s "
                  f"others {t.get('others_cores')} cores "
                  f"{(t.get('error') or '').splitlines()[0] if t.get('error') else ''}", flush=True)
        rnd += 1
    save()
    print(out.with_suffix(".md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
