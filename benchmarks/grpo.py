"""Online RL on CPU: zerotrain `--task grpo` against TRL's GRPOTrainer, the issue's two proofs in one script.

    .venv/bin/python benchmarks/grpo.py --learn [--seeds 0,1,2] [--steps 40] [--lr 3e-3]
    .venv/bin/python benchmarks/grpo.py --speed [--rounds 4] [--steps 8] [--warmup 2] [--max-completion-len 32]
        [--layers 4] [--hidden 256] [--global-batch 32] [--configs zt-phase,zt-exact,zt-forward,zt-stage0,trl-z3]
    .venv/bin/python benchmarks/grpo.py --learn --report      (rewrite the .md / .png from the JSON)
    common: [--out-dir benchmarks/results] [--workdir /tmp/zt_grpo] [--trial-timeout 600]

benchmarks/results/grpo_learn.{json,md,png} and grpo_speed.{json,md} come from the defaults (on the 2 shared cores:
learn ~3 min, speed ~10 min). Every trial is ONE launch in its own session under a wall-clock timeout (the whole
process tree is killed when it runs out; launching.launch): zerotrain and TRL-under-DeepSpeed as `torchrun --nproc_per_node 2` (2 CPU
ranks, gloo, a free master port, OMP_NUM_THREADS=1 per rank), TRL in one process as plain `python`. A failed trial
keeps its error line in the JSON and the run goes on. The machine's 2 cores are shared with other sessions: every
trial records the CPU seconds other processes used meanwhile (/proc; dpo.py OthersCpu) and the load average, and
before each trial the run waits (up to --quiet-wait s) until they use < 0.2 cores.

The job (both modes, both tools): prompts = tests/multirank/test_grpo.py write_prompts (short word prompts of
tests/support/make_pref_data.py, 64 rows), the reward tests/support/grpo_rewards.py known_words (the share of a
completion's tokens that are words of the tiny word-level tokenizer: a random-init model samples them ~10% of the
time), num_generations 8, 4 prompts per optimizer step (global batch 32 completions; zerotrain --micro-batch 16 per
rank, TRL per_device_train_batch_size 32 / world), one generation per step (steps_per_generation 1,
num_iterations 1), temperature 1, top_p 1, top_k 0, beta 0 (no reference), loss dapo, epsilon 0.2, scale_rewards
group, AdamW (0.9/0.999, eps 1e-8, weight decay 0) at a constant LR, clip 1, fp32, seed --seed on both sides.
zerotrain: `python -m zerotrain train --task grpo --backend deepspeed --stage 3 --precision fp32 ...`;
TRL: benchmarks/peers/trl_grpo.py (GRPOConfig pinned to the same run; see its docstring).

--learn ("it learns as TRL does"): a random-init tiny Llama (tests/support/make_pref_data.py tiny_model("llama"):
2 layers x 64, vocab 1024, the word-level tokenizer), --steps optimizer steps, for each of --seeds: TRL's
GRPOTrainer in ONE process and zerotrain on 2 ranks (DeepSpeed ZeRO-3, --generation-gather phase), the same seed and
hyperparameters. Figures per run: the per-step reward (TRL: state.log_history "reward", via the peer's metrics.jsonl;
zerotrain: metrics.jsonl "reward"), the mean of its first 10 and of its last 10 steps. Targets (the issue's):
zerotrain's last-10 mean within 0.05 of TRL's, and >= 0.2 above its own first-10 mean; judged on the mean over seeds
(the seeds' own figures are listed too; the two tools draw different samples, so single seeds differ by sampling
noise: TRL alone spreads ~0.035 in the last-10 mean across seeds at lr 3e-3). The LR was tuned on the TRL side only
(1e-3 rose by 0.06 in 40 steps; 3e-3 by ~0.5; 1e-2 saturates at 1.0 by step 25) and then used for both.

--speed: a bigger random-init Llama (--layers x --hidden, 4 heads / 2 kv, ffn 2.6875 x hidden, vocab 1024, the same
word-level tokenizer) so that gathering weights costs something; --steps steps per trial of which the first --warmup
are not timed; every round runs each of --configs in turn (interleaved), --rounds rounds:
  zt-phase    zerotrain ZeRO-3, 2 ranks, --generation-gather phase (the weights gathered once per generation phase),
              --rollout-engine batched (the default: each rank's prompts of a step in one generate call, left-padded)
  zt-exact    the same with --rollout-engine exact (each prompt's G completions in a generate call of their own)
  zt-forward  the same with --generation-gather forward (ZeRO-3's gather per forward: once per generated token)
  zt-stage0   zerotrain --stage 0 (every rank holds the whole model: no gather at all), 2 ranks
  zt-whole    zt-phase with --chunked-loss 0: the policy loss on the whole logits (zt-phase runs grpo's default, the
              head in chunks of the vocabulary's auto size, recomputed in backward)
  trl-z3      TRL GRPOTrainer, 2 ranks under torchrun + DeepSpeed ZeRO-3 (the HF docs' ZeRO-3 block with "auto"
              values, ds3_gather_for_generation=True: TRL gathers the whole model once per generate call)
  trl-1p      (not in the default list) TRL GRPOTrainer in one process, no DeepSpeed.
Step time: each tool's own per-step wall time, max over ranks, generation included (zerotrain metrics.jsonl
step_time_s: from drawing the step's micro-batches, which is where a step's generation runs, to the end of the
optimizer step; TRL: peer's get_batch_samples .. on_step_end). Generation: when these figures were taken zerotrain's
step record carried rank 0's generate seconds only (generation_s; it now holds the slowest rank's whole phase), so its
ranks run through this script (`--zt-rank`), which wraps
zerotrain.train.grpo.OnlineRL._generate: after each call it reads the engine's GenerationStats of the phase
(engine.last_generation: generate seconds + the phase's gather seconds, generate calls, forwards) and the completion
tokens of the batches returned (their completion_mask), per rank; "rollout" is the whole wrapped call (the phase with
its gather and release, the rewards and their all-gather). TRL's time is inside GRPOTrainer._generate_single_turn
(transformers' generate in TRL's unwrap_model_for_generation, its ZeRO-3 gather included). Generation tokens/s =
completion tokens of the step, all ranks / the slowest rank's generation seconds. Per config: median over timed
steps per trial, then median [min-max] over rounds.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))

PY = sys.executable
WORLD = 2
REWARD = f"{REPO / 'tests' / 'support' / 'grpo_rewards.py'}:known_words"
PROMPTS = 64
JOB = {"num_generations": 8, "global_batch": 32, "temperature": 1.0, "beta": 0.0, "loss_type": "dapo",
       "scale_rewards": "group"}
"""The hyperparameters both tools get (the rest: --steps, --lr, --seed, --max-completion-len)."""
SPEED_CONFIGS = {
    "zt-phase": "zerotrain ZeRO-3, --generation-gather phase (gather once per generation), --rollout-engine batched",
    "zt-exact": "zerotrain ZeRO-3, --generation-gather phase, --rollout-engine exact (one prompt per generate call)",
    "zt-forward": "zerotrain ZeRO-3, --generation-gather forward (gather per forward = per token)",
    "zt-stage0": "zerotrain stage 0 (unsharded model, no gather)",
    "zt-whole": "zerotrain ZeRO-3 as zt-phase with --chunked-loss 0 (the policy loss on the whole logits)",
    "trl-z3": "TRL GRPOTrainer + DeepSpeed ZeRO-3 (ds3_gather_for_generation)",
    "trl-1p": "TRL GRPOTrainer, one process, no DeepSpeed",
}


# ---------------------------------------------------------------- zerotrain's ranks, timed
def zt_rank(side: str, argv: list[str]) -> int:
    """The entry torchrun starts for a zerotrain trial: zerotrain's CLI with OnlineRL._generate timed.

    Each call appends {"s", "tokens"} (this rank's seconds and completion tokens) to <side>/gen_rank<R>.jsonl."""
    import time as _t

    from zerotrain.train import grpo as zt_grpo

    rank = int(os.environ.get("RANK", "0"))
    out = Path(side) / f"gen_rank{rank}.jsonl"
    inner = zt_grpo.OnlineRL._generate

    def timed(self, epoch, generation):
        t0 = _t.perf_counter()
        gen = inner(self, epoch, generation)
        s = _t.perf_counter() - t0
        tokens = sum(int(b["completion_mask"].sum()) for micro in gen.steps for b in micro)
        rec = {"epoch": epoch, "generation": generation, "s": s, "tokens": tokens}
        stats = getattr(self.engine, "last_generation", None)  # the engine's own GenerationStats, where it has them
        if stats is not None:
            rec["engine"] = {k: getattr(stats, k) for k in ("gather", "sharded", "lockstep", "gathers", "calls",
                                                            "forwards", "tokens", "seconds", "gather_seconds")
                             if hasattr(stats, k)}
        with open(out, "a") as f:
            f.write(json.dumps(rec) + "\n")
        return gen

    zt_grpo.OnlineRL._generate = timed
    from zerotrain.cli import main

    sys.argv = ["zerotrain", *argv]
    return main()


# ---------------------------------------------------------------- model, data, launches
def env() -> dict:
    from launching import trial_env

    return trial_env(REPO, TRL_EXPERIMENTAL_SILENCE="1")


def learn_model(workdir: Path) -> Path:
    out = workdir / "llama-tiny"
    if not (out / "tokenizer.json").is_file():
        from tests.support.make_pref_data import tiny_model

        tmp = workdir / "llama-tiny.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tiny_model("llama", tmp)
        tmp.rename(out)
    return out


def speed_model(workdir: Path, layers: int, hidden: int) -> tuple[Path, dict]:
    from transformers import LlamaConfig, LlamaForCausalLM

    from launching import save_model_dir
    from tests.support.families import VOCAB
    from tests.support.make_pref_data import tiny_tokenizer

    shape = dict(num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=round(hidden * 2.6875 / 8) * 8, vocab_size=VOCAB, max_position_embeddings=256,
                 tie_word_embeddings=False)
    out = workdir / f"llama-l{layers}-h{hidden}"
    if not (out / "tokenizer.json").is_file():
        save_model_dir(out, LlamaForCausalLM, LlamaConfig(**shape, bos_token_id=0, eos_token_id=0),
                       tiny_tokenizer(add_bos=True))
    return out, shape


def prompts(workdir: Path) -> Path:
    out = workdir / f"prompts-{PROMPTS}.jsonl"
    if not out.is_file():
        from tests.multirank.test_grpo import write_prompts

        write_prompts(out.with_suffix(".tmp"), PROMPTS)
        out.with_suffix(".tmp").rename(out)
    return out


ZT_TRIALS = {"zt-phase": (3, "phase", "batched"), "zt-exact": (3, "phase", "exact"),
             "zt-forward": (3, "forward", "batched"), "zt-stage0": (0, "phase", "batched"),
             "zt-whole": (3, "phase", "batched", "--chunked-loss", "0")}
"""A zerotrain config's --stage, --generation-gather and --rollout-engine, then any flags of its own."""


def torchrun() -> list[str]:
    from launching import free_port

    return [PY, "-m", "torch.distributed.run", f"--nproc_per_node={WORLD}", "--nnodes=1", "--master_addr=127.0.0.1",
            f"--master_port={free_port()}"]


def zt_cmd(model: Path, data: Path, out: Path, side: Path, steps: int, lr: float, seed: int, max_len: int,
           stage: int, gather: str, engine: str = "batched") -> list[str]:
    return [*torchrun(), str(HERE / "grpo.py"), "--zt-rank", str(side),
            "train", "--task", "grpo", "--model", str(model), "--data", str(data), "--reward-funcs", REWARD,
            "--num-generations", str(JOB["num_generations"]), "--max-completion-len", str(max_len),
            "--global-batch", str(JOB["global_batch"]), "--micro-batch", str(JOB["global_batch"] // WORLD),
            "--temperature", str(JOB["temperature"]), "--top-p", "1.0", "--top-k", "0", "--beta", str(JOB["beta"]),
            "--loss-type", JOB["loss_type"], "--scale-rewards", JOB["scale_rewards"], "--generation-gather", gather,
            "--rollout-engine", engine,
            "--backend", "deepspeed", "--stage", str(stage), "--precision", "fp32", "--lr", str(lr),
            "--schedule", "constant", "--clip", "1.0", "--weight-decay", "0", "--seed", str(seed),
            "--max-steps", str(steps), "--save-every", "0", "--no-save-final", "--log-every", "1",
            "--output", str(out), "--overwrite"]


def trl_cmd(model: Path, data: Path, out: Path, steps: int, lr: float, seed: int, max_len: int,
            zero3: bool) -> list[str]:
    job = {"model_dir": str(model), "data": str(data), "reward": REWARD, "steps": steps, "lr": lr, "seed": seed,
           "max_completion_len": max_len, "out": str(out), "zero3": zero3, **JOB}
    head = torchrun() if zero3 else [PY]
    return [*head, str(HERE / "peers" / "trl_grpo.py"), json.dumps(job)]


def loadavg() -> list[float]:
    try:
        return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]
    except OSError:
        return []


def run_trial(name: str, cmd: list[str], tdir: Path, timeout: float, quiet_wait: float) -> dict:
    """One launch; its metrics (steps with a step time), timing side files and machine load."""
    from dpo import OthersCpu, wait_for_quiet
    from launching import first_error, launch, step_records

    shutil.rmtree(tdir, ignore_errors=True)
    (tdir / "gen").mkdir(parents=True)
    r: dict = {"config": name, **wait_for_quiet(quiet_wait), "loadavg_before": loadavg()}
    others = OthersCpu()
    r.update(launch(cmd, tdir / "log.txt", timeout, env(), REPO, others.sample))
    o = others.sample()
    r.update(others_cpu_s=round(o, 1), others_cores=round(o / r["wall_s"], 2) if r["wall_s"] > 0 else None,
             loadavg_after=loadavg())
    recs = step_records(tdir / "run" / "metrics.jsonl")
    r["records"] = recs
    r["status"] = "ok" if r["rc"] == 0 and recs else ("timeout" if r["killed"] else "failed")
    if r["status"] != "ok":
        lines = (tdir / "log.txt").read_text(errors="replace").splitlines()
        r["error"] = first_error(lines) or "\n".join(lines[-5:])
    # zerotrain's timed generations, per rank, in call order (one per optimizer step here)
    gens = {}
    for f in sorted((tdir / "gen").glob("gen_rank*.jsonl")):
        gens[f.stem] = [json.loads(x) for x in f.read_text().splitlines() if x.strip()]
    if gens:
        per_rank = list(gens.values())
        n = min(len(g) for g in per_rank)
        r["rollout_s"] = [max(g[k]["s"] for g in per_rank) for k in range(n)]
        r["gen_tokens"] = [sum(g[k]["tokens"] for g in per_rank) for k in range(n)]
        if all("engine" in g[k] for g in per_rank for k in range(n)):
            r["gen_s"] = [max(g[k]["engine"]["seconds"] + g[k]["engine"].get("gather_seconds", 0.0)
                              for g in per_rank) for k in range(n)]
            r["gather_s"] = [max(g[k]["engine"].get("gather_seconds", 0.0) for g in per_rank) for k in range(n)]
            r["generate_calls"] = [sum(g[k]["engine"]["calls"] for g in per_rank) for k in range(n)]
        else:  # no engine figures: the whole wrapped call
            r["gen_s"] = list(r["rollout_s"])
        r["gen_per_rank"] = gens
    elif recs and "gen_s" in recs[0]:
        r["gen_s"] = [x["gen_s"] for x in recs]
        r["gen_tokens"] = [x["gen_tokens"] for x in recs]
    print(f"  {name:12s} {r['status']:7s} wall {r['wall_s']} s, others {r['others_cores']} cores, load "
          f"{r['loadavg_after']} {(r.get('error') or '').splitlines()[0][:200] if r.get('error') else ''}",
          flush=True)
    return r


def _mean(xs: list[float]) -> float | None:
    return statistics.fmean(xs) if xs else None


def _spread(xs: list[float]) -> dict | None:
    xs = [x for x in xs if x is not None]
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)} if xs else None


