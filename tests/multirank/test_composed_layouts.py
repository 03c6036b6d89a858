"""Composed parallel layouts on real CPU ranks against one plain process with the same global batch: tensor x
pipeline (x data) parallelism on the FSDP2 backend (torch.distributed.pipelining stages, DTensor tp_plan inside
each, FSDP2 over dp; backends/fsdp/pipeline.py). CI: tp2 x pp2 on a Qwen2 (q/k/v biases: the colwise split cuts
them too) with final/, eval logits, checkpoint, resume and export from one launch set; slow: tp2 x pp2 x dp2 on 8
ranks (Llama) and its resume onto dp 1."""
from __future__ import annotations

from pathlib import Path

import pytest

import tests.support.export_check as export_check
import tests.support.families as families
import tests.support.reference as ref

FP32_RTOL = export_check.FP32_RTOL
TP, PP = 2, 2


def tp_pp_worker(model_dir: Path, out: Path, *args, nproc: int, dp: int) -> dict:
    """A tp 2 x pp 2 x dp run: tp x pp x dp ranks (export_check's helpers pass nproc=2 for their 2-rank layouts,
    which this layout replaces by its own count)."""
    del nproc
    return ref.mp_worker(model_dir, out, "--backend", "fsdp", "--stage", "3", "--tp", TP, "--pp", PP, *args,
                         nproc=TP * PP * dp, dp=dp)


def assert_split_stages(result: dict, dp: int, num_blocks: int = 2, biases: bool = False) -> None:
    """Each rank holds only its stage's blocks (pipeline_parts.stage_bounds), the embeddings on the first stage
    and the head on the last, and its blocks' split linears (and Qwen2's q/k/v biases: `biases`) hold 1/tp of their
    weight, sharded over dp (equal
    losses alone would pass with every rank running the whole, unsplit model)."""
    from zerotrain.distributed.layout import WorldLayout
    from zerotrain.model.pipeline_parts import stage_bounds

    layout = WorldLayout(TP * PP * dp, tp=TP, pp=PP)
    bounds = stage_bounds(num_blocks, PP)
    for rank, names in enumerate(result["rank_params"]):
        stage = layout.pp_stage(rank)
        a, b = bounds[stage]
        blocks = {n.split(".")[1] for n in names if ".block." in n}
        assert len(blocks) == len(range(max(a, 1), min(b, num_blocks + 1))), (rank, sorted(names))
        assert any(".wte." in n for n in names) == (stage == 0), (rank, sorted(names))
        assert any(".lm_head." in n for n in names) == (stage == PP - 1), (rank, sorted(names))
    shares = result["param_local"]  # rank 0's: the first stage
    assert any(".self_attn.q_proj." in n for n in shares) and any(".mlp.down_proj." in n for n in shares), shares
    assert any(".self_attn.q_proj.bias" in n for n in shares) == biases, sorted(shares)
    for name, (local, full) in shares.items():
        assert local * TP * dp == full, (name, local, full)


@pytest.mark.multirank
def test_fsdp_tp2_pp2_parity_final_resume_and_export(tmp_path):
    """tp2 x pp2 on 4 ranks: losses and grad norms equal the one process's (1e-5), final/ its weights (1e-4), the
    pipeline's eval logits final/'s; a resume from step 3 repeats steps 3-5 exactly; `zerotrain export` of the
    step-6 checkpoint (DCP shards of every stage and tp split, keyed by HF names) reloads as final/."""
    qwen2 = families.make_model_dir("qwen2", tmp_path / "qwen2")
    straight, reference = export_check.checkpointed_run(tp_pp_worker, qwen2, tmp_path, "tp2pp2.json",
                                                        "fsdp tp=2 x pp=2 qwen2", "--probe-out", tmp_path / "probe.pt")
    assert_split_stages(straight, dp=1, biases=True)
    hf = export_check.final_weights(tmp_path, reference)
    export_check.final_model(tmp_path)
    meta = export_check.step3_meta(tmp_path)
    assert meta["extra"] == {"tp": TP, "pp": PP, "optimizer": "adamw"} and meta["format"] == "dcp", meta
    export_check.assert_resume_and_export(tp_pp_worker, qwen2, tmp_path, straight, hf)


