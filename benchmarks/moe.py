"""Mixture of experts on 2 CPU ranks: expert parallelism vs plain ZeRO-3, and DeepSpeed ZeRO-3 leaf modules.

    .venv/bin/python benchmarks/moe.py [--rounds 3] [--steps 8] [--only dp2,ep2,ds-noleaf,ds-leaf-block,ds-leaf-moe]
        [--out benchmarks/results/moe.json] [--workdir /tmp/zt_moe] [--trial-timeout 600] [--report]

benchmarks/results/moe.{json,md} come from `--rounds 5 --steps 8` (~7 min); a smoke check of every
configuration: `--rounds 1 --steps 3 --out /tmp/zt_moe/smoke.json` (~1.5 min).

Every trial is ONE `torchrun --nproc_per_node 2` launch (2 CPU ranks, gloo, a free master port,
OMP_NUM_THREADS=1 per rank) of `python -m zerotrain train`, in its own session under a wall-clock timeout
(--trial-timeout): the whole process group is killed when it runs out. The configurations run interleaved:
each round runs every configuration once (round-robin; round r starts at the r-th configuration, so no
configuration always runs first), for --rounds rounds. A failed trial keeps its error line in the JSON and the
run goes on. Configurations (all fp32, ZeRO stage 3, AdamW lr 1e-4 constant, seq 256, micro-batch 4 per rank,
grad-accum 1, --steps optimizer steps, --no-save-final; the end-of-run checkpoint is written after the last
timed step and deleted):

  Part 1, FSDP2 (`--backend fsdp --stage 3`):
    dp2            plain data parallel: every parameter (experts included) sharded over both ranks.
    ep2            + `--ep 2`: each rank holds 4 of the 8 experts of every MoE block whole; tokens go to their
                   experts' rank and back by all-to-all; the dense parameters stay sharded over both ranks.
  Part 2, DeepSpeed (`--backend deepspeed --stage 3`):
    ds-noleaf      `--no-leaf-blocks`: no ZeRO-3 leaf modules (one fetch/release hook per submodule, so each
                   expert's weights are gathered as the router sends tokens to it).
    ds-leaf-block  `--leaf-blocks`: every decoder block (Qwen3MoeDecoderLayer) is one leaf module.
    ds-leaf-moe    the sparse MoE block (Qwen3MoeSparseMoeBlock) as leaf module, through a --config YAML holding
                   `ds_overrides: {zero_optimization: {leaf_module: {classes: [Qwen3MoeSparseMoeBlock]}}}`
                   (zero.leaf_blocks left unset: zerotrain/plan/run_plan.py lets the raw key win).

Model: a Qwen3-MoE built here from transformers.Qwen3MoeConfig (hidden 256, 4 layers, 4 heads / 2 kv heads,
head_dim 64, 8 experts top-2 with moe_intermediate_size 256, intermediate_size 688 (unused: every layer is
sparse), vocab 4096, max positions 512, untied head; random init, seed 0) saved with save_pretrained together
with zerotrain's embedded BPE tokenizer (zerotrain.assets.demo.build_tokenizer(4096)) under --workdir. Data:
zerotrain's embedded corpus (no --data), packed to 256-token blocks.

Figures per trial, from the run's metrics.jsonl (one line per optimizer step, already global: tokens summed
over ranks, step time and VmHWM the max over ranks): tokens/s = the tokens of the steps after the first
SKIP / their summed step time (the per-step median is kept too); peak RSS = `peak_mem_bytes` of the last
step (VmHWM, largest rank). Model-state bytes: zerotrain's own count (zerotrain/memory/measure.py
measure_model_state_bytes: params, grads, optimizer states, each storage once), which every rank writes
to $ZEROTRAIN_MODEL_STATE_DIR/model_state_rank{R}.json after the first backward of the last step; reported
is the largest rank's total and its split. Per configuration: the median and [min-max] over rounds; ratios
(ep2 / dp2, ds-leaf-block / ds-noleaf, ds-leaf-moe / ds-noleaf) are paired within each round, then median
[min-max] over rounds.
"""
from __future__ import annotations

import argparse
import importlib.metadata
import json
import shutil
import statistics
import sys
import time
from pathlib import Path