def _fmt(s: dict | None, nd: int = 3) -> str:
    return f"{s['median']:.{nd}f} [{s['min']:.{nd}f}-{s['max']:.{nd}f}]" if s else "-"


# ---------------------------------------------------------------- --learn
def learn_summary(res: dict) -> None:
    runs = {"zt": [], "trl": []}
    for t in res["trials"]:
        rewards = [x.get("reward") for x in t["records"]]
        t["reward"] = rewards
        if t["status"] == "ok" and len(rewards) == res["steps"] and None not in rewards:
            t["first10"], t["last10"] = _mean(rewards[:10]), _mean(rewards[-10:])
            runs[t["tool"]].append(t)
        else:
            t["first10"] = t["last10"] = None
    seeds = sorted(set(t["seed"] for t in runs["zt"]) & set(t["seed"] for t in runs["trl"]))
    by = {(t["tool"], t["seed"]): t for v in runs.values() for t in v}
    per_seed = []
    for s in seeds:
        z, p = by[("zt", s)], by[("trl", s)]
        per_seed.append({"seed": s, "zt_first10": z["first10"], "zt_last10": z["last10"], "trl_first10": p["first10"],
                         "trl_last10": p["last10"], "last10_diff": z["last10"] - p["last10"],
                         "zt_rise": z["last10"] - z["first10"], "trl_rise": p["last10"] - p["first10"],
                         "within_0.05": abs(z["last10"] - p["last10"]) <= 0.05,
                         "zt_rise_ge_0.2": z["last10"] - z["first10"] >= 0.2})
    summ: dict = {"seeds_compared": seeds, "per_seed": per_seed}
    if seeds:
        mean_curve = {tool: [statistics.fmean(by[(tool, s)]["reward"][k] for s in seeds) for k in range(res["steps"])]
                      for tool in ("zt", "trl")}
        zf, zl = _mean(mean_curve["zt"][:10]), _mean(mean_curve["zt"][-10:])
        tf, tl = _mean(mean_curve["trl"][:10]), _mean(mean_curve["trl"][-10:])
        summ.update(mean_curve=mean_curve, zt_first10=zf, zt_last10=zl, trl_first10=tf, trl_last10=tl,
                    last10_diff=zl - tl, zt_rise=zl - zf, trl_rise=tl - tf,
                    target_within_0_05=abs(zl - tl) <= 0.05, target_rise_ge_0_2=(zl - zf) >= 0.2)
    res["summary"] = summ


