"""The one-call GPU benchmark: zerotrain vs the hand-written DeepSpeed loop vs HF Trainer on one GPU, then sizing.

    python benchmarks/gpu/drive.py --out $OUT --deadline 480            # on the GPU machine (run_all.sh)
    .venv/bin/python benchmarks/gpu/drive.py --out /tmp/g --quick        # CPU rehearsal: tiny Llama, gloo

What it does, in order, writing OUT/gpu_results.json and OUT/gpu_summary.md after every run (a timeout keeps
what was measured):
1. environment (torch, CUDA, GPU, DeepSpeed, transformers versions) and a bf16 8192^3 matmul rate;
2. JIT builds of DeepSpeed's fused_adam and cpu_adam started in the background (they overlap step 3);
3. a random-init Llama (TinyLlama-1.1B's shape unless --size) saved with save_pretrained + a JSON lines data
   file (benchmarks/gpu/build_model.py);
4. the runs of --plan, each `torchrun --nproc_per_node 1 benchmarks/gpu/runner.py` under its own timeout:
   zt = zerotrain train, ds = the hand-written DeepSpeed loop, hf = HF Trainer; 0/1/2/3 = ZeRO stage,
   3off = stage 3 with optimizer and parameters offloaded to CPU;
5. the sizing ladders of --size-plan (from scratch under zero.Init, 2 steps, micro-batch 1, seq --seq-len, gradient
   checkpointing): does this size train with ZeRO-3 on the GPU alone / with CPU offload; up a size after one
   trains, down after one runs out of memory.
Runs that would not finish before --deadline (seconds since start) are skipped and listed as skipped.

Figures per run: median wall time between consecutive optimizer-step ends (after a device sync) over the steps
after --warmup; tokens/s = micro-batch x grad-accum x seq / that; MFU = 6 x N x tokens/s / peak (N = all
parameters, embeddings and head included; attention's s^2 term not counted); zerotrain's own metrics.jsonl
step_time_s / tokens_per_s medians over the same steps.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(HERE))

H100_BF16_DENSE = 989.4e12  # NVIDIA H100 SXM datasheet, dense bf16 (H200: the same)
CONFIGS = {"0": (0, False), "1": (1, False), "2": (2, False), "3": (3, False), "3off": (3, True)}
RUNNERS = {"zt": "zerotrain", "ds": "ds_loop", "hf": "hf_trainer"}
T0 = time.time()


def elapsed() -> float:
    return time.time() - T0


def log(msg: str) -> None:
    print(f"[{elapsed():6.1f}s] {msg}", flush=True)


def env_vars(quick: bool) -> dict:
    e = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
             PYTHONUNBUFFERED="1", TRANSFORMERS_VERBOSITY="error", PYTHONWARNINGS="ignore")
    e["OMP_NUM_THREADS"] = "1" if quick else str(os.cpu_count() or 8)
    e["PYTHONPATH"] = os.pathsep.join([str(REPO), e.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return e


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def environment() -> dict:
    import importlib.metadata as md

    import torch

    out = {"python": sys.version.split()[0], "torch": torch.__version__, "torch_cuda": torch.version.cuda,
           "cpus": os.cpu_count()}
    for p in ("deepspeed", "transformers", "accelerate", "datasets", "pydantic", "peft"):
        try:
            out[p] = md.version(p)
        except md.PackageNotFoundError:
            out[p] = None
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        out.update(gpu=p.name, gpu_mem_gib=round(p.total_memory / 2**30, 1), sms=p.multi_processor_count,
                   capability=f"{p.major}.{p.minor}")
        try:
            out["nvidia_smi"] = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm",
                                                "--format=csv,noheader"], capture_output=True, text=True,
                                               timeout=20).stdout.strip()
        except (OSError, subprocess.SubprocessError) as e:
            out["nvidia_smi"] = repr(e)
        try:
            out["nvcc"] = subprocess.run(["nvcc", "--version"], capture_output=True, text=True,
                                         timeout=20).stdout.strip().splitlines()[-1]
        except (OSError, subprocess.SubprocessError, IndexError) as e:
            out["nvcc"] = repr(e)
    return out


def matmul_rate() -> float | None:
    """bf16 8192^3 matmul TFLOP/s on random data (median of 10 after 3 warm-ups), or None without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return None
    n = 8192
    a, b = (torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    times = []
    for i in range(13):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        a @ b
        e.record()
        torch.cuda.synchronize()
        if i >= 3:
            times.append(s.elapsed_time(e) / 1e3)
    del a, b
    torch.cuda.empty_cache()
    return 2 * n**3 / statistics.median(times) / 1e12


def start_jit_builds(env: dict, logf: Path) -> list[subprocess.Popen]:
    """fused_adam (GPU AdamW, what DeepSpeed steps with on a GPU) and cpu_adam (offload) built in the background."""
    import torch

    if not torch.cuda.is_available():
        return []
    procs = []
    for builder in ("FusedAdamBuilder", "CPUAdamBuilder"):
        code = (f"import time; t=time.time(); from deepspeed.ops.op_builder import {builder}; {builder}().load(); "
                f"print('JIT {builder} built in', round(time.time()-t, 1), 's', flush=True)")
        fh = open(logf, "a")
        procs.append(subprocess.Popen([sys.executable, "-c", code], env=env, stdout=fh, stderr=subprocess.STDOUT,
                                      cwd=REPO))
    return procs


def launch(job: dict, result: Path, env: dict, timeout: float, runlog: Path) -> tuple[int, str, float]:
    """torchrun in its own process group; on timeout the whole group (torchrun and its worker) is killed."""
    import signal

    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=1", "--nnodes=1",
           "--master_addr=127.0.0.1", f"--master_port={free_port()}", str(HERE / "runner.py"), json.dumps(job),
           str(result)]
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         start_new_session=True)
    try:
        text, _ = p.communicate(timeout=timeout)
        rc = p.returncode
    except subprocess.TimeoutExpired:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except OSError:
            pass
        text, _ = p.communicate()
        rc = -9
    wall = time.perf_counter() - t0
    with open(runlog, "a") as f:
        f.write(f"\n===== {job['name']} rc={rc} wall={wall:.1f}s\n{(text or '')[-20000:]}\n")
    return rc, text or "", wall


