"""The GPU suite's driver: zerotrain ZeRO 0-3 (+ CPU offload, + compile, fused loss off) vs the hand-written
DeepSpeed loop vs HF Trainer on one device, then the largest model ZeRO-3 trains with and without CPU offload.

    bash benchmarks/gpu_suite.sh                                   # the one command (wheels, import check, this)
    python benchmarks/gpu/drive.py --out $OUT --deadline 500       # on a CUDA machine
    .venv/bin/python benchmarks/gpu/drive.py --out /tmp/g --cpu    # CPU mode: tiny Llama over gloo (CI)

What it does, in order, writing OUT/gpu_results.json and OUT/RESULTS_GPU.md after every step (a timeout or a kill
keeps what was measured):
1. environment, the device's dense bf16 peak (PEAKS) and a measured matmul rate; in the background: the JIT builds
   of DeepSpeed's fused_adam and cpu_adam (CUDA only) and `zerotrain train --help` (which flags this tree has);
2. a random-init Llama (TinyLlama-1.1B's shape; CPU mode: tiny) + a JSON lines data file (build_model.py), then in
   the background `zerotrain estimate` for every --sizes candidate;
3. the --plan, most important first, each entry one `benchmarks/gpu/runner.py` process under its own timeout:
   zt = zerotrain train, ds = the hand-written DeepSpeed loop, hf = HF Trainer, suffix = CONFIGS (ZeRO stage,
   offload, extra `zerotrain train` flags); size3 / size3off = the largest --sizes candidate the estimate says fits
   with ZeRO-3 on the device alone / with optimizer and parameters offloaded to CPU, confirmed by one from-scratch
   run (2 steps, micro-batch 1, gradient checkpointing), one size down if that run runs out of memory.
An entry that would not finish before --deadline (seconds since start) is listed as skipped, as is a configuration
whose `zerotrain train` flag this tree does not have yet.

Figures per run: median wall time between consecutive optimizer-step ends (after a device sync) over the steps
after --warmup; tokens/s = micro-batch x grad-accum x seq / that; MFU = FLOPS_RULE; peak GPU memory =
torch.cuda.max_memory_allocated() in the run; zerotrain's own metrics.jsonl step_time_s / tokens_per_s medians over
the same steps; the steps DeepSpeed skipped for non-finite gradients (its "OVERFLOW! Skipping step" lines).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(HERE))

from build_model import SIZES, count_params, llama_config  # noqa: E402

# Dense bf16 tensor-core peaks (no 2:4 sparsity) from NVIDIA's datasheets, matched in order against the device name.
PEAKS = [("H100 PCIe", 756.0e12, "H100 PCIe"), ("H100 NVL", 835.5e12, "H100 NVL"), ("H200 NVL", 835.5e12, "H200 NVL"),
         ("H100", 989.4e12, "H100 SXM"), ("H200", 989.4e12, "H200 SXM"), ("A100", 312.0e12, "A100")]
FLOPS_RULE = ("(6 x N + 12 x L x H x T) x tokens/s / peak: N all parameters (embeddings and untied head included), "
              "L layers, H hidden size (= heads x head dim), T tokens per sequence; 6N is the matmul FLOPs of forward "
              "+ backward per token and 12LHT attention's QK^T and AV, counted over the whole T x T square (PaLM, "
              "Chowdhery et al. 2022, appendix B; causal masking's halving not taken)")
RUNNERS = {"zt": "zerotrain", "ds": "ds_loop", "hf": "hf_trainer"}
LABELS = {"zerotrain": "zerotrain", "ds_loop": "DeepSpeed loop", "hf_trainer": "HF Trainer"}
OVERFLOW = "OVERFLOW! Skipping step"
GPU_FIT, HOST_FIT = 0.85, 0.95  # estimate fits if within this share of device / host memory (see size_estimates)
T0 = time.time()


@dataclass(frozen=True)
class Config:
    stage: int
    label: str
    offload: bool = False
    args: tuple[str, ...] = ()
    """Extra `zerotrain train` flags (zt only); the first must appear in `zerotrain train --help`."""
    need_s: float = 45
    """H100 wall time of the run, start-up included (2026-11-26 figures): not started with less time left."""


CONFIGS = {
    "0": Config(0, "ZeRO-0"), "1": Config(1, "ZeRO-1"), "2": Config(2, "ZeRO-2"), "3": Config(3, "ZeRO-3", need_s=55),
    "3-compile": Config(3, "ZeRO-3 + compile (each block)", args=("--compile",), need_s=100),
    "3-nofused": Config(3, "ZeRO-3, fused loss off", args=("--no-fused-loss",), need_s=55),
    "3off": Config(3, "ZeRO-3 + CPU offload (optimizer and params)", offload=True, need_s=75),
}
SIZING = {"size3": False, "size3off": True}  # plan entry -> offload


def elapsed() -> float:
    return time.time() - T0


def log(msg: str) -> None:
    print(f"[{elapsed():6.1f}s] {msg}", flush=True)


def env_vars(cpu: bool) -> dict:
    e = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
             PYTHONUNBUFFERED="1", TRANSFORMERS_VERBOSITY="error", PYTHONWARNINGS="ignore")
    e["OMP_NUM_THREADS"] = "1" if cpu else str(os.cpu_count() or 8)
    e["PYTHONPATH"] = os.pathsep.join([str(REPO), e.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return e


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def host_mem_bytes() -> int:
    with open("/proc/meminfo") as f:
        return int(next(x for x in f if x.startswith("MemTotal:")).split()[1]) * 1024


def environment() -> dict:
    import importlib.metadata as md

    import torch

    out = {"python": sys.version.split()[0], "torch": torch.__version__, "torch_cuda": torch.version.cuda,
           "cpus": os.cpu_count(), "host_mem_gib": round(host_mem_bytes() / 2**30, 1)}
    for p in ("deepspeed", "transformers", "accelerate", "datasets", "pydantic", "peft"):
        try:
            out[p] = md.version(p)
        except md.PackageNotFoundError:
            out[p] = None
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        out.update(device=p.name, gpu=p.name, gpu_mem_bytes=p.total_memory, gpu_mem_gib=round(p.total_memory / 2**30, 1),
                   sms=p.multi_processor_count, capability=f"{p.major}.{p.minor}")
        for key, cmd in (("nvidia_smi", ["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm",
                                         "--format=csv,noheader"]), ("nvcc", ["nvcc", "--version"])):
            try:
                text = subprocess.run(cmd, capture_output=True, text=True, timeout=20).stdout.strip()
                out[key] = text.splitlines()[-1] if key == "nvcc" and text else text
            except (OSError, subprocess.SubprocessError) as e:
                out[key] = repr(e)
    else:
        model = next((x.split(":", 1)[1].strip() for x in Path("/proc/cpuinfo").read_text().splitlines()
                      if x.startswith("model name")), "unknown CPU")
        out["device"] = f"CPU: {model} ({os.cpu_count()} cores visible)"
    return out


def device_peak(name: str, cuda: bool) -> dict:
    if not cuda:
        return {"flops": None, "source": "unknown on a CPU: MFU is given against the measured matmul rate only"}
    for key, flops, what in PEAKS:
        if key in name:
            return {"flops": flops, "source": f"NVIDIA {what} datasheet, dense bf16 (no sparsity)"}
    return {"flops": None, "source": f"no datasheet figure for {name!r} in PEAKS: MFU against the measured matmul only"}


def matmul_rate(precision: str) -> float:
    """TFLOP/s of a square matmul (median of 10 after 3 warm-ups): bf16 8192^3 on CUDA, the run's dtype 512^3 on CPU."""
    import torch

    cuda = torch.cuda.is_available()
    n, dt = (8192, torch.bfloat16) if cuda else (512, torch.bfloat16 if precision == "bf16" else torch.float32)
    a, b = (torch.randn(n, n, device="cuda" if cuda else "cpu", dtype=dt) for _ in range(2))
    times = []
    for i in range(13):
        if cuda:
            torch.cuda.synchronize()
        t = time.perf_counter()
        a @ b
        if cuda:
            torch.cuda.synchronize()
        if i >= 3:
            times.append(time.perf_counter() - t)
    del a, b
    if cuda:
        torch.cuda.empty_cache()
    return 2 * n**3 / statistics.median(times) / 1e12