def learn_plot(res: dict, png: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(7, 4))
    colours = {"zt": "tab:blue", "trl": "tab:orange"}
    label = {"zt": "zerotrain (2 ranks, ZeRO-3)", "trl": "TRL GRPOTrainer (1 process)"}
    for t in res["trials"]:
        if t.get("first10") is not None:
            ax.plot(range(1, len(t["reward"]) + 1), t["reward"], color=colours[t["tool"]], alpha=0.25, lw=1)
    mc = res["summary"].get("mean_curve", {})
    for tool, ys in mc.items():
        ax.plot(range(1, len(ys) + 1), ys, color=colours[tool], lw=2.2, label=f"{label[tool]}, mean of seeds")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("reward (known_words, batch mean)")
    ax.set_title(f"GRPO, tiny random-init Llama, lr {res['lr']:g}, seeds {res['summary'].get('seeds_compared')}")
    ax.grid(alpha=0.3)
    if mc:
        ax.legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(png, dpi=90)
    plt.close(fig)
    return True


def learn_markdown(res: dict) -> str:
    S, m = res["summary"], res["machine"]
    from launching import run_span, software

    v = m["versions"]
    lines = ["# GRPO learns as TRL's GRPOTrainer does (tiny random-init Llama, known_words reward)", "",
             f"Machine: {m['cpu']}, {m['cores']} cores shared with other sessions (load average during the run "
             f"{res['load_range'][0]:.2f}-{res['load_range'][1]:.2f}), no GPU. "
             f"{software(v, 'torch', 'deepspeed', 'transformers', 'trl')}. {run_span(res)}. "
             f"zerotrain from commit {res['source']['head'][:10]}.",
             f"Job: {res['steps']} steps, lr {res['lr']:g} constant AdamW, G {JOB['num_generations']}, "
             f"{JOB['global_batch'] // JOB['num_generations']} prompts per step (global batch {JOB['global_batch']} "
             f"completions), max completion {res['max_completion_len']}, temperature 1, beta 0, loss dapo, scale "
             "group, fp32. zerotrain: 2 ranks, DeepSpeed ZeRO-3; TRL: one process.", ""]
    if S.get("seeds_compared"):
        lines += ["| | zerotrain first 10 | zerotrain last 10 | TRL first 10 | TRL last 10 | last 10: zt - TRL | "
                  "zt rise |", "| --- | --- | --- | --- | --- | --- | --- |"]
        for p in S["per_seed"]:
            lines.append(f"| seed {p['seed']} | {p['zt_first10']:.4f} | {p['zt_last10']:.4f} | {p['trl_first10']:.4f} "
                         f"| {p['trl_last10']:.4f} | {p['last10_diff']:+.4f} | {p['zt_rise']:.4f} |")
        lines.append(f"| mean of seeds | {S['zt_first10']:.4f} | {S['zt_last10']:.4f} | {S['trl_first10']:.4f} | "
                     f"{S['trl_last10']:.4f} | {S['last10_diff']:+.4f} | {S['zt_rise']:.4f} |")
        ok = S["target_within_0_05"] and S["target_rise_ge_0_2"]
        lines += ["", f"Targets (on the mean of seeds): |last 10 zt - TRL| <= 0.05: {S['target_within_0_05']} "
                  f"({abs(S['last10_diff']):.4f}); zt last 10 - first 10 >= 0.2: {S['target_rise_ge_0_2']} "
                  f"({S['zt_rise']:.4f}). {'Both met.' if ok else 'NOT MET.'}", "",
                  "Mean reward over seeds, every 5th step:", "",
                  "| step | " + " | ".join(str(k) for k in range(1, res["steps"] + 1) if k == 1 or k % 5 == 0) + " |",
                  "| --- | " + " | ".join("---" for k in range(1, res["steps"] + 1) if k == 1 or k % 5 == 0) + " |"]
        for tool, name in (("zt", "zerotrain"), ("trl", "TRL")):
            ys = S["mean_curve"][tool]
            lines.append(f"| {name} | " + " | ".join(f"{ys[k - 1]:.3f}" for k in range(1, res["steps"] + 1)
                                                      if k == 1 or k % 5 == 0) + " |")
    bad = [t for t in res["trials"] if t["status"] != "ok"]
    if bad:
        lines += ["", "Failed trials:", ""] + [f"- {t['tool']} seed {t['seed']}: {t['status']}: "
                                              f"`{(t.get('error') or '').splitlines()[0][:300]}`" for t in bad]
    return "\n".join(lines) + "\n"


