"""Whole-run peak RSS of `zerotrain train` (2 CPU ranks) against `estimate(plan).run_peak_rss`.

    python benchmarks/peak_calibration.py run --models small-gpt2,small-llama,llama-57m --out benchmarks/results/peak_in_sample.json
    python benchmarks/peak_calibration.py report --out benchmarks/results/peak_in_sample.json   # re-predict, table
    python benchmarks/peak_calibration.py run --set held-out     # other families, sizes and features (below)
    python benchmarks/peak_calibration.py report --set held-out

Two sets. "in-sample": the 46 runs the constants in zerotrain/memory/runtime.py were fitted to (GPT-2 and
Llama, 3-56 M parameters, fp32, DeepSpeed 0-3 and FSDP2, optimizer offload). "held-out" (HELD_OUT below):
families, sizes and features none of those runs had (Qwen2, Mistral, a BERT encoder with a fresh
classification head, a 137 M Llama, LoRA, tp=2, pp=2, bf16, a longer micro-batch), run only after the
constants' fingerprint (runtime.constants_fingerprint) was committed; each result records the fingerprint it
was predicted with, and `report` refuses to mix fingerprints.

Each case is launched the way `zerotrain compare` / `tune` launch a trial: the run plan's config
written with config.to_yaml (run.save_final TRUE, run.overwrite, a few steps), then
`python -m torch.distributed.run --nproc_per_node=2 -m zerotrain train --config RUN.yaml --output OUT`
with OMP_NUM_THREADS=1 and $ZEROTRAIN_MODEL_STATE_DIR set; the measured figure is the largest
rank's peak_rank{R}.json (VmHWM of the whole process: loading, training, checkpoint and final save).
A sampler also polls both ranks' VmRSS every 50 ms and the log lines' arrival times, so a result
says in which phase the peak fell (load, train, save). Measurements are kept in the JSON; `report`
recomputes the predictions with the current zerotrain.memory.estimate (so a formula change needs no rerun).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

MIB = 2**20
LLAMA_57M = dict(model_type="llama", num_hidden_layers=8, num_attention_heads=12, num_key_value_heads=4,
                 hidden_size=768, intermediate_size=2304, max_position_embeddings=512,
                 tie_word_embeddings=False)
"""A ~57M-parameter Llama with the embedded tokenizer's vocabulary (4096): the issue's small-size case."""

MODELS: dict[str, dict] = {
    "llama-57m": LLAMA_57M,
    # Held-out families and sizes (never used to fit a constant).
    "qwen2-50m": dict(model_type="qwen2", num_hidden_layers=6, num_attention_heads=12, num_key_value_heads=2,
                      hidden_size=768, intermediate_size=2560, max_position_embeddings=512,
                      tie_word_embeddings=False),
    "mistral-54m": dict(model_type="mistral", num_hidden_layers=10, num_attention_heads=10, num_key_value_heads=2,
                        hidden_size=640, intermediate_size=2048, max_position_embeddings=512, sliding_window=4096,
                        tie_word_embeddings=False),
    "llama-137m": dict(model_type="llama", num_hidden_layers=12, num_attention_heads=16, num_key_value_heads=4,
                       hidden_size=1024, intermediate_size=2816, max_position_embeddings=512,
                       tie_word_embeddings=False),
    # An encoder: the body is saved, `train --task seq-cls` adds a fresh 2-label head (the embedded sentiment set).
    "bert-26m": dict(model_type="bert", num_hidden_layers=8, num_attention_heads=8, hidden_size=512,
                     intermediate_size=2048, max_position_embeddings=512, hidden_dropout_prob=0.0,
                     attention_probs_dropout_prob=0.0),
}
"""Built locally (model_dir) with the embedded tokenizer's vocabulary (4096)."""
SEQ_CLS = {"bert-26m"}

SETUPS = [("deepspeed", 0, "none"), ("deepspeed", 1, "none"), ("deepspeed", 2, "none"), ("deepspeed", 3, "none"),
          ("fsdp", 0, "none"), ("fsdp", 2, "none"), ("fsdp", 3, "none")]
OFFLOAD = [("deepspeed", 2, "cpu"), ("deepspeed", 3, "cpu")]