def start_jit_builds(env: dict, logf: Path, cuda: bool, offload: bool) -> dict[str, subprocess.Popen]:
    """DeepSpeed's ops built in the background (they overlap the model build): fused_adam (GPU AdamW, what DeepSpeed
    steps with on a GPU; CPU mode steps with torch AdamW) and cpu_adam (the offloaded runs' optimizer), only when the
    plan has an offloaded entry (a plan without one, CI's, would only load it on a CPU the runs need)."""
    procs = {}
    for builder in ("FusedAdamBuilder",) * cuda + ("CPUAdamBuilder",) * offload:
        code = (f"import time; t=time.time(); from deepspeed.ops.op_builder import {builder}; {builder}().load(); "
                f"print('JIT {builder} built in', round(time.time()-t, 1), 's', flush=True)")
        with open(logf, "a") as fh:
            procs[builder] = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=fh,
                                              stderr=subprocess.STDOUT, cwd=REPO)
    return procs


def wait_build(proc: subprocess.Popen | None, timeout: float) -> int | None:
    """The build's exit code, None if still running after timeout. Never killed: a build killed mid-way leaves its
    lock file in the torch extensions directory and every later load of that op waits on it for ever."""
    if proc is None:
        return 0
    try:
        return proc.wait(timeout=max(1.0, timeout))
    except subprocess.TimeoutExpired:
        return None