def learn(a: argparse.Namespace, res: dict, out: Path) -> None:
    workdir = Path(a.workdir)
    model, data = learn_model(workdir), prompts(workdir)
    seeds = [int(s) for s in a.seeds.split(",")]
    res.update(mode="learn", steps=a.steps, lr=a.lr, seeds=seeds, max_completion_len=a.max_completion_len,
               model_dir=str(model), data=str(data), job=JOB, reward=REWARD, trials=[])
    for seed in seeds:
        for tool in ("trl", "zt"):
            tdir = workdir / "learn" / f"s{seed}-{tool}"
            cmd = (zt_cmd(model, data, tdir / "run", tdir / "gen", a.steps, a.lr, seed, a.max_completion_len, 3,
                          "phase") if tool == "zt" else
                   trl_cmd(model, data, tdir / "run", a.steps, a.lr, seed, a.max_completion_len, zero3=False))
            t = run_trial(f"{tool} s{seed}", cmd, tdir, a.trial_timeout, 0.0)  # not timed: no wait
            t.update(tool=tool, seed=seed)
            res["trials"].append(t)
            save_learn(res, out)


def save(res: dict, out: Path) -> None:
    """The raw figures so far (the load range and wall seconds updated) to out, as every trial ends."""
    loads = [x for t in res["trials"] for x in (t.get("loadavg_before", [])[:1] + t.get("loadavg_after", [])[:1])]
    res["load_range"] = [min(loads), max(loads)] if loads else [0.0, 0.0]
    res["wall_s"] = round(time.time() - res["_t0"], 1) if "_t0" in res else res.get("wall_s", 0.0)
    out.write_text(json.dumps({k: v for k, v in res.items() if k != "_t0"}, indent=1))