from launching import (  # noqa: E402 - benchmarks/ is the script's folder
    first_error, free_port, launch, offline_workdir, run_span, save_model_dir, software, step_records, trial_env)

REPO = Path(__file__).resolve().parents[1]
PY = sys.executable
MIB = 1024**2
GIB = 1024**3
WORLD = 2
SKIP = 2
"""Optimizer steps left out of the speed figures (the first ones pay one-time costs)."""

MODEL = dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
             moe_intermediate_size=256, intermediate_size=688, num_experts=8, num_experts_per_tok=2,
             vocab_size=4096, max_position_embeddings=512, tie_word_embeddings=False)
RUN = ["--precision", "fp32", "--seq-len", "256", "--micro-batch", "4", "--grad-accum", "1", "--lr", "1e-4",
       "--schedule", "constant", "--seed", "0", "--save-every", "0", "--no-save-final", "--log-every", "1"]
LEAF_MOE_YAML = {"ds_overrides": {"zero_optimization": {"leaf_module": {"classes": ["Qwen3MoeSparseMoeBlock"]}}}}

CONFIGS = {
    "dp2": {"part": 1, "label": "FSDP2 ZeRO-3, data parallel", "args": ["--backend", "fsdp", "--stage", "3"]},
    "ep2": {"part": 1, "label": "FSDP2 ZeRO-3 + --ep 2", "args": ["--backend", "fsdp", "--stage", "3", "--ep", "2"]},
    "ds-noleaf": {"part": 2, "label": "DeepSpeed ZeRO-3, no leaf modules",
                  "args": ["--backend", "deepspeed", "--stage", "3", "--no-leaf-blocks"]},
    "ds-leaf-block": {"part": 2, "label": "DeepSpeed ZeRO-3, leaf = decoder block",
                      "args": ["--backend", "deepspeed", "--stage", "3", "--leaf-blocks"]},
    "ds-leaf-moe": {"part": 2, "label": "DeepSpeed ZeRO-3, leaf = sparse MoE block",
                    "args": ["--backend", "deepspeed", "--stage", "3"], "yaml": LEAF_MOE_YAML},
}
RATIOS = [("ep2", "dp2"), ("ds-leaf-block", "ds-noleaf"), ("ds-leaf-moe", "ds-noleaf")]
"""(configuration, its baseline): tokens/s ratios paired per round."""


def env(state_dir: Path | None = None) -> dict:
    return trial_env(REPO, state_dir)


def versions() -> dict:
    return {p: importlib.metadata.version(p) for p in ("torch", "deepspeed", "transformers")}


# ---------------------------------------------------------------- model

def build_model(workdir: Path) -> Path:
    """The Qwen3-MoE + tokenizer directory (built once, then reused)."""
    out = workdir / "qwen3moe-h256-l4-e8top2-v4096"
    if (out / "config.json").is_file() and (out / "tokenizer.json").is_file():
        return out
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from zerotrain.assets.demo import build_tokenizer

    tok = build_tokenizer(4096)
    eos = tok.eos_token_id
    cfg = Qwen3MoeConfig(**MODEL, bos_token_id=eos, eos_token_id=eos, pad_token_id=eos)
    return save_model_dir(out, Qwen3MoeForCausalLM, cfg, tok)