def train_flags(env: dict) -> dict:
    """Which CONFIGS flags `zerotrain train --help` lists (the flags land in the tree while this suite exists)."""
    wanted = sorted({c.args[0] for c in CONFIGS.values() if c.args})
    try:
        p = subprocess.run([sys.executable, "-m", "zerotrain", "train", "--help"], env=env, cwd=REPO,
                           capture_output=True, text=True, timeout=120)
        text = p.stdout
    except (OSError, subprocess.SubprocessError) as e:
        return {f: f"`zerotrain train --help` failed: {e!r}" for f in wanted}
    return {f: True if re.search(rf"(?<![\w-]){re.escape(f)}(?![\w-])", text) else
            f"`zerotrain train --help` (exit {p.returncode}) lists no {f}" for f in wanted}


def estimate_size(size: str, cdir: Path, args: argparse.Namespace, env: dict) -> dict:
    """`zerotrain estimate` of ZeRO-3 for one size: device and host bytes, alone and with CPU offload."""
    cmd = [sys.executable, "-m", "zerotrain", "estimate", "--model-config", str(cdir / "config.json"), "--backends",
           "deepspeed", "--seq-len", str(args.seq_len), "--micro-batch", "1", "--gradient-checkpointing",
           "--precision", args.precision, "--json"]
    try:
        p = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=300)
        rows = json.loads(p.stdout)["estimates"]
    except (OSError, subprocess.SubprocessError, ValueError, KeyError) as e:
        return {"error": repr(e)[:300]}
    out: dict = {"params": count_params(llama_config(size, 0))}
    for kind, off in (("3", "none"), ("3off", "cpu")):
        r = next(x for x in rows if x["stage"] == 3 and x["offload_optimizer"] == off and x["offload_param"] == off)
        out[kind] = {"device_bytes": r["device_bytes"],
                     "host_bytes": r["baseline_rss"] + r["host_bytes"] + r["transient"]}
    return out


def fits(est: dict, kind: str, gpu_bytes: int | None, host_bytes: int) -> bool:
    """On a GPU: the device share within GPU_FIT of its memory and the host share (runtime baseline + offloaded states
    + the fp32 model zero.Init builds) within HOST_FIT of RAM; on a CPU both shares live in RAM."""
    e = est[kind]
    if gpu_bytes is None:
        return e["device_bytes"] + e["host_bytes"] <= HOST_FIT * host_bytes
    return e["device_bytes"] <= GPU_FIT * gpu_bytes and e["host_bytes"] <= HOST_FIT * host_bytes