def figures(job: dict, result: Path, params: int, peak: float, measured_peak: float | None) -> dict:
    r = json.loads(result.read_text())
    ends = r["step_ends"]
    d = [b - a for a, b in zip(ends, ends[1:])]  # d[i] is the duration of step i+2
    timed = d[job["warmup"] - 1:]
    out: dict = {"steps_recorded": len(ends), "peak_gpu_gib": round(r["peak_gpu_bytes"] / 2**30, 2),
                 "peak_rss_gib": round(r["peak_rss_bytes"] / 2**30, 2), "last_loss": r.get("last_loss")}
    if not timed:
        return out
    tokens = job["micro_batch"] * job["grad_accum"] * job["seq_len"]
    step_s = statistics.median(timed)
    tps = tokens / step_s
    out.update(step_s=round(step_s, 4), step_s_min=round(min(timed), 4), step_s_max=round(max(timed), 4),
               timed_steps=len(timed), tokens_per_step=tokens, tokens_per_s=round(tps, 1),
               mfu=round(6 * params * tps / peak, 4))
    if measured_peak:
        out["mfu_vs_measured_matmul"] = round(6 * params * tps / (measured_peak * 1e12), 4)
    if job["runner"] == "zerotrain":
        metrics = Path(str(result) + ".run") / "metrics.jsonl"
        if metrics.is_file():
            recs = [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()]
            recs = [x for x in recs if "step_time_s" in x and x["step"] > job["warmup"]]
            if recs:
                out["zt_metrics_step_s"] = round(statistics.median(x["step_time_s"] for x in recs), 4)
                out["zt_metrics_tokens_per_s"] = round(statistics.median(x["tokens_per_s"] for x in recs), 1)
                out["zt_metrics_mfu"] = round(6 * params * out["zt_metrics_tokens_per_s"] / peak, 4)
                out["zt_metrics_losses"] = [round(x["loss"], 4) for x in recs]
                if "peak_gpu_mem_bytes" in recs[-1]:
                    out["zt_metrics_peak_gpu_gib"] = round(recs[-1]["peak_gpu_mem_bytes"] / 2**30, 2)
        if r.get("summary"):
            out["zt_summary_tokens_per_s"] = round(r["summary"].get("tokens_per_s", 0.0), 1)
    return out


def error_line(text: str) -> str:
    lines = [x for x in text.strip().splitlines() if x.strip()]
    keys = [x for x in lines if any(k in x for k in ("Error", "error:", "Traceback", "Killed", "OOM", "out of memory"))]
    pick = keys[-3:] if keys else lines[-3:]
    return " | ".join(x.strip()[:300] for x in pick)