def param_counts(model_dir: Path) -> dict:
    """Parameters of the model: all, the routed experts', the rest (for the expected per-rank split)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        m = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(model_dir)))
    total = sum(p.numel() for p in m.parameters())
    experts = sum(p.numel() for n, p in m.named_parameters() if ".experts." in n)
    return {"total": total, "experts": experts, "dense": total - experts}


# ---------------------------------------------------------------- one trial

def error_text(log: Path) -> str:
    """The first exception line (the root cause; torchrun's ChildFailedError summary skipped) and the log's last lines."""
    lines = log.read_text(errors="replace").splitlines()
    first = first_error(lines)
    tail = "\n".join(ln[:300] for ln in lines[-15:])
    return (first + "\n--- last lines:\n" + tail).strip()


def run_trial(name: str, rnd: int, steps: int, model_dir: Path, workdir: Path, timeout: float) -> dict:
    cfg = CONFIGS[name]
    tdir = workdir / "trials" / f"r{rnd}-{name}"
    shutil.rmtree(tdir, ignore_errors=True)
    tdir.mkdir(parents=True)
    extra = []
    if cfg.get("yaml"):
        import yaml

        (tdir / "run.yaml").write_text(yaml.safe_dump(cfg["yaml"]))
        extra = ["--config", str(tdir / "run.yaml")]
    cmd = [PY, "-m", "torch.distributed.run", f"--nproc_per_node={WORLD}", "--nnodes=1", "--master_addr=127.0.0.1",
           f"--master_port={free_port()}", "-m", "zerotrain", "train", *extra, "--model", str(model_dir),
           *cfg["args"], *RUN, "--max-steps", str(steps), "--output", str(tdir / "run"), "--overwrite"]
    r = launch(cmd, tdir / "log.txt", timeout, env(tdir / "state"), REPO)
    r.update(config=name, round=rnd, cmd=" ".join(cmd[cmd.index("-m", 1) + 1:]))
    recs = step_records(tdir / "run" / "metrics.jsonl")
    r["step_s"] = [round(x["step_time_s"], 4) for x in recs]
    r["loss"] = [x.get("loss") for x in recs]
    timed = recs[SKIP:]
    if timed:
        r["tokens_per_step"] = int(timed[-1]["tokens"])
        r["tokens_per_s"] = round(sum(x["tokens"] for x in timed) / sum(x["step_time_s"] for x in timed), 1)
        r["tokens_per_s_step_median"] = round(statistics.median(x["tokens_per_s"] for x in timed), 1)
        r["peak_rss_bytes"] = int(recs[-1]["peak_mem_bytes"])  # VmHWM after the last step, largest rank
    ms = [json.loads(p.read_text()) for p in sorted((tdir / "state").glob("model_state_rank*.json"))]
    r["model_state_per_rank"] = [{k: v for k, v in m["measured"].items() if k not in ("sources", "device")}
                                 for m in ms]
    if ms:
        big = max(r["model_state_per_rank"], key=lambda m: m["total"])
        r["model_state_bytes"] = big["total"]
        r["model_state_split"] = big
    r["run_peak_rss_bytes_per_rank"] = [json.loads(p.read_text())["peak_rss_bytes"]
                                        for p in sorted((tdir / "state").glob("peak_rank*.json"))]
    ok = r["rc"] == 0 and len(recs) >= steps and "tokens_per_s" in r
    r["status"] = "ok" if ok else ("timeout" if r["killed"] else "error")
    if not ok:
        r["error"] = error_text(tdir / "log.txt")
    r["log"] = str(tdir / "log.txt")
    shutil.rmtree(tdir / "run" / "checkpoints", ignore_errors=True)  # the end-of-run checkpoint
    return r


# ---------------------------------------------------------------- summary and report

def _spread(xs: list[float]) -> dict | None:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)} if xs else None


def summarize(res: dict) -> None:
    per, ratios = {}, {}
    for name in res["configs"]:
        ts = [t for t in res["trials"] if t["config"] == name]
        ok = [t for t in ts if t["status"] == "ok"]
        per[name] = {"tokens_per_s": _spread([t["tokens_per_s"] for t in ok]),
                     "peak_rss_bytes": _spread([t["peak_rss_bytes"] for t in ok]),
                     "model_state_bytes": _spread([t["model_state_bytes"] for t in ok if t.get("model_state_bytes")]),
                     "ok": len(ok), "failed": len(ts) - len(ok)}
    for a, b in RATIOS:
        if a not in res["configs"] or b not in res["configs"]:
            continue
        by = {}
        for t in res["trials"]:
            if t["status"] == "ok" and t["config"] in (a, b):
                by.setdefault(t["round"], {})[t["config"]] = t["tokens_per_s"]
        xs = [v[a] / v[b] for _, v in sorted(by.items()) if a in v and b in v]
        ratios[f"{a}/{b}"] = {**(_spread(xs) or {}), "per_round": [round(x, 3) for x in xs]}
    res["summary"], res["ratios"] = per, ratios


def _fmt(s: dict | None, scale: float = 1.0, nd: int = 0) -> str:
    if not s or "median" not in s:
        return "-"
    return f"{s['median'] / scale:.{nd}f} [{s['min'] / scale:.{nd}f}-{s['max'] / scale:.{nd}f}]"


def markdown(res: dict) -> str:
    S, R = res["summary"], res["ratios"]
    v, pc = res["versions"], res["params"]
    lines = ["# Mixture of experts: expert parallelism and ZeRO-3 leaf modules (2 CPU ranks)", "",
             f"Machine: 2 shared CPU cores, no GPU, 2 ranks over gloo, OMP_NUM_THREADS=1; "
             f"{software(v, 'torch', 'deepspeed', 'transformers')}. {run_span(res, rounds=True)} interleaved.",
             f"Model: Qwen3-MoE h256 x 4 layers, 4 heads / 2 kv, 8 experts top-2 (moe ffn 256), vocab 4096, untied; "
             f"{pc['total'] / 1e6:.2f} M parameters, of which routed experts {pc['experts'] / 1e6:.2f} M. "
             f"fp32, AdamW, seq 256, micro-batch 4 per rank, grad-accum 1, {res['steps']} steps; tokens/s over "
             f"steps {SKIP + 1}-{res['steps']} (global, {res.get('tokens_per_step') or '?'} tokens per step). "
             "Median [min-max] over rounds; ratios paired per round.", ""]
    parts = {1: ("FSDP2 ZeRO-3: data parallel vs expert parallel", "dp2",
                 "| config | tokens/s | model-state MiB (largest rank) | peak RSS GiB | ratio vs dp2 |"),
             2: ("DeepSpeed ZeRO-3: leaf modules", "ds-noleaf",
                 "| config | tokens/s | model-state MiB (largest rank) | peak RSS GiB | ratio vs no leaf |")}
    for part, (title, base, head) in parts.items():
        names = [n for n in res["configs"] if CONFIGS[n]["part"] == part]
        if not names:
            continue
        lines += [f"## {title}", "", head, "| --- | --- | --- | --- | --- |"]
        for n in names:
            s = S[n]
            ratio = "1" if n == base else _fmt(R.get(f"{n}/{base}"), nd=2)
            fail = f" ({s['failed']} failed)" if s["failed"] else ""
            lines.append(f"| {n}: {CONFIGS[n]['label']}{fail} | {_fmt(s['tokens_per_s'])} | "
                         f"{_fmt(s['model_state_bytes'], MIB, 1)} | {_fmt(s['peak_rss_bytes'], GIB, 2)} | {ratio} |")
        lines.append("")
    bad = [t for t in res["trials"] if t["status"] != "ok"]
    if bad:
        lines += ["## Failures", ""]
        lines += [f"- round {t['round']} {t['config']}: {t['status']}: `{(t.get('error') or '').splitlines()[0][:200]}`"
                  for t in bad]
        lines.append("")
    lines += ["## What the numbers say", ""] + res.get("notes", []) + [""]
    return "\n".join(lines)


def notes(res: dict) -> list[str]:
    """Plain statements of what was measured (no claims beyond it)."""
    S, R, pc = res["summary"], res["ratios"], res["params"]
    out = []
    split = {n: next((t["model_state_split"] for t in res["trials"] if t["config"] == n and t.get("model_state_split")),
                     None) for n in res["configs"]}
    if split.get("dp2") and split.get("ep2"):
        whole = 4 * 4 * pc["total"]  # fp32 param + grad + 2 Adam moments of the whole model
        exp = 4 * 4 * pc["experts"] / WORLD
        same = "the same" if split["dp2"] == split["ep2"] else "different"
        out.append(f"- Model state, largest rank: dp2 {split['dp2']['total']:,} B, ep2 {split['ep2']['total']:,} B "
                   f"({same} split: params/grads/Adam), = half of the whole model's {whole:,} B. So each rank holds half "
                   f"of the expert bytes ({exp / MIB:.1f} MiB of param+grad+Adam) either way: ZeRO-3 as a 1/2 shard of "
                   "every expert, ep2 as 4 of the 8 experts whole; on 2 ranks ep saves no model-state memory over "
                   "ZeRO-3, it changes the traffic (token all-to-all instead of expert all-gathers / reduce-scatters).")
    ds = next((split[n] for n in ("ds-noleaf", "ds-leaf-block", "ds-leaf-moe") if split.get(n)), None)
    if ds:
        out.append(f"- DeepSpeed ZeRO-3 (all three alike): {ds['total']:,} B per rank: the same params/grads/Adam plus "
                   f"a separate fp32 partition copy ({ds['master']:,} B) and flat buffers ({ds['buffers']:,} B).")
    for k, what in (("ep2/dp2", "ep2 / dp2"), ("ds-leaf-block/ds-noleaf", "decoder-block leaf / no leaf"),
                    ("ds-leaf-moe/ds-noleaf", "MoE-block leaf / no leaf")):
        r = R.get(k)
        if r and r.get("n"):
            out.append(f"- tokens/s {what}: {r['median']:.2f} [{r['min']:.2f}-{r['max']:.2f}], per round "
                       f"{', '.join(f'{x:.2f}' for x in r['per_round'])}.")
    losses = {t["config"]: t["loss"][-1] for t in res["trials"] if t["status"] == "ok" and t["loss"]}
    if losses:
        out.append(f"- Loss at step {res['steps']}: {min(losses.values()):.5f}-{max(losses.values()):.5f} over all "
                   "configurations (the same training, differently laid out).")
    out.append("- CPU gloo: all-to-all and all-gathers both cost here; the speed ratios say little about GPUs. Shared "
               "2-core machine: differences within the min-max spread of the rounds are noise.")
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=8, help="optimizer steps per trial (the first 2 are not timed)")
    p.add_argument("--only", default=",".join(CONFIGS), help=f"comma list of {', '.join(CONFIGS)}")
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "moe.json"),
                   help="raw JSON; the markdown table goes next to it (.md)")
    p.add_argument("--trial-timeout", type=float, default=600.0, help="seconds per trial (one torchrun launch)")
    p.add_argument("--workdir", default="/tmp/zt_moe", help="model and trial logs")
    p.add_argument("--report", action="store_true", help="only rewrite the .md (and notes) from the JSON in --out")
    a = p.parse_args(argv)
    if a.report:
        res = json.loads(Path(a.out).read_text())
        summarize(res)
        res["notes"] = notes(res)
        Path(a.out).write_text(json.dumps(res, indent=1))
        Path(a.out).with_suffix(".md").write_text(markdown(res))
        print(Path(a.out).with_suffix(".md").read_text())
        return 0
    names = [n.strip() for n in a.only.split(",") if n.strip()]
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        p.error(f"unknown config(s) {unknown}; choose from {list(CONFIGS)}")
    if a.steps <= SKIP:
        p.error(f"--steps must be > {SKIP}")
    workdir = offline_workdir(a.workdir, REPO)
    t0 = time.time()
    model_dir = build_model(workdir)
    res = {"date": time.strftime("%Y-%m-%d %H:%M"), "versions": versions(), "world": WORLD, "rounds": a.rounds,
           "steps": a.steps, "skip_steps": SKIP, "configs": names, "model_config": MODEL,
           "params": param_counts(model_dir), "run_args": RUN, "trial_timeout_s": a.trial_timeout,
           "config_args": {n: CONFIGS[n] for n in names}, "trials": []}
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    print(f"model {model_dir}: {res['params']}", flush=True)

    def save() -> None:
        res["wall_s"] = round(time.time() - t0, 1)
        summarize(res)
        res["tokens_per_step"] = next((t["tokens_per_step"] for t in res["trials"] if t.get("tokens_per_step")), None)
        res["notes"] = notes(res)
        out.write_text(json.dumps(res, indent=1))
        out.with_suffix(".md").write_text(markdown(res))

    for rnd in range(a.rounds):
        k = rnd % len(names)
        for name in names[k:] + names[:k]:
            t = run_trial(name, rnd, a.steps, model_dir, workdir, a.trial_timeout)
            res["trials"].append(t)
            save()
            ms = t.get("model_state_bytes")
            print(f"round {rnd} {name:14s} {t['status']:7s} tokens/s {t.get('tokens_per_s')} "
                  f"model-state {ms / MIB if ms else 0:.1f} MiB peak {(t.get('peak_rss_bytes') or 0) / GIB:.2f} GiB "
                  f"wall {t['wall_s']} s {(t.get('error') or '').splitlines()[0] if t.get('error') else ''}",
                  flush=True)
    save()
    print(out.with_suffix(".md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