def launch(job: dict, result: Path, env: dict, timeout: float, runlog: Path) -> tuple[int, str, float]:
    """One rank: runner.py with the environment torchrun gives a single worker (torchrun's agent would only add a
    second Python start-up), in its own process group, killed whole on timeout."""
    env = dict(env, RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", GROUP_RANK="0",
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    cmd = [sys.executable, str(HERE / "runner.py"), json.dumps(job), str(result)]
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


def flops_per_token(cfg: dict, params: int, seq: int) -> float:
    return 6 * params + 12 * cfg["num_hidden_layers"] * cfg["hidden_size"] * seq


def figures(job: dict, result: Path, fpt: float, peak: float | None, matmul_tflops: float | None, text: str) -> dict:
    r = json.loads(result.read_text())
    ends = r["step_ends"]
    d = [b - a for a, b in zip(ends, ends[1:])]  # d[i] is the duration of step i+2
    timed = d[job["warmup"] - 1:]
    out: dict = {"steps_recorded": len(ends), "peak_gpu_gib": round(r["peak_gpu_bytes"] / 2**30, 2),
                 "peak_rss_gib": round(r["peak_rss_bytes"] / 2**30, 2), "last_loss": r.get("last_loss"),
                 "ds_skipped_steps": text.count(OVERFLOW)}
    if not timed:
        return out
    tokens = job["micro_batch"] * job["grad_accum"] * job["seq_len"]
    step_s = statistics.median(timed)
    tps = tokens / step_s
    out.update(step_s=round(step_s, 4), step_s_min=round(min(timed), 4), step_s_max=round(max(timed), 4),
               timed_steps=len(timed), tokens_per_step=tokens, tokens_per_s=round(tps, 1),
               mfu=round(fpt * tps / peak, 4) if peak else None)
    if matmul_tflops:
        out["mfu_vs_measured_matmul"] = round(fpt * tps / (matmul_tflops * 1e12), 4)
    if job["runner"] == "zerotrain":
        metrics = Path(str(result) + ".run") / "metrics.jsonl"
        if metrics.is_file():
            recs = [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()]
            recs = [x for x in recs if "step_time_s" in x and x["step"] > job["warmup"]]
            if recs:
                out["zt_metrics_step_s"] = round(statistics.median(x["step_time_s"] for x in recs), 4)
                out["zt_metrics_tokens_per_s"] = round(statistics.median(x["tokens_per_s"] for x in recs), 1)
                out["zt_metrics_losses"] = [round(x["loss"], 4) for x in recs]
        if r.get("summary"):
            out["zt_summary_tokens_per_s"] = round(r["summary"].get("tokens_per_s", 0.0), 1)
    return out


def error_line(text: str) -> str:
    lines = [x for x in text.strip().splitlines() if x.strip()]
    keys = [x for x in lines if any(k in x for k in ("Error", "error:", "Traceback", "Killed", "OOM", "out of memory"))]
    pick = keys[-3:] if keys else lines[-3:]
    return " | ".join(x.strip()[:300] for x in pick)


def run_one(rec: dict, job: dict, state: dict, work: Path, env: dict, timeout: float, fpt: float, runlog: Path,
            ok_steps: int | None = None) -> None:
    """Launch job, fill rec with its figures (ok: timed steps measured, or ok_steps recorded) or its error."""
    result = work / f"{job['name']}.json"
    result.unlink(missing_ok=True)
    log(f"{job['name']}: start (timeout {timeout:.0f} s)")
    rc, text, wall = launch(job, result, env, timeout, runlog)
    rec.update(rc=rc, wall_s=round(wall, 1))
    if result.is_file():
        try:
            rec["fig"] = figures(job, result, fpt, state["peak"]["flops"], state.get("matmul_tflops"), text)
            rec["ok"] = rec["fig"]["steps_recorded"] >= ok_steps if ok_steps else "step_s" in rec["fig"]
        except (OSError, ValueError, KeyError) as e:
            rec["error"] = f"figures: {e!r}"
    if rc != 0 or not rec["ok"]:
        rec["error"] = (rec.get("error", "") + " " + error_line(text)).strip()
        rec["oom"] = "out of memory" in text.lower() or "OutOfMemory" in text
        if rc == -9:
            rec["status"] = f"timed out after {wall:.0f} s"
    f = rec.get("fig", {})
    log(f"{job['name']}: rc {rc}, {wall:.0f} s wall, {f.get('tokens_per_s')} tokens/s, MFU {f.get('mfu')}, peak GPU "
        f"{f.get('peak_gpu_gib')} GiB" + (f"  ERROR {rec.get('error', '')[:400]}" if not rec["ok"] else ""))


# --- RESULTS_GPU.md ------------------------------------------------------------------------------------------

def fmt(x, nd: int = 3) -> str:
    if x is None or x == "":
        return "-"
    if isinstance(x, float):
        return f"{x:,.{nd}f}" if abs(x) < 1000 else f"{x:,.0f}"
    return f"{x:,}" if isinstance(x, int) else str(x)


def count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e8 else f"{n / 1e6:.2f}M"


def results_md(state: dict) -> str:
    e, cpu, peak = state["env"], state["cpu_mode"], state["peak"]
    m, job = state.get("model") or {}, state.get("job_shape") or {}
    cfg = m.get("config", {})
    lines = [f"# GPU suite: {e.get('device')}", "",
             f"Written by `bash benchmarks/gpu_suite.sh{' --cpu' if cpu else ''}` on {state['started']} "
             f"({'CPU mode: a tiny Llama over gloo, the same code path as on a GPU; no speed claim' if cpu else 'CUDA'}); "
             "raw figures in gpu_results.json, each run's output in runs_log.txt.", "",
             f"- **Device:** {e.get('device')}" + (f"; {e.get('gpu_mem_gib')} GiB, {e.get('sms')} SMs, capability "
                                                  f"{e.get('capability')}; nvidia-smi: `{e.get('nvidia_smi')}`"
                                                  if not cpu else "") + f"; host RAM {e.get('host_mem_gib')} GiB, "
                                                                        f"{e.get('cpus')} CPUs.",
             f"- **Software:** python {e.get('python')}, torch {e.get('torch')} (CUDA {e.get('torch_cuda')}), "
             f"deepspeed {e.get('deepspeed')}, transformers {e.get('transformers')}, accelerate {e.get('accelerate')}, "
             f"datasets {e.get('datasets')}, pydantic {e.get('pydantic')}" + (f"; nvcc: {e.get('nvcc')}" if not cpu
                                                                               else "") + ".",
             "- **Peak for MFU:** " + (f"{peak['flops'] / 1e12:.1f} TFLOP/s" if peak["flops"] else "unknown")
             + f" ({peak['source']}). Measured matmul ({'bf16 8192^3' if not cpu else job.get('precision', '') + ' 512^3'}): "
               f"{fmt(state.get('matmul_tflops'), 4)} TFLOP/s.",
             f"- **MFU** = {FLOPS_RULE}. Here N = {fmt(m.get('params'))}, L = {cfg.get('num_hidden_layers')}, "
             f"H = {cfg.get('hidden_size')}, T = {job.get('seq_len')}: {fmt(state.get('flops_per_token', 0) / 1e9, 3)} "
             "GFLOP per token. \"MFU vs matmul\" divides by the measured matmul rate instead of the peak.",
             f"- **Model:** random-init Llama '{m.get('size')}' (hidden {cfg.get('hidden_size')}, "
             f"{cfg.get('num_hidden_layers')} layers, {cfg.get('num_attention_heads')}/{cfg.get('num_key_value_heads')} "
             f"heads, ffn {cfg.get('intermediate_size')}, vocab {cfg.get('vocab_size')}, untied head), "
             f"{fmt(m.get('params'))} parameters, built locally by benchmarks/gpu/build_model.py (no download).",
             f"- **Job, every runner:** seq {job.get('seq_len')}, micro-batch {job.get('micro_batch')}, grad-accum "
             f"{job.get('grad_accum')}, 1 rank ({fmt(job.get('tokens_per_step'))} tokens per optimizer step), "
             f"{job.get('precision')}, AdamW lr 1e-4 constant, clip 1.0, seed 0; {job.get('steps')} steps, the first "
             f"{job.get('warmup_excluded')} not timed (offload: {job.get('offload_steps')} / "
             f"{job.get('offload_warmup')}). Step time: median [min-max] between optimizer-step ends, each after a "
             "device sync.",
             f"- **Optimizer:** {state.get('optimizer', '-')}",
             "- **Loss:** zerotrain's runs use its fused head + cross-entropy (no whole logits tensor) unless the row "
             "says it is off; the DeepSpeed loop and HF Trainer compute HF's loss over the whole logits.",
             "- **Peers:** DeepSpeed loop = benchmarks/peers/ds_loop.py's config (DeepSpeed's defaults); HF Trainer = "
             "benchmarks/peers/hf_trainer.py's (the HF docs' block).", "",
             "| run | configuration | step s (median [min-max]) | tokens/s | MFU | MFU vs matmul | peak GPU GiB | "
             "peak host RSS GiB | DeepSpeed skipped steps | status |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in state["runs"]:
        f = r.get("fig", {})
        st = (("ok" if r.get("rc") == 0 else f"ok, then exit {r.get('rc')}: {r.get('error', '')[:150]}") if r["ok"] else
              r.get("status") or f"failed (rc {r.get('rc')}): {r.get('error', '')[:200]}")
        step = f"{f['step_s']:.3f} [{f['step_s_min']:.3f}-{f['step_s_max']:.3f}]" if "step_s" in f else "-"
        lines.append(f"| {r['name']} | {LABELS[r['runner']]} {CONFIGS[r['config']].label} | {step} | "
                     f"{fmt(f.get('tokens_per_s'))} | {fmt(f.get('mfu'))} | {fmt(f.get('mfu_vs_measured_matmul'))} | "
                     f"{'-' if cpu else fmt(f.get('peak_gpu_gib'), 1)} | {fmt(f.get('peak_rss_gib'), 1)} | "
                     f"{fmt(f.get('ds_skipped_steps')) if f else '-'} | {st} |")
    by = {r["name"]: r["fig"]["tokens_per_s"] for r in state["runs"] if r["ok"]}
    pairs = [("zt3", "ds3"), ("zt3", "hf3"), ("zt3-nofused", "ds3"), ("zt3-nofused", "hf3"), ("zt3", "zt3-nofused"),
             ("zt3-compile", "zt3"), ("zt3off", "zt3"), ("zt2", "zt3"), ("zt2", "ds2"), ("zt2", "hf2")]
    ratios = [f"| {a} / {b} | {by[a] / by[b]:.2f} |" for a, b in pairs if a in by and b in by]
    if ratios:
        lines += ["", "| tokens/s ratio | value |", "| --- | --- |", *ratios]
    lines += sizing_md(state)
    late = [r["name"] for r in state["runs"] if r.get("late")]
    late += [k for k, r in (state.get("sizing_result") or {}).items() if r.get("late")]
    if late:
        lines += ["", f"Not run for the deadline: {', '.join(late)}. In a second slot: `OUT=/tmp/ztgpu-out2 bash "
                      f"benchmarks/gpu_suite.sh 540 --plan {','.join(late)}`."]
    if state.get("jit"):
        lines += ["", f"JIT builds: {'; '.join(state['jit'])}"]
    lines += ["", f"Driver time {elapsed():.0f} s of a {state['deadline_s']:.0f} s deadline."]
    return "\n".join(lines) + "\n"


def sizing_md(state: dict) -> list[str]:
    ests = state.get("size_estimates") or {}
    if not ests:
        return []
    gpu, host = state["env"].get("gpu_mem_bytes"), state["env"]["host_mem_gib"]
    out = ["", "## Largest model ZeRO-3 trains, with and without CPU offload", "",
           "From scratch under zero.Init, micro-batch 1, seq " + str(state["job_shape"]["seq_len"]) + ", gradient "
           "checkpointing. `zerotrain estimate` picks the largest size that fits: " +
           (f"device share within {GPU_FIT:.0%} of the GPU's {state['env']['gpu_mem_gib']} GiB and host share "
            f"(runtime baseline + offloaded states + the fp32 model zero.Init builds) within {HOST_FIT:.0%} of the "
            f"host's {host} GiB" if gpu else f"both shares within {HOST_FIT:.0%} of the host's {host} GiB (CPU)") +
           "; one run confirms it (one size down if that runs out of memory).", "",
           "| size | parameters | estimate ZeRO-3: device GiB | fits | estimate + offload: device / host GiB | fits |",
           "| --- | --- | --- | --- | --- | --- |"]
    for size, est in ests.items():
        if "error" in est:
            out.append(f"| {size} | - | estimate failed: {est['error'][:150]} | | | |")
            continue
        a, b = est["3"], est["3off"]
        out.append(f"| {size} | {count(est['params'])} | {a['device_bytes'] / 2**30:.1f} | {est['fits_3']} | "
                   f"{b['device_bytes'] / 2**30:.1f} / {b['host_bytes'] / 2**30:.1f} | {est['fits_3off']} |")
    if state["sizing"]:
        out += ["", "| confirming run | parameters | result | step s | peak GPU GiB | peak host RSS GiB | wall s |",
                "| --- | --- | --- | --- | --- | --- | --- |"]
        for s in state["sizing"]:
            f = s.get("fig", {})
            res = "trained" if s["ok"] else s.get("status") or f"failed: {s.get('error', '')[:200]}"
            out.append(f"| {s['name']} | {count(s['params'])} | {res} | {fmt(f.get('step_s'))} | "
                       f"{'-' if state['cpu_mode'] else fmt(f.get('peak_gpu_gib'), 1)} | {fmt(f.get('peak_rss_gib'), 1)} | "
                       f"{fmt(s.get('wall_s'), 0)} |")
    for kind, res in (state.get("sizing_result") or {}).items():
        out.append(f"\n{'With' if SIZING[kind] else 'Without'} offload: the estimate's largest fit is "
                   f"{res['estimated']}; largest confirmed by a run: {res['confirmed'] or 'none'}.")
    return out


# --- the plan ------------------------------------------------------------------------------------------------

def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--deadline", type=float, default=500, help="seconds from start; later entries are skipped")
    ap.add_argument("--cpu", action="store_true", help="CPU mode (also without CUDA): tiny Llama, gloo, seq 64, 4 steps")
    ap.add_argument("--size", default="1b", choices=list(SIZES))
    ap.add_argument("--plan", default="zt3,ds3,hf3,zt3-compile,zt3-nofused,zt2,zt1,zt0,zt3off,size3,size3off",
                    help=f"comma list: zt|ds|hf + one of {','.join(CONFIGS)} (compile / nofused: zt only), "
                         f"or {' / '.join(SIZING)}")
    ap.add_argument("--sizes", default="1b,3b,4b,5b,6b,7b", help="sizing candidates, smallest first")
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--grad-accum", type=int, default=2)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--run-timeout", type=float, default=150, help="per run; compile runs get 1.6x")
    ap.add_argument("--work", default="/tmp/ztgpu")
    ap.add_argument("--torch-adam", action="store_true", help="every runner steps with torch AdamW (no fused_adam)")
    args = ap.parse_args()
    bad = [x for x in args.plan.split(",") if x and x not in SIZING and (x[:2] not in RUNNERS or x[2:] not in CONFIGS)]
    if bad:
        ap.error(f"--plan: unknown entries {bad}")
    import torch

    cuda = torch.cuda.is_available()
    cpu = args.cpu or not cuda
    if cpu:  # the start-up of each run dominates on a CPU; the steps only have to exist
        args.size, args.seq_len, args.micro_batch, args.grad_accum, args.steps, args.warmup = "tiny", 64, 2, 2, 4, 2
        args.sizes = "tiny"
        # DeepSpeed's CPU FusedAdam probes the CPU (py-cpuinfo, ~2 s a run): torch AdamW instead
        args.torch_adam = True
    args.precision = "bf16" if cuda or torch.ops.mkldnn._is_mkldnn_bf16_supported() else "fp32"
    out, work = Path(args.out), Path(args.work)
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    env = env_vars(cpu)
    state: dict = {"env": environment(), "cpu_mode": cpu, "runs": [], "sizing": [], "precision": args.precision,
                   "started": time.strftime("%Y-%m-%d %H:%M:%S"), "deadline_s": args.deadline, "plan": args.plan,
                   "mfu_formula": FLOPS_RULE}
    state["peak"] = device_peak(state["env"].get("gpu", ""), cuda)
    res_json, res_md, runlog, jitlog = (out / "gpu_results.json", out / "RESULTS_GPU.md", out / "runs_log.txt",
                                        out / "jit_log.txt")

    def save() -> None:
        state["driver_s"] = round(elapsed())
        res_json.write_text(json.dumps(state, indent=1, default=str))
        res_md.write_text(results_md(state))

    log(f"environment: {json.dumps(state['env'])}")
    pool = ThreadPoolExecutor(4)
    flags_f = pool.submit(train_flags, env)
    jit = start_jit_builds(env, jitlog, cuda, any(x.endswith("off") for x in args.plan.split(",")))
    state["matmul_tflops"] = round(matmul_rate(args.precision), 1 if cuda else 4)
    log(f"matmul: {state['matmul_tflops']} TFLOP/s; peak {state['peak']}")
    save()

    mdir, data = work / f"llama-{args.size}", work / "data.jsonl"
    t = time.perf_counter()
    p = subprocess.run([sys.executable, str(HERE / "build_model.py"), "--out", str(mdir), "--data", str(data),
                        "--size", args.size, "--repeat", "1" if cpu else "8"], env=env, cwd=REPO,
                       capture_output=True, text=True, timeout=300)
    if p.returncode != 0:
        log("model build failed:\n" + p.stdout[-3000:] + p.stderr[-3000:])
        state["model_build_error"] = error_line(p.stderr)
        save()
        return 1
    state["model"] = json.loads(p.stdout.strip().splitlines()[-1])
    cfg = json.loads((mdir / "config.json").read_text())
    state["model"]["config"] = {k: cfg[k] for k in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                                                    "num_key_value_heads", "intermediate_size", "vocab_size")}
    params = state["model"]["params"]
    state["flops_per_token"] = flops_per_token(cfg, params, args.seq_len)
    off_steps, off_warmup = min(args.steps, 8), min(args.warmup, 2)  # CPU Adam steps take a second: fewer
    state["job_shape"] = {"seq_len": args.seq_len, "micro_batch": args.micro_batch, "grad_accum": args.grad_accum,
                          "world": 1, "steps": args.steps, "warmup_excluded": args.warmup, "precision": args.precision,
                          "tokens_per_step": args.seq_len * args.micro_batch * args.grad_accum,
                          "offload_steps": off_steps, "offload_warmup": off_warmup}
    log(f"model built in {time.perf_counter() - t:.0f} s: {state['model']}")
    sizes = [s for s in args.sizes.split(",") if s]
    size_cfg: dict[str, Path] = {}
    for s in sizes:  # from-scratch configs with the tokenizer's ids, estimated in the background
        size_cfg[s] = work / f"cfg-{s}"
        llama_config(s, cfg.get("eos_token_id", 0)).save_pretrained(size_cfg[s])
    est_f: dict[str, Future] = {s: pool.submit(estimate_size, s, size_cfg[s], args, env) for s in sizes}
    save()

    if "FusedAdamBuilder" in jit:  # the first run steps with fused_adam: wait for its build
        t = time.perf_counter()
        rc = wait_build(jit["FusedAdamBuilder"], max(30.0, min(180.0, args.deadline - elapsed() - 120)))
        state["fused_adam_build"] = {"rc": rc, "waited_s": round(time.perf_counter() - t, 1)}
        log(f"fused_adam JIT build: rc {rc} (waited {time.perf_counter() - t:.0f} s)")
        if rc != 0:
            state["torch_adam_fallback"] = True
            log("fused_adam did not build (in time): every runner steps with torch AdamW (torch_adam) instead")
    torch_adam = bool(state.get("torch_adam_fallback") or args.torch_adam)
    why = "CPU mode" if cpu else "DeepSpeed's fused_adam did not build" if state.get("torch_adam_fallback") else "--torch-adam"
    state["optimizer"] = (f"torch AdamW for every runner ({why})" if torch_adam else
                          "DeepSpeed's FusedAdam (JIT-built here) for every runner") + \
        "; the offloaded runs step with DeepSpeedCPUAdam."
    flags = flags_f.result()  # bounded by the --help call's own timeout
    state["train_flags"] = flags
    base = {"model": str(mdir), "data": str(data), "seq_len": args.seq_len, "micro_batch": args.micro_batch,
            "grad_accum": args.grad_accum, "steps": args.steps, "warmup": args.warmup, "precision": args.precision,
            "torch_adam": torch_adam}
    need_scale = 0.3 if cpu else 1.0  # CPU-mode runs take ~10 s, not an H100 run's ~45

    for name in [x for x in args.plan.split(",") if x]:
        if name.endswith("off") and wait_build(jit.get("CPUAdamBuilder"), args.deadline - elapsed()) != 0:
            log("cpu_adam JIT build failed or still running: the offloaded run may build it itself")
        if name in SIZING:
            sizing(name, state, args, base, est_f, size_cfg, env, work, runlog, need_scale, save)
            continue
        runner, key = RUNNERS[name[:2]], name[2:]
        c = CONFIGS[key]
        rec: dict = {"name": name, "runner": runner, "config": key, "stage": c.stage, "offload": c.offload,
                     "args": list(c.args), "ok": False}
        state["runs"].append(rec)
        left = args.deadline - elapsed()
        need = max(c.need_s, 0 if runner == "zerotrain" else 55) * need_scale
        if c.args and runner != "zerotrain":
            rec["status"] = f"skipped: {c.args[0]} is a zerotrain train flag"
        elif c.args and flags[c.args[0]] is not True:
            rec["status"] = f"skipped: flag not available ({flags[c.args[0]]})"
        elif left < need:
            rec.update(status=f"skipped: {left:.0f} s left of the deadline, needs ~{need:.0f}", late=True)
        if "status" in rec:
            log(f"{name}: {rec['status']}")
            save()
            continue
        job = {**base, "name": name, "runner": runner, "stage": c.stage, "offload": c.offload,
               "extra_args": list(c.args)}
        if c.offload:
            job.update(steps=off_steps, warmup=off_warmup)
        tmo = min(args.run_timeout * (1.6 if "--compile" in c.args else 1.0), left)
        run_one(rec, job, state, work, env, tmo, state["flops_per_token"], runlog)
        save()

    collect_estimates(state, est_f, args.deadline + 20 - elapsed())  # reported even without a sizing entry
    for builder, pr in jit.items():  # normally long done; see wait_build
        if wait_build(pr, min(60.0, args.deadline + 20 - elapsed())) is None:
            log(f"{builder} JIT build still running: left to finish")
    jit_lines = jitlog.read_text().splitlines() if jitlog.is_file() else []
    state["jit"] = [x for x in jit_lines if x.startswith("JIT ")] or jit_lines[-3:]
    pool.shutdown(wait=False, cancel_futures=True)
    save()
    print(res_md.read_text(), flush=True)
    return 0