def summary_md(state: dict) -> str:
    e = state["env"]
    lines = [f"# GPU benchmark ({e.get('gpu', 'CPU')})", "",
             f"torch {e.get('torch')} (CUDA {e.get('torch_cuda')}), deepspeed {e.get('deepspeed')}, transformers "
             f"{e.get('transformers')}, accelerate {e.get('accelerate')}, datasets {e.get('datasets')}, "
             f"python {e.get('python')}; {e.get('nvidia_smi', '')}; nvcc: {e.get('nvcc', '')}",
             f"bf16 8192^3 matmul: {state.get('matmul_tflops')} TFLOP/s; MFU peak used: {state['peak'] / 1e12:.1f} "
             f"TFLOP/s (H100 SXM dense bf16 datasheet)", "",
             f"Model: {state.get('model', {})}", f"Job: {state.get('job_shape')}", "",
             "| run | step s (median [min-max]) | tokens/s | MFU | zerotrain metrics.jsonl tokens/s | peak GPU GiB | "
             "last loss | status |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in state["runs"]:
        f = r.get("fig", {})
        st = "ok" if r["ok"] else (r.get("status") or f"rc {r.get('rc')}: {r.get('error', '')[:200]}")
        step = f"{f['step_s']:.3f} [{f['step_s_min']:.3f}-{f['step_s_max']:.3f}]" if "step_s" in f else "-"
        lines.append(f"| {r['name']} | {step} | {f.get('tokens_per_s', '-')} | {f.get('mfu', '-')} | "
                     f"{f.get('zt_metrics_tokens_per_s', '-')} | {f.get('peak_gpu_gib', '-')} | "
                     f"{f.get('last_loss', '-')} | {st} |")
    ratios = []
    by = {r["name"]: r.get("fig", {}).get("tokens_per_s") for r in state["runs"] if r["ok"]}
    for c in CONFIGS:
        zt = by.get(f"zt{c}")
        for p in ("ds", "hf"):
            if zt and by.get(f"{p}{c}"):
                ratios.append(f"| {c} | zerotrain / {RUNNERS[p]} | {zt / by[f'{p}{c}']:.3f} |")
    if ratios:
        lines += ["", "| stage | ratio (tokens/s) | value |", "| --- | --- | --- |", *ratios]
    if state.get("sizing"):
        lines += ["", "| sizing run | params | result | step s | peak GPU GiB | peak RSS GiB | wall s |",
                  "| --- | --- | --- | --- | --- | --- | --- |"]
        for s in state["sizing"]:
            f = s.get("fig", {})
            lines.append(f"| {s['name']} | {s.get('params', 0) / 1e9:.2f}B | "
                         f"{'trained' if s['ok'] else s.get('status') or ('failed: ' + s.get('error', '')[:200])} | "
                         f"{f.get('step_s', '-')} | {f.get('peak_gpu_gib', '-')} | {f.get('peak_rss_gib', '-')} | "
                         f"{s.get('wall_s', 0):.0f} |")
    if state.get("sizing_boundary"):
        lines += ["", f"Sizing boundary (ZeRO-3 '3' on the GPU alone, '3off' with CPU offload): {state['sizing_boundary']}"]
    jit = state.get("jit")
    if jit:
        lines += ["", f"JIT builds: {jit}"]
    lines += ["", f"Total driver time {elapsed():.0f} s."]
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--deadline", type=float, default=480, help="seconds from start; later runs are skipped")
    ap.add_argument("--quick", action="store_true", help="CPU rehearsal: tiny model, seq 64, 4 steps")
    ap.add_argument("--size", default="1b")
    ap.add_argument("--plan", default="zt3,zt2,zt0,zt1,ds3,hf3,zt3off,ds2,hf2")
    ap.add_argument("--size-plan", default="3=3b,4b,5b@4b;3off=5b@5b",
                    help="KIND=SIZE,SIZE,...@START;... sizing ladders (from scratch, 2 steps); empty for none")
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--grad-accum", type=int, default=2)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--run-timeout", type=float, default=150)
    ap.add_argument("--size-timeout", type=float, default=150)
    ap.add_argument("--work", default="/tmp/ztgpu")
    ap.add_argument("--torch-adam", action="store_true", help="every runner steps with torch AdamW (no fused_adam)")
    args = ap.parse_args()
    import torch

    quick = args.quick
    if quick:
        args.size, args.seq_len, args.micro_batch, args.grad_accum, args.steps, args.warmup = "tiny", 64, 2, 2, 5, 2
        args.size_plan = args.size_plan if args.size_plan != ap.get_default("size_plan") else "3=tiny@tiny;3off=tiny@tiny"
    out, work = Path(args.out), Path(args.work)
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    env = env_vars(quick)
    precision = "bf16" if torch.cuda.is_available() else ("bf16" if torch.ops.mkldnn._is_mkldnn_bf16_supported()
                                                          else "fp32")
    state: dict = {"env": environment(), "peak": H100_BF16_DENSE, "runs": [], "sizing": [], "precision": precision,
                   "started": time.strftime("%Y-%m-%d %H:%M:%S")}
    res_json, res_md, runlog, jitlog = (out / "gpu_results.json", out / "gpu_summary.md", out / "runs_log.txt",
                                        out / "jit_log.txt")

    def save() -> None:
        res_json.write_text(json.dumps(state, indent=1, default=str))
        res_md.write_text(summary_md(state))

    log(f"environment: {json.dumps(state['env'])}")
    save()
    jit = start_jit_builds(env, jitlog)
    state["matmul_tflops"] = round(matmul_rate(), 1) if torch.cuda.is_available() else None
    log(f"bf16 matmul: {state['matmul_tflops']} TFLOP/s")

    mdir, data = work / f"llama-{args.size}", work / "data.jsonl"
    t = time.perf_counter()
    p = subprocess.run([sys.executable, str(HERE / "build_model.py"), "--out", str(mdir), "--data", str(data),
                        "--size", args.size], env=env, cwd=REPO, capture_output=True, text=True, timeout=300)
    if p.returncode != 0:
        log("model build failed:\n" + p.stdout[-3000:] + p.stderr[-3000:])
        state["model_build_error"] = error_line(p.stderr)
        save()
        return 1
    state["model"] = json.loads(p.stdout.strip().splitlines()[-1])
    params = state["model"]["params"]
    state["job_shape"] = {"seq_len": args.seq_len, "micro_batch": args.micro_batch, "grad_accum": args.grad_accum,
                          "world": 1, "steps": args.steps, "warmup_excluded": args.warmup, "precision": precision,
                          "tokens_per_step": args.seq_len * args.micro_batch * args.grad_accum}
    log(f"model built in {time.perf_counter() - t:.0f} s: {state['model']}")
    save()

    if jit:  # the first run steps with fused_adam: wait for its build (a run would wait on its lock anyway)
        t = time.perf_counter()
        try:
            rc = jit[0].wait(timeout=max(30.0, min(180.0, args.deadline - elapsed() - 120)))
        except subprocess.TimeoutExpired:
            rc = None
            jit[0].kill()  # no runner will load it (torch_adam below)
        state["fused_adam_build"] = {"rc": rc, "waited_s": round(time.perf_counter() - t, 1)}
        log(f"fused_adam JIT build: rc {rc} (waited {time.perf_counter() - t:.0f} s)")
        if rc != 0:
            state["torch_adam_fallback"] = True
            log("fused_adam did not build: every runner steps with torch AdamW (torch_adam) instead")
    base = {"model": str(mdir), "data": str(data), "seq_len": args.seq_len, "micro_batch": args.micro_batch,
            "grad_accum": args.grad_accum, "steps": args.steps, "warmup": args.warmup, "precision": precision,
            "torch_adam": bool(state.get("torch_adam_fallback") or args.torch_adam)}
    for name in [x for x in args.plan.split(",") if x]:
        runner, cfg = RUNNERS[name[:2]], name[2:]
        stage, offload = CONFIGS[cfg]
        left = args.deadline - elapsed()
        rec: dict = {"name": name, "runner": runner, "stage": stage, "offload": offload, "ok": False}
        need = 45 if not offload else 75
        if left < need:
            rec["status"] = f"skipped: {left:.0f} s left of the deadline"
            state["runs"].append(rec)
            log(f"{name}: {rec['status']}")
            save()
            continue
        job = {**base, "name": name, "runner": runner, "stage": stage, "offload": offload}
        if offload:  # CPU Adam steps take seconds: fewer steps
            job.update(steps=min(args.steps, 10), warmup=min(args.warmup, 3))
        result = work / f"{name}.json"
        log(f"{name}: start (timeout {min(args.run_timeout, left):.0f} s)")
        rc, text, wall = launch(job, result, env, min(args.run_timeout, left), runlog)
        rec.update(rc=rc, wall_s=round(wall, 1))
        if result.is_file():
            try:
                rec["fig"] = figures(job, result, params, state["peak"], state["matmul_tflops"])
                rec["ok"] = "step_s" in rec["fig"]
            except (OSError, ValueError, KeyError) as e:
                rec["error"] = f"figures: {e!r}"
        if rc != 0 or not rec["ok"]:
            rec["error"] = (rec.get("error", "") + " " + error_line(text)).strip()
            if rc == -9:
                rec["status"] = f"timed out after {wall:.0f} s"
        state["runs"].append(rec)
        f = rec.get("fig", {})
        log(f"{name}: rc {rc}, {wall:.0f} s wall, {f.get('tokens_per_s')} tokens/s, MFU {f.get('mfu')}, "
            f"peak GPU {f.get('peak_gpu_gib')} GiB" + (f"  ERROR {rec.get('error', '')[:400]}" if not rec["ok"] else ""))
        save()

    # Sizing: ZeRO-3 on the GPU alone / with CPU offload, from scratch, 2 steps: a ladder of sizes per kind, starting
    # at its @size, up after a size trains, down after one fails, until the boundary is found (or time runs out).
    from build_model import count_params, llama_config

    ladders: dict[str, list[str]] = {}
    pos: dict[str, int] = {}
    for part in [x for x in args.size_plan.split(";") if x]:
        kind, rest = part.split("=")
        sizes, start = rest.split("@")
        ladders[kind] = sizes.split(",")
        pos[kind] = ladders[kind].index(start)
    ok_at: dict[str, int] = {k: -1 for k in ladders}
    fail_at: dict[str, int] = {k: len(v) for k, v in ladders.items()}
    while any(pos[k] is not None for k in ladders):
        for kind in list(ladders):
            i = pos[kind]
            if i is None:
                continue
            size = ladders[kind][i]
            stage, offload = CONFIGS[kind]
            name = f"size-{size}-{'zero3_offload' if offload else 'zero3'}"
            left = args.deadline - elapsed()
            n = count_params(llama_config(size, 0))
            rec = {"name": name, "size": size, "params": n, "offload": offload, "ok": False}
            need = 60 + (n / 1e9) * (12 if offload else 6)
            if not quick and left < need:
                rec["status"] = f"skipped: {left:.0f} s left, needs ~{need:.0f}"
                state["sizing"].append(rec)
                log(f"{name}: {rec['status']}")
                save()
                pos[kind] = None
                continue
            cdir = work / f"cfg-{size}"
            cdir.mkdir(exist_ok=True)
            llama_config(size, json.loads((mdir / "config.json").read_text()).get("eos_token_id", 0)).save_pretrained(cdir)
            job = {**base, "name": name, "runner": "zerotrain", "stage": stage, "offload": offload,
                   "model_config": str(cdir / "config.json"), "micro_batch": 1, "grad_accum": 1, "steps": 2,
                   "warmup": 1, "grad_ckpt": True}
            result = work / f"{name}.json"
            tmo = min(args.size_timeout, left)
            log(f"{name} ({n / 1e9:.2f}B): start (timeout {tmo:.0f} s)")
            rc, text, wall = launch(job, result, env, tmo, runlog)
            rec.update(rc=rc, wall_s=round(wall, 1))
            if result.is_file():
                try:
                    rec["fig"] = figures(job, result, n, state["peak"], state["matmul_tflops"])
                    rec["ok"] = rec["fig"].get("steps_recorded", 0) >= 2
                except (OSError, ValueError, KeyError) as e:
                    rec["error"] = f"figures: {e!r}"
            if not rec["ok"]:
                rec["error"] = (rec.get("error", "") + " " + error_line(text)).strip()
                rec["oom"] = "out of memory" in text.lower() or "OutOfMemory" in text
                if rc == -9:
                    rec["status"] = f"timed out after {wall:.0f} s"
            state["sizing"].append(rec)
            log(f"{name}: rc {rc}, {wall:.0f} s, ok={rec['ok']} {rec.get('fig', {})}"
                + (f"  ERROR {rec.get('error', '')[:400]}" if not rec["ok"] else ""))
            save()
            if rec["ok"]:
                ok_at[kind] = max(ok_at[kind], i)
                pos[kind] = i + 1 if i + 1 < fail_at[kind] else None
            elif rec.get("oom"):
                fail_at[kind] = min(fail_at[kind], i)
                pos[kind] = i - 1 if i - 1 > ok_at[kind] else None
            else:
                pos[kind] = None  # failed for another reason (or timed out): says nothing about size
    state["sizing_boundary"] = {k: {"largest_trained": ladders[k][ok_at[k]] if ok_at[k] >= 0 else None,
                                    "smallest_oom": ladders[k][fail_at[k]] if fail_at[k] < len(ladders[k]) else None}
                                for k in ladders}

    jit_lines = jitlog.read_text().splitlines() if jitlog.is_file() else []
    state["jit"] = [x for x in jit_lines if x.startswith("JIT ")] or jit_lines[-3:]
    for pr in jit:
        if pr.poll() is None:
            pr.kill()
    save()
    print(res_md.read_text(), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
