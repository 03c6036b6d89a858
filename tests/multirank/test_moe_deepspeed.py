"""Expert parallelism on the DeepSpeed backend (--ep 2 through DeepSpeed's AutoEP, zerotrain/backends/deepspeed/
expert_parallel.py) on real CPU ranks, the router load-balancing loss on (--router-aux-coef 0.5): the losses (LM +
router loss) and grad norms equal one process with the same global batch and clipping active; each rank holds half
of every block's experts; final/ is one HF model (experts back in gate_up_proj / down_proj) with the trained weights
and logits; the step-3 checkpoint resumes exactly; `zerotrain export` of the step-6 checkpoint equals final/.
CI: Mixtral at ZeRO 2; slow: Qwen3-MoE, ZeRO 0 and 1, and the CLI (`zerotrain train --ep 2 --backend deepspeed`,
--resume, expert load in metrics.jsonl).
"""
from __future__ import annotations

import json

import pytest
import torch

import tests.support.families as families
import tests.support.reference as ref
from tests.support.launch import ranks
from tests.support.matrix import cells

pytestmark = pytest.mark.multirank

FP32_RTOL = 1e-5
EP_CLIP = 0.5
"""Below some step's gradient norm of both families, so clipping acts."""
ROUTER_COEF = 0.5
"""Far above the configs' defaults: the router loss (about 2.0, 4 experts top-2) adds ~1.0 to every step's loss."""
CELLS = {"mixtral-z2": ("mixtral", 2), "mixtral-z0": ("mixtral", 0), "mixtral-z1": ("mixtral", 1),
         "qwen3-moe-z2": ("qwen3-moe", 2)}
SLOW = {"mixtral-z0", "mixtral-z1", "qwen3-moe-z2"}
"""CI: Mixtral at ZeRO 2 (one launch for parity, final/ and export, one for the resume)."""


@pytest.mark.parametrize("cell", cells(list(CELLS), SLOW))
def test_ep2_on_deepspeed_equals_one_process_with_router_loss_resumes_and_exports(tmp_path, cell):
    from transformers import AutoModelForCausalLM

    from zerotrain.export.to_hf import export_checkpoint

    family, stage = CELLS[cell]
    d = families.make_model_dir(family, tmp_path / "model")
    out, final, ck = tmp_path / "run.json", tmp_path / "final", tmp_path / "ck"
    flags = ["--backend", "deepspeed", "--stage", stage, "--ep", 2, "--clip", EP_CLIP, "--router-aux-coef", ROUTER_COEF]
    ranks(ref.engine_worker_args(d, out, *flags, "--ckpt-root", ck, "--save-at", 3, 6, "--save-hf", final,
                                 "--probe-out", tmp_path / "probe.pt"), timeout=400)
    result = json.loads(out.read_text())
    run = dict(steps=ref.STEPS, world=ref.WORLD, grad_accum=ref.ACCUM, micro=ref.MICRO, lr=ref.LR, weight_decay=ref.WD,
               clip=EP_CLIP, warmup=ref.WARMUP)
    reference = ref.reference_run(d, router_aux_coef=ROUTER_COEF, **run)
    ref.assert_parity(result, reference, FP32_RTOL, FP32_RTOL, f"{cell} ep2 router loss x {ROUTER_COEF}", clip=EP_CLIP)
    assert "mixture of experts: router load-balancing loss x 0.5" in " ".join(result["describe"]), result["describe"]
    # the router loss is in the trained loss: without it every step's loss is ~1 lower (0.5 x ~2.0)
    plain = ref.reference_run(d, router_aux_coef=0.0, **run)
    assert all(0.9 < a - b < 1.1 for a, b in zip(ref.series(result, "loss"), plain["losses"]))
    # each rank held half of every block's experts (DeepSpeed's AutoEP record of the checkpoint)
    states = torch.load(ck / "global_step3" / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=False)
    layers = states["ds_autoep_layers"]
    cfg = families.FAMILIES[family].config()
    assert len(layers) == cfg.num_hidden_layers and all(
        (i["ep_size"], i["num_local_experts"] * 2) == (2, i["num_experts"]) for i in layers), layers
    # final/: one HF model (experts gathered, in HF layout) with the trained weights and logits
    model = AutoModelForCausalLM.from_pretrained(str(final), dtype=torch.float32).eval()
    state = model.state_dict()
    assert set(state) == set(reference["state_dict"]), set(state) ^ set(reference["state_dict"])
    for k, v in reference["state_dict"].items():
        torch.testing.assert_close(state[k], v, rtol=1e-4, atol=1e-5, msg=k)
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ref.probe_input()).logits, torch.load(tmp_path / "probe.pt"),
                                   rtol=1e-5, atol=1e-5)
    # `zerotrain export` of the step-6 checkpoint (one process, from DeepSpeed's per-expert files) equals final/
    exported = AutoModelForCausalLM.from_pretrained(str(export_checkpoint(ck / "global_step6", tmp_path / "export")),
                                                    dtype=torch.float32).state_dict()
    for k, v in state.items():
        torch.testing.assert_close(exported[k], v, rtol=0, atol=0, msg=k)
    # the step-3 checkpoint resumes: steps 4-6 exactly as the straight run
    resumed_out = tmp_path / "resume.json"
    ranks(ref.engine_worker_args(d, resumed_out, *flags, "--resume", ck / "global_step3"), timeout=400)
    resumed = json.loads(resumed_out.read_text())
    assert resumed["start_step"] == 3 and resumed["final_step"] == ref.STEPS
    diff = ref.max_rel(ref.series(resumed, "loss", 3), ref.series(result, "loss", 3))
    print(f"RESUME {cell}: loss max rel diff {diff:.2e}")
    assert diff == 0.0, diff