def collect_estimates(state: dict, est_f: dict[str, Future], timeout: float) -> dict:
    """The background `zerotrain estimate` results, each with whether it fits this machine (see fits)."""
    gpu, host = state["env"].get("gpu_mem_bytes"), host_mem_bytes()
    ests = state.setdefault("size_estimates", {})
    for s, fut in est_f.items():
        if s not in ests:
            try:
                ests[s] = fut.result(timeout=max(1.0, timeout))
            except Exception as e:  # noqa: BLE001 - a failed estimate is reported, not fatal
                ests[s] = {"error": repr(e)[:300]}
            if "error" not in ests[s]:
                ests[s].update({f"fits_{k}": fits(ests[s], k, gpu, host) for k in ("3", "3off")})
    return ests


def sizing(name: str, state: dict, args: argparse.Namespace, base: dict, est_f: dict, size_cfg: dict, env: dict,
           work: Path, runlog: Path, need_scale: float, save) -> None:
    """The estimate's largest fitting size for ZeRO-3 alone (size3) or with CPU offload (size3off), confirmed by a
    run; one size down if that run runs out of memory."""
    offload = SIZING[name]
    kind = "3off" if offload else "3"
    ests = collect_estimates(state, est_f, args.deadline - elapsed())
    ok = [s for s in size_cfg if "error" not in ests[s]]
    fitting = [s for s in ok if ests[s][f"fits_{kind}"]]
    pick = fitting[-1] if fitting else (ok[0] if ok else None)
    res = state.setdefault("sizing_result", {})[name] = {"estimated": fitting[-1] if fitting else None,
                                                          "confirmed": None}
    save()
    tries = [pick] + ([ok[ok.index(pick) - 1]] if pick and ok.index(pick) > 0 else [])
    for size in tries:
        if size is None:
            break
        n = ests[size]["params"]
        rec: dict = {"name": f"size-{size}-{'zero3_offload' if offload else 'zero3'}", "size": size, "params": n,
                     "offload": offload, "ok": False}
        state["sizing"].append(rec)
        left = args.deadline - elapsed()
        need = (60 + (n / 1e9) * (12 if offload else 6)) * need_scale
        if left < need:
            rec["status"] = f"skipped: {left:.0f} s left, needs ~{need:.0f}"
            res["late"] = True
            log(f"{rec['name']}: {rec['status']}")
            save()
            return
        job = {**base, "name": rec["name"], "runner": "zerotrain", "stage": 3, "offload": offload,
               "model_config": str(size_cfg[size] / "config.json"), "micro_batch": 1, "grad_accum": 1, "steps": 2,
               "warmup": 1, "grad_ckpt": True}
        cfg = json.loads((size_cfg[size] / "config.json").read_text())
        run_one(rec, job, state, work, env, min(args.run_timeout, left), flops_per_token(cfg, n, args.seq_len),
                runlog, ok_steps=2)
        save()
        if rec["ok"]:
            res["confirmed"] = size
            save()
            return
        if not rec.get("oom"):
            return  # failed for another reason (or timed out): says nothing about size


if __name__ == "__main__":
    sys.exit(main())