@pytest.mark.multirank
@pytest.mark.slow  # 8 ranks: over CI's 4-rank limit
def test_fsdp_tp2_pp2_dp2_on_eight_ranks_and_resume_onto_dp1(tmp_path):
    """tp2 x pp2 x dp2 (Llama) against the one process with the same global batch; its step-3 checkpoint resumed
    on 4 ranks (dp 1: DCP reshards every tp split and FSDP shard) repeats the same steps."""
    llama = families.make_model_dir("llama", tmp_path / "llama")
    result = tp_pp_worker(llama, tmp_path / "dp2.json", "--ckpt-root", tmp_path / "ck", "--save-at", "3",
                          nproc=8, dp=2)
    ref.assert_parity(result, ref.mp_reference(llama, dp=2), FP32_RTOL, FP32_RTOL, "fsdp tp=2 x pp=2 x dp=2",
                      clip=ref.MP_CLIP)
    assert_split_stages(result, dp=2)
    resumed = tp_pp_worker(llama, tmp_path / "dp1.json", "--resume", tmp_path / "ck" / "global_step3", nproc=4, dp=1)
    assert resumed["start_step"] == 3
    for key in ("loss", "grad_norm"):
        assert ref.max_rel(ref.series(resumed, key, start=3), ref.series(result, key, start=3)) < FP32_RTOL, key


@pytest.mark.multirank
@pytest.mark.slow  # LoRA's CI cells are tests/multirank/test_lora.py's and test_lora_tensor_parallel.py's
@pytest.mark.parametrize("tp", [1, 2], ids=["pp2", "tp2-pp2"])
def test_lora_pp2_fsdp_parity_adapter_and_export(tmp_path, tp):
    """LoRA inside FSDP2 pipeline stages (pp 2, and tp 2 x pp 2: peft's layers split by
    backends/fsdp/tensor_parallel.py lora_plan; Llama) against one plain peft process with the same global batch:
    losses 1e-5; final/ is peft's adapter (every tensor whole, equal to the reference's), which on its base gives
    the pipeline's eval logits, and merged/ a plain HF model; `zerotrain export` of the step-6 checkpoint (the
    stages' adapters, tp slices gathered) gives the same adapter."""
    import json

    from peft import PeftModel
    from safetensors.torch import load_file

    import tests.multirank.test_lora as tl
    from tests.support.launch import ranks
    from zerotrain.export.to_hf import export_checkpoint
    from zerotrain.model.lora import load_base
    from zerotrain.tasks import task_spec

    base_dir = families.make_model_dir("llama", tmp_path / "llama")
    reference = ref.reference_run(base_dir, steps=ref.STEPS, world=1, grad_accum=ref.ACCUM, micro=ref.mp_micro(1),
                                  lr=tl.LR, weight_decay=ref.WD, clip=tl.CLIP, warmup=ref.WARMUP,
                                  build=tl.lora_build(base_dir, "causal-lm"))
    out = tmp_path / "run.json"
    ranks(ref.engine_worker_args(base_dir, out, "--backend", "fsdp", "--stage", "3", "--pp", PP, "--tp", tp,
                                 "--micro", ref.mp_micro(1), "--lora-r", tl.R, "--lr", tl.LR, "--clip", tl.CLIP,
                                 "--save-hf", tmp_path / "final", "--probe-out", tmp_path / "probe.pt",
                                 "--merge-lora", "--ckpt-root", tmp_path / "ck", "--save-at", "3", "6"),
          nproc=PP * tp, timeout=400)
    result = json.loads(out.read_text())
    ref.assert_parity(result, reference, FP32_RTOL, FP32_RTOL, f"lora fsdp tp={tp} x pp=2 llama", clip=tl.CLIP)
    adapter = load_file(str(tmp_path / "final" / "adapter_model.safetensors"))
    trained = {k: v for k, v in reference["state_dict"].items() if "lora_" in k}
    import torch
    import transformers

    assert sorted(adapter) == sorted(k.replace(".default", "") for k in trained) and trained  # every stage's
    for k, v in trained.items():
        torch.testing.assert_close(adapter[k.replace(".default", "")], v, rtol=1e-4, atol=1e-5)

    hf_config = transformers.AutoConfig.from_pretrained(str(base_dir))
    peft_model = PeftModel.from_pretrained(load_base(str(base_dir), task_spec("causal-lm"), hf_config),
                                           str(tmp_path / "final"))
    torch.testing.assert_close(tl.probe_logits(peft_model), torch.load(tmp_path / "probe.pt"), rtol=1e-5, atol=1e-5)
    merged = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "final" / "merged"))
    torch.testing.assert_close(tl.probe_logits(merged), torch.load(tmp_path / "probe.pt"), rtol=1e-4, atol=1e-4)
    exported = export_checkpoint(tmp_path / "ck" / "global_step6", tmp_path / "exported")
    again = load_file(str(Path(exported) / "adapter_model.safetensors"))
    assert sorted(again) == sorted(adapter)
    for k, v in adapter.items():
        torch.testing.assert_close(again[k], v)