def save_learn(res: dict, out: Path) -> None:
    learn_summary(res)
    save(res, out)
    png = out.with_suffix(".png")
    res["plot"] = png.name if learn_plot(res, png) else None
    out.with_suffix(".md").write_text(learn_markdown(res))


# ---------------------------------------------------------------- --speed
def speed_summary(res: dict) -> None:
    w = res["warmup"]
    for t in res["trials"]:
        recs = t["records"][w:]
        t["median_step_s"] = statistics.median(x["step_time_s"] for x in recs) if t["status"] == "ok" and recs \
            else None
        gs, gt = t.get("gen_s", [])[w:], t.get("gen_tokens", [])[w:]
        t["median_gen_s"] = statistics.median(gs) if gs and t["status"] == "ok" else None
        rs = t.get("rollout_s", [])[w:]
        t["median_rollout_s"] = statistics.median(rs) if rs and t["status"] == "ok" else None
        gg = t.get("gather_s", [])[w:]
        t["median_gather_s"] = statistics.median(gg) if gg and t["status"] == "ok" else None
        t["gen_tokens_per_s"] = sum(gt) / sum(gs) if gs and sum(gs) > 0 and t["status"] == "ok" else None
    summ = {}
    for name in res["configs"]:
        ts = [t for t in res["trials"] if t["config"] == name]
        summ[name] = {"median_step_s": _spread([t["median_step_s"] for t in ts]),
                      "median_gen_s": _spread([t["median_gen_s"] for t in ts]),
                      "median_rollout_s": _spread([t.get("median_rollout_s") for t in ts]),
                      "median_gather_s": _spread([t.get("median_gather_s") for t in ts]),
                      "gen_tokens_per_s": _spread([t["gen_tokens_per_s"] for t in ts]),
                      "others_cores": [t.get("others_cores") for t in ts],
                      "ok": sum(t["status"] == "ok" for t in ts), "failed": sum(t["status"] != "ok" for t in ts)}
    # paired within a round: step time / zt-phase's
    base = {t["round"]: t for t in res["trials"] if t["config"] == "zt-phase" and t["median_step_s"]}
    for name in res["configs"]:
        xs = [t["median_step_s"] / base[t["round"]]["median_step_s"] for t in res["trials"]
              if t["config"] == name and t["median_step_s"] and t["round"] in base]
        summ[name]["step_over_zt_phase"] = {**(_spread(xs) or {}), "per_round": [round(x, 3) for x in xs]}
        gs = [t["gen_tokens_per_s"] / base[t["round"]]["gen_tokens_per_s"] for t in res["trials"]
              if t["config"] == name and t["gen_tokens_per_s"] and t["round"] in base
              and base[t["round"]]["gen_tokens_per_s"]]
        summ[name]["gen_tps_over_zt_phase"] = {**(_spread(gs) or {}), "per_round": [round(x, 3) for x in gs]}
    res["summary"] = summ


