"""LoRA under tensor parallelism (FSDP2: peft's layers split by the model's HF tp plan, backends/fsdp/tensor_parallel.py
lora_plan) and the tiled MLP under tp, on real CPU ranks against one plain-PyTorch + peft process with the same global
batch: per-step loss and grad norm (1e-5), the adapter in final/ (1e-4, full shapes), the split really made (each
colwise layer's lora_B and rowwise layer's lora_A hold 1/tp), the adapter and merged/ reloading with the engine's
logits, a resume from step 3 repeating the straight run exactly and `zerotrain export` of the step-6 checkpoint
equal to final/'s adapter."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import tests.support.families as families
import tests.support.reference as ref
from tests.multirank.test_lora import CLIP, LR, R, lora_build, probe_logits
from tests.support.launch import rank_env, ranks

FP32_RTOL = 1e-5
TILE = 8  # tokens per MLP tile: under the 32-token sequence, so every block's MLP runs in 4 tiles


def lora_tp_worker(model_dir: Path, out: Path, *args, backend: str = "fsdp", stage: int = 3, tp: int = 2,
                   pp: int = 1) -> dict:
    ranks(ref.engine_worker_args(model_dir, out, "--backend", backend, "--stage", stage, "--tp", tp, "--pp", pp,
                                 "--lora-r", R, "--lr", LR, "--clip", CLIP, "--micro", ref.mp_micro(1), *args),
          nproc=tp * pp, timeout=400, env=rank_env(TORCH_FR_BUFFER_SIZE="100000"))
    return json.loads(out.read_text())


def assert_mlp_tiled(collectives: Path, model_dir: Path) -> None:
    """The rowwise down_proj's all-reduce ran per tile of TILE tokens ([micro, TILE, hidden]) while attention's
    o_proj reduced the whole sequence ([micro, seq, hidden]): the tiling really ran under the tp split (the
    flight recorder's entries of rank 0, tests/support/engine_worker.py --collectives-out)."""
    hidden = json.loads((model_dir / "config.json").read_text())["hidden_size"]
    sizes = [e["in"] for e in json.loads(Path(f"{collectives}.0.json").read_text())["entries"]
             if "all_reduce" in e["op"] or "allreduce" in e["op"]]
    micro = ref.mp_micro(1)
    assert [[micro, TILE, hidden]] in sizes and [[micro, ref.DEFAULT_SEQ, hidden]] in sizes, sizes[:20]


def lora_tp_reference(model_dir: Path) -> dict:
    """One process, the same global batch as a tp run on one data-parallel replica."""
    return ref.reference_run(model_dir, steps=ref.STEPS, world=1, grad_accum=ref.ACCUM, micro=ref.mp_micro(1), lr=LR,
                             weight_decay=ref.WD, clip=CLIP, warmup=ref.WARMUP,
                             build=lora_build(model_dir, "causal-lm"))


def assert_adapters_split(result: dict, tp: int) -> None:
    """Each colwise layer's lora_B and each rowwise layer's lora_A (and their base layers) hold 1/tp on this rank."""
    shares = result["param_local"]
    for needle in (".self_attn.q_proj.lora_B.", ".self_attn.o_proj.lora_A.", ".mlp.down_proj.lora_A.",
                   ".mlp.gate_proj.lora_B."):
        assert any(needle in n for n in shares), (needle, sorted(shares))
    assert not any(".self_attn.q_proj.lora_A." in n or ".mlp.down_proj.lora_B." in n for n in shares), sorted(shares)
    for name, (local, full) in shares.items():
        assert local * tp == full, (name, local, full)


def check_lora_tp_run(model_dir: Path, tmp_path: Path, label: str, *flags, backend: str = "fsdp", stage: int = 3,
                      resume: bool = True) -> dict:
    """The straight run (saving at 3 and 6, final/ with merged/) against the one-process peft reference, its
    adapter and merged model, then (resume) the 3 + 3 resume and the export of step 6."""
    from peft import PeftModel
    from safetensors.torch import load_file

    from zerotrain.export.to_hf import export_checkpoint
    from zerotrain.model.lora import load_base
    from zerotrain.tasks import task_spec

    reference = lora_tp_reference(model_dir)
    extra = ["--ckpt-root", tmp_path / "ck", "--save-at", "3", "6"] if resume else []
    run = lambda out, *more: lora_tp_worker(model_dir, tmp_path / out, *flags, *more, backend=backend,  # noqa: E731
                                            stage=stage)
    result = run("run.json", "--save-hf", tmp_path / "final", "--merge-lora", "--probe-out", tmp_path / "probe.pt",
                 "--collectives-out", tmp_path / "collectives", *extra)
    ref.assert_parity(result, reference, FP32_RTOL, FP32_RTOL, label, clip=CLIP)
    losses = reference["losses"]
    # the adapters really trained: the loss moved by more than twice the parity tolerance (the tiny Qwen2 moves by
    # 7e-5 relative in 6 steps, Llama by more), and every lora_B left its zero start (below)
    assert abs(losses[-1] - losses[0]) > 2 * FP32_RTOL * abs(losses[0]), losses
    if backend == "fsdp":
        assert_adapters_split(result, tp=2)

    # final/: peft's adapter, every tensor gathered to its full shape and equal to the reference's
    final = tmp_path / "final"
    adapter = load_file(str(final / "adapter_model.safetensors"))
    trained = {k: v for k, v in reference["state_dict"].items() if "lora_" in k}
    assert len(adapter) == len(trained) > 0, (sorted(adapter), sorted(trained))
    by_suffix = {k.split("model.layers.", 1)[-1].replace(".default", ""): v for k, v in trained.items()}
    for k, v in adapter.items():
        torch.testing.assert_close(v, by_suffix[k.split("model.layers.", 1)[-1]], rtol=1e-4, atol=1e-5, msg=k)
    assert all(v.abs().max() > 0 for k, v in adapter.items() if "lora_B" in k)  # B moved off its zero start

    # the adapter on its base, and merged/, give the engine's own (tensor-parallel) logits after training
    import transformers

    engine_logits = torch.load(tmp_path / "probe.pt")
    base = load_base(str(model_dir), task_spec("causal-lm"), transformers.AutoConfig.from_pretrained(str(model_dir)))
    torch.testing.assert_close(probe_logits(PeftModel.from_pretrained(base, str(final))), engine_logits,
                               rtol=1e-5, atol=1e-5)
    merged = transformers.AutoModelForCausalLM.from_pretrained(str(final / "merged"))
    assert not any("lora" in n for n, _ in merged.named_parameters())
    torch.testing.assert_close(probe_logits(merged), engine_logits, rtol=1e-4, atol=1e-5)
    if not resume:
        return result

    # checkpoints hold the adapters (DCP, gathered on load), not the base; resume 3 + 3 == 6; export == final/
    ckpt_bytes = sum(f.stat().st_size for f in (tmp_path / "ck" / "global_step3").rglob("*") if f.is_file())
    assert ckpt_bytes < (model_dir / "model.safetensors").stat().st_size, ckpt_bytes
    resumed = run("resume.json", "--resume", tmp_path / "ck" / "global_step3")
    assert resumed["start_step"] == 3
    for key in ("loss", "grad_norm", "lr"):
        assert ref.series(resumed, key, start=3) == ref.series(result, key, start=3), key
    exported = export_checkpoint(tmp_path / "ck" / "global_step6", tmp_path / "export")
    for k, v in load_file(str(exported / "adapter_model.safetensors")).items():
        torch.testing.assert_close(v, adapter[k], rtol=1e-6, atol=1e-7, msg=k)
    return result


@pytest.mark.multirank
def test_lora_tp2_llama_fsdp_with_tiled_mlp(tmp_path):
    """CI: LoRA (all-linear) tp=2 on FSDP2 ZeRO-3 with every block's MLP tiled (the tiling is exact per token, so
    the untiled one-process run is the reference of both)."""
    llama = families.make_model_dir("llama", tmp_path / "llama")
    check_lora_tp_run(llama, tmp_path, "lora llama fsdp tp=2 tiled-mlp", "--tiled-mlp", TILE)
    assert_mlp_tiled(tmp_path / "collectives", llama)


@pytest.mark.slow
@pytest.mark.multirank
def test_lora_tp2_qwen2_fsdp_stage2(tmp_path):
    """Qwen2's q/k/v biases live in the colwise base layers (split with them); ZeRO-2 keeps the adapters whole per
    dp replica."""
    qwen2 = families.make_model_dir("qwen2", tmp_path / "qwen2")
    check_lora_tp_run(qwen2, tmp_path, "lora qwen2 fsdp z2 tp=2", stage=2, resume=False)


def tiled_mlp_reference(model_dir: Path) -> dict:
    return ref.mp_reference(model_dir, dp=1)


@pytest.mark.slow
@pytest.mark.multirank
@pytest.mark.parametrize("dim", ["tp", "pp"])
def test_tiled_mlp_under_model_parallelism_fsdp(tmp_path, dim):
    """Full fine-tuning with --tiled-mlp under tp=2 / pp=2 on FSDP2 equals the untiled one-process run."""
    llama = families.make_model_dir("llama", tmp_path / "llama")
    out = tmp_path / "run.json"
    ranks(ref.engine_worker_args(llama, out, "--clip", ref.MP_CLIP, "--micro", ref.mp_micro(1), "--backend", "fsdp",
                                 "--stage", 3, f"--{dim}", 2, "--tiled-mlp", TILE,
                                 "--collectives-out", tmp_path / "collectives"),
          nproc=2, timeout=400, env=rank_env(TORCH_FR_BUFFER_SIZE="100000"))
    result = json.loads(out.read_text())
    ref.assert_parity(result, tiled_mlp_reference(llama), FP32_RTOL, FP32_RTOL, f"tiled mlp fsdp {dim}=2",
                      clip=ref.MP_CLIP)
    if dim == "tp":
        assert_mlp_tiled(tmp_path / "collectives", llama)