def model_dir(name: str) -> str:
    """A from_pretrained directory (weights + the embedded tokenizer) for a case's model."""
    from zerotrain.assets.demo import build_tokenizer, cache_root, ensure_tiny_model

    if name not in MODELS:
        return str(ensure_tiny_model(name))
    out = cache_root() / "models" / f"{name}-calib"
    if (out / "config.json").is_file() and (out / "tokenizer.json").is_file():
        return str(out)
    import torch
    from transformers import CONFIG_MAPPING, AutoModel, AutoModelForCausalLM

    tok = build_tokenizer()
    kw = dict(MODELS[name])
    kw["vocab_size"] = -(-len(tok) // 64) * 64
    eos = tok.eos_token_id
    config = CONFIG_MAPPING[kw.pop("model_type")](bos_token_id=eos, eos_token_id=eos, pad_token_id=eos, **kw)
    torch.manual_seed(0)
    (AutoModel if name in SEQ_CLS else AutoModelForCausalLM).from_config(config).save_pretrained(out)
    tok.save_pretrained(out)
    return str(out)


def plan_for(model: str, backend: str, stage: int, offload: str, micro: int, accum: int, steps: int, seq: int = 128,
             extra: dict | None = None):
    """(run plan, model facts) exactly as compare/tune plan a trial (save_final on); extra: more dotted settings."""
    from zerotrain.config.load import build_config
    from zerotrain.memory.estimate import Setup, setup_plan
    from zerotrain.model.source import model_facts_for

    overrides = {"model.name": model_dir(model), "batch.micro_batch": micro, "batch.grad_accum": accum,
                 "data.seq_len": seq, "precision.dtype": "fp32", "run.max_steps": steps, "run.overwrite": True,
                 "run.save_final": True, "zero.stage": stage}
    if model in SEQ_CLS:
        overrides.update({"model.task": "seq-cls", "model.num_labels": 2})
    cfg = build_config(overrides={**overrides, **(extra or {})})
    facts = model_facts_for(cfg)
    offload_param = (extra or {}).get("zero.offload_param", "none")  # a Setup sets both offloads
    return setup_plan(cfg, Setup(backend, stage, offload, offload_param), 2, facts=facts, device="cpu"), facts


def _children_rss(pid: int) -> dict:
    """{child pid: VmRSS bytes} of a process's children (the torchrun's worker processes)."""
    rss = {}
    try:
        kids = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        kids = []
    for k in kids:
        try:
            for ln in Path(f"/proc/{k}/status").read_text().splitlines():
                if ln.startswith("VmRSS:"):
                    rss[k] = int(ln.split()[1]) * 1024
        except OSError:
            pass
    return rss


def _sample(pid: int, log: Path, stop: threading.Event, trace: list, lines: list) -> None:
    """Every 50 ms: (t, _children_rss) into trace, and (t, line) into lines for each line the run wrote to
    its log since (its arrival time, on the same clock); reads the log once more after `stop`."""
    t0, pending = time.perf_counter(), ""
    with log.open(errors="replace") as f:
        while True:
            t, stopping = round(time.perf_counter() - t0, 3), stop.is_set()
            *done, pending = (pending + f.read()).split("\n")  # a line's end may not be written yet
            lines += [(t, ln.rstrip()[:200]) for ln in done]
            if stopping:
                break
            trace.append((t, _children_rss(pid)))
            stop.wait(0.05)
    if pending.strip():
        lines.append((t, pending.rstrip()[:200]))


def launch(name: str, plan, work: Path, timeout: float = 900) -> dict:
    from zerotrain.config.load import to_yaml
    from zerotrain.launch.subprocess_run import run_with_timeout
    from zerotrain.memory.measure import MODEL_STATE_ENV
    from zerotrain.util import free_port

    out, state = work / name, work / name / "model_state"
    state.mkdir(parents=True, exist_ok=True)
    for old in state.glob("*.json"):
        old.unlink()
    run_yaml = work / f"{name}.yaml"
    run_yaml.write_text(to_yaml(plan.cfg))
    env = dict(os.environ, **{MODEL_STATE_ENV: str(state)}, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--nnodes=1",
           "--master_addr=127.0.0.1", f"--master_port={free_port()}", "-m", "zerotrain", "train",
           "--config", str(run_yaml), "--output", str(out)]  # what compare/tune launch per trial
    log = work / f"{name}.log"
    trace: list = []
    lines: list = []
    stop = threading.Event()
    sampler: list[threading.Thread] = []

    def start_sampler(proc: subprocess.Popen) -> None:
        sampler.append(threading.Thread(target=_sample, args=(proc.pid, log, stop, trace, lines), daemon=True))
        sampler[0].start()

    res = run_with_timeout(cmd, timeout, env=env, log=log, watch=start_sampler)
    stop.set()
    sampler[0].join()
    rc = res.returncode
    peaks = {int(p.stem.rsplit("rank", 1)[1]): json.loads(p.read_text())["peak_rss_bytes"]
             for p in state.glob("peak_rank*.json")}
    ranks = sorted({k for _, r in trace for k in r})
    peak_at = {}
    for k in ranks:
        t, v = max(((t, r[k]) for t, r in trace if k in r), key=lambda x: x[1])
        peak_at[k] = {"t": t, "rss": v}
    return {"rc": rc, "wall_s": round(res.seconds, 1), "peak_rss_bytes": peaks,
            "measured": max(peaks.values()) if peaks else None, "sampled_peak": peak_at,
            "trace": [(t, [r.get(k, 0) // MIB for k in ranks]) for t, r in trace[::4]],
            "log": [x for x in lines if any(w in x[1] for w in ("backend", "step", "saved", "final", "Error",
                                                                   "error", "checkpoint"))][-40:]
            if rc == 0 else [x for x in lines if "Error" in x[1]][:10] + lines[-30:]}


def predict(case: dict) -> dict:
    from zerotrain.memory.estimate import estimate

    plan, facts = plan_for(case["model"], case["backend"], case["stage"], case["offload"], case["micro"],
                           case["accum"], case["steps"], case.get("seq", 128), case.get("extra"))
    e = estimate(plan)
    covers = {"device": plan.device, "world_size": plan.world.world_size, "num_params": facts.num_params,
              "model_type": facts.model_type, "dtype": plan.dtype,
              "tokens_per_micro_batch": plan.batch.micro_batch * plan.cfg.data.seq_len, "tp": plan.world.tp,
              "pp": plan.world.pp, "sp": plan.world.sp, "lora": bool(facts.frozen_params),
              "offload_param": plan.sharding.offload_param != "none",
              "gradient_checkpointing": plan.cfg.model.gradient_checkpointing}
    return {"covers": covers, "num_params": facts.num_params, "run_peak_rss": e.run_peak_rss, "peak_rss": e.peak_rss,
            "model_states": e.model_states, "activations": e.activations, "transient": e.transient,
            "baseline_rss": e.baseline_rss}


def cases(models: list[str], accums: list[int], offload: bool, steps: int) -> list[dict]:
    out = []
    for m in models:
        for acc in accums:
            for be, st, off in SETUPS + (OFFLOAD if offload else []):
                out.append(dict(model=m, backend=be, stage=st, offload=off, micro=4, accum=acc, steps=steps))
    return out


def _held(model: str, backend: str, stage: int, tag: str = "", offload: str = "none", micro: int = 4,
          accum: int = 1, seq: int = 128, **extra) -> dict:
    return dict(model=model, backend=backend, stage=stage, offload=offload, micro=micro, accum=accum, seq=seq,
                steps=4, tag=tag, extra={k.replace("__", "."): v for k, v in extra.items()})


HELD_OUT = [
    # families and sizes the fit never saw, fp32
    *[_held("qwen2-50m", be, st) for be, st in (("deepspeed", 0), ("deepspeed", 2), ("deepspeed", 3),
                                                 ("fsdp", 2), ("fsdp", 3))],
    _held("mistral-54m", "deepspeed", 1), _held("mistral-54m", "deepspeed", 3, offload="cpu"),
    _held("mistral-54m", "fsdp", 0),
    *[_held("bert-26m", be, st) for be, st in (("deepspeed", 2), ("deepspeed", 3), ("fsdp", 3))],
    *[_held("llama-137m", be, st) for be, st in (("deepspeed", 2), ("deepspeed", 3), ("fsdp", 3))],
    # features the fit never saw, on the in-sample llama-57m and the held-out qwen2-50m
    *[_held(m, be, st, "lora", lora__r=16) for m, be, st in (("llama-57m", "deepspeed", 2),
                                                            ("llama-57m", "deepspeed", 3), ("llama-57m", "fsdp", 3),
                                                            ("qwen2-50m", "deepspeed", 2))],
    *[_held(m, be, st, "tp2", parallel__tp=2) for m, be, st in (("llama-57m", "deepspeed", 1),
                                                               ("llama-57m", "fsdp", 2), ("qwen2-50m", "fsdp", 2))],
    *[_held(m, be, st, "pp2", accum=2, parallel__pp=2) for m, be, st in (("llama-57m", "deepspeed", 1),
                                                                        ("llama-57m", "fsdp", 2),
                                                                        ("qwen2-50m", "deepspeed", 0))],
    *[_held(m, be, st, "bf16", precision__dtype="bf16") for m, be, st in (("llama-57m", "deepspeed", 2),
                                                                         ("llama-57m", "deepspeed", 3),
                                                                         ("llama-57m", "fsdp", 3),
                                                                         ("qwen2-50m", "deepspeed", 2))],
    # recomputed activations (half of tune's candidates) and ZeRO-3 parameter offload
    *[_held(m, be, st, "ckpt", model__gradient_checkpointing=True) for m, be, st in (("llama-57m", "deepspeed", 2),
                                                                                    ("llama-57m", "fsdp", 3),
                                                                                    ("qwen2-50m", "deepspeed", 3))],
    _held("llama-57m", "deepspeed", 3, "offparam", offload="cpu", zero__offload_param="cpu"),
    # a longer micro-batch (activations 8x the fit's 4 x 128 tokens)
    *[_held("small-gpt2", be, st, "mb8s256", micro=8, seq=256) for be, st in (("deepspeed", 2), ("fsdp", 3))],
    _held("small-llama", "deepspeed", 3, "mb8s256", micro=8, seq=256),
]
"""The held-out set: run once, after the constants' fingerprint was committed; reported whatever the error."""


def case_name(c: dict) -> str:
    return (f"{c['model']}-{c['backend']}-z{c['stage']}" + ("-off" if c["offload"] != "none" else "")
            + f"-ga{c['accum']}" + (f"-{c['tag']}" if c.get("tag") else ""))


def _commit() -> str:
    out = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return out.stdout.strip()


def _native_bf16() -> bool:
    import torch

    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=("run", "report"))
    ap.add_argument("--set", choices=("in-sample", "held-out"), default="in-sample")
    ap.add_argument("--models", default="small-gpt2,small-llama,llama-57m")
    ap.add_argument("--accum", default="1")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--offload", action="store_true")
    ap.add_argument("--only", default="", help="comma list of substrings of case names")
    ap.add_argument("--work", default="/tmp/peak_calib")
    ap.add_argument("--out", default=None, help="default: benchmarks/results/peak_in_sample.json (in-sample), "
                                                  "benchmarks/results/peak_heldout.json (held-out)")
    a = ap.parse_args()
    from zerotrain.memory.runtime import constants_fingerprint

    held_out = a.set == "held-out"
    path = Path(a.out or REPO / "benchmarks" / ("results/peak_heldout.json" if held_out
                                                else "results/peak_in_sample.json"))
    results = json.loads(path.read_text()) if path.exists() else {}
    fingerprint = constants_fingerprint()
    print(f"fitted constants' fingerprint: {fingerprint}")
    if a.mode == "run":
        todo = HELD_OUT if held_out else cases(a.models.split(","), [int(x) for x in a.accum.split(",")],
                                                  a.offload, a.steps)
        for c in todo:
            name = case_name(c)
            if a.only and not any(s in name for s in a.only.split(",")):
                continue
            plan, _ = plan_for(c["model"], c["backend"], c["stage"], c["offload"], c["micro"], c["accum"], c["steps"],
                               c.get("seq", 128), c.get("extra"))
            r = launch(name, plan, Path(a.work))
            results[name] = {"case": c, **r, "date": time.strftime("%Y-%m-%d %H:%M"),
                             "constants_fingerprint": fingerprint, "commit": _commit(),
                             "native_cpu_bf16": _native_bf16()}
            path.write_text(json.dumps(results, indent=1))
            print(f"{name}: rc {r['rc']} {r['wall_s']}s measured {(r['measured'] or 0) / MIB:.0f} MiB "
                  f"sampled {[v['rss'] // MIB for v in r['sampled_peak'].values()]} at "
                  f"{[v['t'] for v in r['sampled_peak'].values()]}", flush=True)
    rows = []
    for name, r in results.items():
        if not r.get("measured"):
            print(f"{name}: no measurement (rc {r.get('rc')})")
            continue
        if held_out and r.get("constants_fingerprint") != fingerprint:
            raise SystemExit(f"{name} was predicted with constants {r.get('constants_fingerprint')}, these are "
                             f"{fingerprint}: a held-out figure is only valid for the constants it was run after")
        p = predict(r["case"])
        err = 100.0 * (r["measured"] - p["run_peak_rss"]) / r["measured"]
        r.update(covers=p["covers"], predicted=p["run_peak_rss"], error_pct=round(err, 2))  # what the unit test reads
        rows.append((name, p["num_params"], p["run_peak_rss"] / MIB, r["measured"] / MIB, err))
    print("| config | params | predicted MiB | measured MiB | (measured - predicted) / measured |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for name, n, pr, me, err in rows:
        flag = "  **over 15%**" if abs(err) > 15 else ""
        print(f"| {name} | {n / 1e6:.1f} M | {pr:,.0f} | {me:,.0f} | {err:+.1f}%{flag} |")
    if a.mode == "report":
        path.write_text(json.dumps(results, indent=1))  # with each run's prediction, error and covered region
    if rows:
        errs = [r[4] for r in rows]
        within = sum(abs(e) <= 15 for e in errs)
        print(f"\n{len(rows)} runs: {within} within 15%; largest under-prediction {max(errs):+.1f}%, largest "
              f"over-prediction {min(errs):+.1f}%, mean |error| {sum(map(abs, errs)) / len(errs):.1f}%")


if __name__ == "__main__":
    main()