def speed_markdown(res: dict) -> str:
    from launching import run_span, software

    S, m = res["summary"], res["machine"]
    v, sh = m["versions"], res["model_shape"]
    lines = ["# GRPO speed: generation under ZeRO-3 and step time, zerotrain vs TRL GRPOTrainer (2 CPU ranks)", "",
             f"Machine: {m['cpu']}, {m['cores']} cores shared with other sessions (load average during the run "
             f"{res['load_range'][0]:.2f}-{res['load_range'][1]:.2f}), no GPU. "
             f"{software(v, 'torch', 'deepspeed', 'transformers', 'trl')}. {run_span(res, rounds=True)}, "
             f"each running {', '.join(res['configs'])} in turn. zerotrain from commit {res['source']['head'][:10]}.",
             f"Model: random-init Llama {sh['num_hidden_layers']} layers x {sh['hidden_size']}, 4 heads / 2 kv, ffn "
             f"{sh['intermediate_size']}, vocab {sh['vocab_size']} ({res['params'] / 1e6:.2f} M parameters), fp32. "
             f"Job: G {res['job']['num_generations']}, global batch {res['job']['global_batch']} completions "
             f"({res['job']['global_batch'] // res['job']['num_generations'] // res['world']} prompts per rank), "
             "max completion "
             f"{res['max_completion_len']} tokens, {res['steps']} steps of which the first {res['warmup']} are not "
             "timed, lr 1e-3, beta 0, loss dapo.", "",
             "| config | median step time (s) | step time / zt-phase's (paired per round) | generation time per step (s) "
             "| generation tokens/s | generation tokens/s / zt-phase's (paired) | ok/failed |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for name in res["configs"]:
        s = S[name]
        lines.append(f"| {name}: {SPEED_CONFIGS[name]} | {_fmt(s['median_step_s'])} | "
                     f"{_fmt(s['step_over_zt_phase'] if 'median' in s['step_over_zt_phase'] else None, 2)} | "
                     f"{_fmt(s['median_gen_s'])} | {_fmt(s['gen_tokens_per_s'], 0)} | "
                     f"{_fmt(s['gen_tps_over_zt_phase'] if 'median' in s['gen_tps_over_zt_phase'] else None, 2)} | "
                     f"{s['ok']}/{s['failed']} |")
    lines += ["", "Median [min-max] over rounds of each trial's median over its timed steps (tokens/s: a trial's "
              "completion tokens / its generation seconds, slowest rank). Other processes' CPU use during each trial "
              "(cores): " + "; ".join(f"{n} {S[n]['others_cores']}" for n in res["configs"]) + ".", ""]
    zt = [n for n in res["configs"] if n.startswith("zt-") and S[n]["median_rollout_s"]]
    if zt:
        lines += ["zerotrain's whole rollout per step (OnlineRL._generate: the generation phase with its gather and "
                  "release, the rewards, their all-gather): " + "; ".join(
                      f"{n} {_fmt(S[n]['median_rollout_s'])} s" for n in zt) + "; of which the phase's whole-model "
                  "gather: " + "; ".join(f"{n} {_fmt(S[n]['median_gather_s'], 4)} s" for n in zt
                                         if S[n]["median_gather_s"] and S[n]["median_gather_s"]["max"] > 0) + ".", ""]
    lines += ["## What the figures cover", ""] + SPEED_NOTES
    bad = [t for t in res["trials"] if t["status"] != "ok"]
    if bad:
        lines += ["", "Failed trials:", ""] + [f"- round {t['round']} {t['config']}: {t['status']}: "
                                              f"`{(t.get('error') or '').splitlines()[0][:300]}`" for t in bad]
    return "\n".join(lines) + "\n"


SPEED_NOTES = [
    ("- Step time: each tool's own per-step wall time, max over ranks, generation included (zerotrain: "
     "metrics.jsonl step_time_s, from drawing the step's micro-batches, where the step's generation runs, to the end "
     "of the optimizer step; TRL: get_batch_samples .. on_step_end, benchmarks/peers/trl_grpo.py)."),
    ("- Generation time: zerotrain: the engine's GenerationStats of the phase (its generate calls' seconds + the "
     "phase's gather seconds), read per rank by the --zt-rank wrapper of OnlineRL._generate, slowest rank (the "
     "step record's own generation_s is rank 0's generate calls only); TRL: GRPOTrainer._generate_single_turn "
     "(unwrap_model_for_generation: gather + hooks removed + transformers' generate), slowest rank."),
    ("- Batching: zerotrain's default (zt-phase, --rollout-engine batched) and TRL generate all of a rank's rows of "
     "a step in one generate call, left-padded; zt-exact makes one call of G rows per prompt (unpadded: bitwise the "
     "same tokens on any layout). zerotrain samples every row with its own seeded generator (Gumbel-max), TRL with "
     "torch's global one."),
    ("- ZeRO-3 settings differ: zerotrain's own block (leaf decoder layers, its buckets and persistence threshold); "
     "TRL the HF docs' block with \"auto\" values (benchmarks/peers/harness.py zero3_config)."),
    ("- The 2 cores are shared with other sessions (see the load average and other processes' cores above): "
     "single figures move by tens of percent between rounds; compare the paired per-round ratios."),
]


def save_speed(res: dict, out: Path) -> None:
    speed_summary(res)
    save(res, out)
    out.with_suffix(".md").write_text(speed_markdown(res))


def speed(a: argparse.Namespace, res: dict, out: Path) -> None:
    workdir = Path(a.workdir)
    model, shape = speed_model(workdir, a.layers, a.hidden)
    data = prompts(workdir)
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        params = sum(x.numel() for x in AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model))
                     .parameters())
    configs = [c.strip() for c in a.configs.split(",") if c.strip()]
    res.update(mode="speed", steps=a.steps, warmup=a.warmup, rounds=a.rounds, lr=1e-3, seed=0,
               max_completion_len=a.max_completion_len, model_dir=str(model), model_shape=shape, params=params,
               data=str(data), job=JOB, reward=REWARD, configs=configs, trials=[])
    for rnd in range(a.rounds):
        for name in configs:
            tdir = workdir / "speed" / f"r{rnd}-{name}"
            if name.startswith("zt-"):
                stage, gather, engine, *extra = ZT_TRIALS[name]
                cmd = zt_cmd(model, data, tdir / "run", tdir / "gen", a.steps, 1e-3, 0, a.max_completion_len, stage,
                             gather, engine) + extra
            else:
                cmd = trl_cmd(model, data, tdir / "run", a.steps, 1e-3, 0, a.max_completion_len,
                              zero3=name == "trl-z3")
            t = run_trial(f"r{rnd} {name}", cmd, tdir, a.trial_timeout, a.quiet_wait)
            t.update(config=name, round=rnd)
            res["trials"].append(t)
            save_speed(res, out)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--zt-rank"]:
        return zt_rank(argv[1], argv[2:])
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--learn", action="store_true", help="the reward curves of both tools (grpo_learn.*)")
    mode.add_argument("--speed", action="store_true", help="generation and step time (grpo_speed.*)")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps per trial (learn 40, speed 8)")
    p.add_argument("--seeds", default="0,1,2", help="--learn: the seeds, each run by both tools")
    p.add_argument("--lr", type=float, default=3e-3, help="--learn: the constant LR of both tools")
    p.add_argument("--max-completion-len", type=int, default=None, help="learn 16, speed 32")
    for flag, default, text in (("--rounds", 4, "interleaved rounds"), ("--warmup", 2, "first steps left out of the figures"),
                                ("--layers", 4, "the model's layers"), ("--hidden", 256, "the model's hidden size")):
        p.add_argument(flag, type=int, default=default, help=f"--speed: {text}")
    p.add_argument("--global-batch", type=int, default=32,
                   help="completions per optimizer step, all ranks (G 8: 32 = 2 prompts per rank)")
    p.add_argument("--configs", default="zt-phase,zt-exact,zt-forward,zt-stage0,trl-z3",
                   help=f"--speed: comma list of {', '.join(SPEED_CONFIGS)} (zt-phase first: the ratios' base)")
    p.add_argument("--out-dir", default=str(HERE / "results"))
    p.add_argument("--tag", default="", help="suffix of the output names (grpo_learn<tag>.json)")
    p.add_argument("--workdir", default="/tmp/zt_grpo")
    p.add_argument("--trial-timeout", type=float, default=600.0)
    p.add_argument("--quiet-wait", type=float, default=20.0,
                   help="before each trial, wait up to this many seconds until other processes use < 0.2 cores")
    p.add_argument("--report", action="store_true", help="only rewrite the .md (and .png) from the JSON")
    a = p.parse_args(argv)
    out = Path(a.out_dir) / f"grpo_{'learn' if a.learn else 'speed'}{a.tag}.json"
    if a.report:
        res = json.loads(out.read_text())
        (save_learn if a.learn else save_speed)(res, out)
        print(out.with_suffix(".md").read_text())
        return 0
    JOB["global_batch"] = a.global_batch
    if a.steps is None:
        a.steps = 40 if a.learn else 8
    if a.max_completion_len is None:
        a.max_completion_len = 16 if a.learn else 32
    if a.speed:
        configs = [c.strip() for c in a.configs.split(",")]
        if configs[0] != "zt-phase" or any(c not in SPEED_CONFIGS for c in configs):
            p.error(f"--configs: zt-phase first, then any of {list(SPEED_CONFIGS)}")
        if a.steps <= a.warmup:
            p.error("--steps must be > --warmup")
    from launching import offline_workdir

    offline_workdir(a.workdir, REPO)
    out.parent.mkdir(parents=True, exist_ok=True)
    from dpo import machine, source_state

    res = {"date": time.strftime("%Y-%m-%d %H:%M"), "machine": machine(), "source": source_state(), "world": WORLD,
           "_t0": time.time()}
    (learn if a.learn else speed)(a, res, out)
    (save_learn if a.learn else save_speed)(res, out)
    print(out.with_suffix(".md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
